"""The built-in random-weight qwen3_moe model: deterministic generation, cache reuse, tokenizer,
chat template, and a checkpoint that transformers loads and runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import jinja2
import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open
from tokenizers import Tokenizer

from tandem import builtin


def _hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return builtin.ensure_builtin_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def template(model_dir) -> jinja2.Template:
    # Render as HF-format chat templates are rendered: a sandbox, trimmed blocks, and a tojson
    # that keeps non-ASCII text and key order and does not HTML-escape.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda obj: json.dumps(obj, ensure_ascii=False)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    return env.from_string(cfg["chat_template"])


# ---- generation and the cache ------------------------------------------------------------------


def test_layout_and_determinism(model_dir, tmp_path):
    assert model_dir.name == f"builtin-{builtin.VERSION}"
    names = {p.name for p in model_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "README.md", builtin.MANIFEST}
    other = builtin.ensure_builtin_model(tmp_path)
    assert other != model_dir
    assert _hashes(other) == _hashes(model_dir)
    manifest = json.loads((model_dir / builtin.MANIFEST).read_text())
    assert manifest["version"] == builtin.VERSION
    assert manifest["files"] == {k: v for k, v in _hashes(model_dir).items() if k != builtin.MANIFEST}
    assert "random" in (model_dir / "README.md").read_text().lower()


def test_reuses_existing_directory(model_dir, monkeypatch):
    def fail(_):
        raise AssertionError("regenerated a complete model directory")

    monkeypatch.setattr(builtin, "write_model", fail)
    assert builtin.ensure_builtin_model(model_dir.parent) == model_dir


def test_incomplete_directory_is_replaced(tmp_path):
    broken = tmp_path / f"builtin-{builtin.VERSION}"
    broken.mkdir()
    (broken / "config.json").write_text("{")  # an interrupted or foreign write: no manifest
    out = builtin.ensure_builtin_model(tmp_path)
    assert out == broken and (out / builtin.MANIFEST).is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert [p.name for p in tmp_path.iterdir()] == [broken.name]  # no temporary leftovers


def test_concurrent_first_use(tmp_path):
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(builtin.ensure_builtin_model(tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert builtin._is_complete(results[0])


def test_default_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "c"))
    assert builtin.default_cache_dir() == tmp_path / "c"


# ---- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic():
    # Two processes: the tokenizers library's hash maps are seeded per process.
    code = "import hashlib; from tandem import builtin; print(hashlib.sha256(builtin.train_tokenizer().encode()).hexdigest())"
    runs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
            for _ in range(2)}
    assert len(runs) == 1
    shipped = hashlib.sha256(builtin.TOKENIZER_ASSET.read_bytes()).hexdigest()
    assert runs.pop().strip() == shipped, (
        "assets/builtin_tokenizer.json no longer matches its training; run "
        "`python -m tandem.builtin --retrain-tokenizer` and bump builtin.VERSION"
    )


def test_tokenizer_round_trip(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == builtin.TOKENIZER_VOCAB
    for text in ["Hello, world! The quick brown fox.", "def f(x):\n    return x ** 2  # 12345\n",
                 "안녕하세요 — ça va? 🚀 tabs\tand  spaces", "an unseen wordzzqx"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    assert tok.encode("the model runs").tokens == ["the", "Ġmodel", "Ġruns"]  # merges learned words


def test_special_and_added_tokens(tok, model_dir):
    ids = {t: tok.token_to_id(t) for t in (*builtin.SPECIAL_TOKENS, *builtin.ADDED_TOKENS)}
    assert all(i is not None for i in ids.values())
    assert sorted(ids.values()) == list(range(builtin.TOKENIZER_VOCAB - len(ids), builtin.TOKENIZER_VOCAB))
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    enc = tok.encode(text).ids
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert ids[t] in enc
    assert tok.decode(enc, skip_special_tokens=False) == text
    # Special tokens are skipped on decode; the think and tool tags are ordinary added tokens.
    assert tok.decode(enc) == "assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert (gen["temperature"], gen["top_p"], gen["top_k"]) == (0.6, 0.95, 20)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    decoder = cfg["added_tokens_decoder"]
    assert decoder[str(ids["<think>"])] == {**decoder[str(ids["<think>"])], "content": "<think>", "special": False}
    assert decoder[str(ids["<|im_end|>"])]["special"] is True


def test_tandem_tokenizer_reads_it(model_dir):
    from tandem.tokenizer import Tokenizer as TandemTokenizer

    t = TandemTokenizer.from_dir(model_dir)
    assert t.eos_token == "<|im_end|>" and t.chat_template
    assert t.eos_token_ids == {t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")}
    assert t.generation_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


# ---- chat template -----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_template_plain_chat(template):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages=msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(messages=msgs[1:], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(messages=parts) == "<|im_start|>user\nab<|im_end|>\n"


def test_template_enable_thinking(template):
    msgs = [{"role": "user", "content": "Hi"}]
    on = template.render(messages=msgs, add_generation_prompt=True, enable_thinking=True)
    default = template.render(messages=msgs, add_generation_prompt=True)
    off = template.render(messages=msgs, add_generation_prompt=True, enable_thinking=False)
    assert on == default and on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"


def test_template_history_drops_old_reasoning(template):
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "new thoughts"}]
    assert template.render(messages=msgs) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\nA2<|im_end|>\n"
    )


def test_template_tools_and_tool_results(template):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Köln?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "18 C"}]
    out = template.render(messages=msgs, tools=TOOLS, add_generation_prompt=True)
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Köln?<|im_end|>\n"
        "<|im_start|>assistant\n"  # no reasoning and not the last message: no think block
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = template.render(messages=msgs[1:2], tools=TOOLS)
    assert no_system.startswith("<|im_start|>system\n# Tools\n")


def test_template_matches_transformers(model_dir, template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    for kwargs in ({}, {"enable_thinking": False}):
        ours = template.render(messages=msgs, tools=TOOLS, add_generation_prompt=True, **kwargs)
        theirs = hf.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours == theirs


# ---- config and weights ------------------------------------------------------------------------


def test_weights_match_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= builtin.TOKENIZER_VOCAB
    assert cfg["rope_theta"] == 1e6 and "rope_parameters" not in cfg
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_tensor("model.norm.weight").eq(1).all()
        w = f.get_tensor("model.layers.0.mlp.gate.weight")
    assert shapes == builtin.tensor_shapes(cfg)
    assert shapes["model.layers.3.mlp.experts.15.down_proj.weight"] == (128, 128)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64, 128)
    assert w.dtype == torch.float32 and 0.015 < w.std().item() < 0.025


def test_transformers_loads_and_runs(model_dir, tok):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        torch.testing.assert_close(model.lm_head.weight.detach(), f.get_tensor("lm_head.weight"))
        torch.testing.assert_close(model.model.layers[1].self_attn.q_proj.weight.detach(),
                                   f.get_tensor("model.layers.1.self_attn.q_proj.weight"))
    ids = torch.tensor([tok.encode("<|im_start|>user\nHello there<|im_end|>\n").ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], json.loads((model_dir / "config.json").read_text())["vocab_size"])
    assert torch.isfinite(logits).all()
