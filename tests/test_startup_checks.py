"""Start-up refuses bad files early: each broken file of a checkpoint directory is refused in one
line naming the file, the key and the value, before any model is built or memory allocated, by
the engine's load, by `tandem plan` and by `tandem serve` (which exits non-zero)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.cli import run
from tandem.models import loader
from tandem.models.loader import CheckpointError, check_config, inspect_checkpoint, load_checkpoint
from tandem.offload.planner import plan_memory
from tandem.tokenizer import Tokenizer, TokenizerError
from tiny_models import save_tiny_model

SERVE_TIMEOUT = 60  # s; a refusal takes about as long as importing torch


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pristine")
    save_tiny_model(d, "qwen3_moe", seed=3)  # 2 layers of 8 experts
    return d


def broken(pristine: Path, tmp_path: Path, file: str, **changes) -> Path:
    """A copy of the tiny checkpoint with `changes` written into `file` (a JSON object)."""
    d = tmp_path / "m"
    shutil.copytree(pristine, d)
    path = d / file
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))  # NaN / Infinity are written as JSON's NaN / Infinity
    return d


def assert_one_line(msg: str, *fragments: str) -> None:
    assert "\n" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg


# --- generation_config.json and tokenizer_config.json ------------------------------------------

BAD_GENERATION = [
    ({"temperature": "0.7"}, '"temperature" must be a number, got the string "0.7"'),
    ({"temperature": True}, '"temperature" must be a number, got the boolean true'),
    ({"top_p": float("nan")}, '"top_p" must be a finite number, got NaN'),
    ({"temperature": float("inf")}, '"temperature" must be a finite number, got Infinity'),
    ({"top_p": -0.5}, '"top_p" -0.5 is refused'),
    ({"top_p": 1.5}, '"top_p" 1.5 is refused'),
    ({"temperature": -1}, '"temperature" -1 is refused'),
    ({"repetition_penalty": 0}, '"repetition_penalty" 0 is refused'),
    ({"temperature": 10**400}, '"temperature" 1000'),
    ({"top_k": 2.5}, '"top_k" must be an integer, got the number 2.5'),
    ({"do_sample": "false"}, '"do_sample" must be true or false, got the string "false"'),
    ({"eos_token_id": "2"}, '"eos_token_id" must be a token id or a list of token ids, got the string "2"'),
    ({"eos_token_id": [2, "x"]}, '"eos_token_id" must be a token id or a list of token ids, got the string "x"'),
    ({"eos_token_id": 1.0}, '"eos_token_id" must be a token id or a list of token ids, got the number 1.0'),
    ({"eos_token_id": 10**9}, '"eos_token_id" 1000000000 is not a token of tokenizer.json (its ids run 0..'),
    ({"eos_token_id": 10**30}, '"eos_token_id" 1000000000000000000000000000000 is not a token of tokenizer.json'),
    ({"eos_token_id": -1}, '"eos_token_id" -1 is not a token of tokenizer.json'),
]


@pytest.mark.parametrize("changes,expected", BAD_GENERATION, ids=[json.dumps(c) for c, _ in BAD_GENERATION])
def test_generation_config_is_validated_like_a_request(pristine, tmp_path, changes, expected):
    d = broken(pristine, tmp_path, "generation_config.json", **changes)
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(d)
    assert_one_line(str(info.value), f"{d / 'generation_config.json'}: {expected}")


BAD_TOKENIZER_CONFIG = [
    ({"chat_template": 5}, '"chat_template" must be a string or a list of {"name", "template"} objects, '
                           "got the number 5"),
    ({"chat_template": [{"name": "default"}]}, '"chat_template"[0] must be an object with a string "name"'),
    ({"bos_token": 5}, '"bos_token" must be a string, null or an object with a string "content", got the number 5'),
    ({"eos_token": {"content": 5}}, '"eos_token" must be a string, null or an object with a string "content", '
                                    'got an object whose "content" is the number 5'),
    ({"eos_token": ["<|im_end|>"]}, '"eos_token" must be a string, null or an object'),
]


@pytest.mark.parametrize("changes,expected", BAD_TOKENIZER_CONFIG, ids=[json.dumps(c) for c, _ in BAD_TOKENIZER_CONFIG])
def test_tokenizer_config_types_are_checked(pristine, tmp_path, changes, expected):
    d = broken(pristine, tmp_path, "tokenizer_config.json", **changes)
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(d)
    assert_one_line(str(info.value), f"{d / 'tokenizer_config.json'}: {expected}")


@pytest.mark.parametrize("file", ["tokenizer_config.json", "generation_config.json"])
def test_a_file_that_is_not_an_object_is_refused(pristine, tmp_path, file):
    d = broken(pristine, tmp_path, file)
    (d / file).write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="must be a JSON object, got a list"):
        Tokenizer.from_dir(d)


def test_real_generation_configs_pass(pristine, tmp_path):
    # Qwen3's file (nulls, as some exporters write them, mean "not set").
    d = broken(pristine, tmp_path, "generation_config.json", bos_token_id=2040, do_sample=True,
               eos_token_id=[2041, 2040], pad_token_id=2040, temperature=0.6, top_k=20, top_p=0.95, min_p=None,
               transformers_version="4.51.0")
    tok = Tokenizer.from_dir(d)
    assert tok.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert {2040, 2041} <= tok.eos_token_ids
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 50.0}))
    assert Tokenizer.from_dir(d).generation_defaults == {"temperature": 0.0, "top_k": 50}


# --- config.json -------------------------------------------------------------------------------

BAD_CONFIG = [
    ({"num_hidden_layers": 200000}, "config.json says num_hidden_layers 200000 but the safetensors hold layers 0..1"),
    ({"num_experts": 100000}, "config.json says num_experts 100000 but the safetensors hold experts 0..7"),
    ({"num_hidden_layers": 0}, "config.json: num_hidden_layers 0 must be positive"),
    ({"hidden_size": 0}, "config.json: hidden_size 0 must be positive"),
    ({"intermediate_size": -128}, "config.json: intermediate_size -128 must be positive"),
    ({"num_attention_heads": 4.0}, "config.json: num_attention_heads must be an integer, got the number 4.0"),
    ({"num_attention_heads": "4"}, 'config.json: num_attention_heads must be an integer, got the string "4"'),
    ({"num_key_value_heads": 3}, "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": 15}, "config.json: head_dim 15 must be even"),
    ({"vocab_size": 10**9}, "config.json: vocab_size 1000000000 is above the limit of 4194304"),
    ({"max_position_embeddings": 10**12}, "config.json: max_position_embeddings 1000000000000 is above the limit of"),
    ({"num_experts_per_tok": True}, "config.json: num_experts_per_tok must be an integer, got the boolean true"),
    ({"tie_word_embeddings": "false"}, 'config.json: tie_word_embeddings must be true or false, got the string'),
    ({"rms_norm_eps": float("nan")}, "config.json: rms_norm_eps must be a finite positive number, got NaN"),
]


@pytest.mark.parametrize("changes,expected", BAD_CONFIG, ids=[json.dumps(c) for c, _ in BAD_CONFIG])
def test_absurd_config_is_refused_before_any_model_is_built(pristine, tmp_path, monkeypatch, changes, expected):
    d = broken(pristine, tmp_path, "config.json", **changes)
    built, materialised = [], []
    monkeypatch.setattr(loader, "build_meta_model", lambda *a: built.append(a))
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda self, **kw: materialised.append(kw))
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d, torch.float32, "cpu", progress=False)
    assert time.perf_counter() - start < 1.0
    assert_one_line(str(info.value), str(d), expected)
    assert built == [] and materialised == []  # not even a meta-device model


def test_missing_layers_are_named_from_the_headers(pristine, tmp_path):
    d = broken(pristine, tmp_path, "config.json", num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers 3 but the safetensors hold layers 0\.\.1;"):
        inspect_checkpoint(d)


# The largest released models, as their config.json files write them: all far inside the limits.
REAL_CONFIGS = {
    "Qwen3-235B-A22B": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                            num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=262144,
                            rms_norm_eps=1e-6, rope_theta=5000000, tie_word_embeddings=False),
    "DeepSeek-V3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, num_experts_per_tok=8, vocab_size=129280,
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000),
    "DeepSeek-V4 context": dict(max_position_embeddings=1048576),
    "Llama-3.1-405B": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                           rope_theta=500000.0),
    "Llama-4-Scout": dict(num_local_experts=16, max_position_embeddings=10485760, vocab_size=202048),
    "Gemma-3": dict(head_dim=256, vocab_size=262208),
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_the_largest_real_models_pass_the_limits(name):
    config = REAL_CONFIGS[name]
    check_config(config, Path("config.json"))
    for key, value in config.items():  # by a wide margin: four times each integer passes too
        if key in loader.CONFIG_INT_LIMITS:
            check_config({key: 4 * value}, Path("config.json"))


# --- memory ------------------------------------------------------------------------------------


def test_weights_larger_than_ram_are_refused_before_allocation(pristine, monkeypatch):
    monkeypatch.setattr(loader, "available_host_memory", lambda: 1 << 20)
    materialised = []
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda self, **kw: materialised.append(kw))
    with pytest.raises(MemoryError) as info:
        load_checkpoint(pristine, torch.float32, "cpu", progress=False)
    assert_one_line(str(info.value), str(pristine), "the weights in float32 need", "0.00 GiB of RAM available")
    assert materialised == []


def test_plan_on_cpu_checks_ram(pristine, monkeypatch):
    import tandem.offload.planner as planner

    monkeypatch.setattr(planner, "available_host_memory", lambda: 1 << 20)
    plan = plan_memory(pristine, torch.float32, "cpu", kv_cache_memory=8 << 20)
    assert not plan.fits and "GiB of RAM available" in plan.problems[-1]
    monkeypatch.setattr(planner, "available_host_memory", lambda: 1 << 40)
    assert plan_memory(pristine, torch.float32, "cpu", kv_cache_memory=8 << 20).fits


# --- end to end: `tandem plan` and `tandem serve` ----------------------------------------------

END_TO_END = [
    ("generation_config.json", {"temperature": "0.7"}, '"temperature" must be a number'),
    ("generation_config.json", {"eos_token_id": "2"}, '"eos_token_id" must be a token id'),
    ("config.json", {"num_hidden_layers": 200000}, "num_hidden_layers 200000"),
    ("config.json", {"num_attention_heads": 4.5}, "num_attention_heads must be an integer"),
]
E2E_IDS = [f"{f}:{next(iter(c))}" for f, c, _ in END_TO_END]


@pytest.mark.parametrize("file,changes,expected", END_TO_END, ids=E2E_IDS)
def test_plan_prints_the_error_and_exits_1(pristine, tmp_path, capsys, file, changes, expected):
    d = broken(pristine, tmp_path, file, **changes)
    assert run(["plan", str(d), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert_one_line(err, "tandem: error: ", str(d), expected)


@pytest.mark.parametrize("file,changes,expected", END_TO_END, ids=E2E_IDS)
def test_serve_exits_with_one_error_line(pristine, tmp_path, file, changes, expected):
    d = broken(pristine, tmp_path, file, **changes)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", str(d), "--port", "0", "--device", "cpu"],
                          capture_output=True, text=True, timeout=SERVE_TIMEOUT)
    assert time.monotonic() - start < SERVE_TIMEOUT
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out
    assert "Could not start the engine: " in errors[0], out
    assert str(d) in errors[0] and expected in errors[0], out


def test_layout_check_counts_per_expert_tensors_and_leaves_fused_experts_to_the_shape_check(tmp_path):
    names = [f"model.layers.{i}.mlp.experts.{e}.up_proj.weight" for i in range(2) for e in range(4)]
    loader.check_layout({"num_hidden_layers": 2, "num_experts": 4}, dict.fromkeys(names), tmp_path)
    with pytest.raises(CheckpointError, match="num_experts 8 but the safetensors hold experts 0..3"):
        loader.check_layout({"num_hidden_layers": 2, "num_experts": 8}, dict.fromkeys(names), tmp_path)
    fused = [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(2)]
    loader.check_layout({"num_hidden_layers": 2, "num_experts": 8}, dict.fromkeys(fused), tmp_path)
