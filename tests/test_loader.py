"""The checkpoint loader: every refusal is one CheckpointError naming the file; sharded,
read-only, tied and auto_map checkpoints load."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from tandem.kv.tensors import LayerCache
from tandem.models.loader import CheckpointError, inspect_checkpoint, load_checkpoint
from tandem.models.registry import get_model_class, supported_model_types

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
WEIGHTS = "model.safetensors"


def make_checkpoint(path: Path, **overrides) -> Path:
    """A tiny Qwen3 checkpoint written by transformers, plus a placeholder tokenizer.json."""
    torch.manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(path, **({"max_shard_size": overrides.pop("_shard")} if "_shard" in overrides else {}))
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture()
def ckpt(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "m")


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(path / WEIGHTS)
    fn(tensors)
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(path)
    msg = str(info.value)
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


def run_logits(model) -> torch.Tensor:
    """Logits of a fixed 20-token prompt (one request, one step)."""
    from tandem.core import StepMetadata

    spec = model.kv_cache_specs()[0]
    dtype = next(model.parameters()).dtype
    model.bind_kv_caches(
        [(LayerCache(0, torch.zeros(2, 4, 16, spec.num_kv_heads, spec.head_dim, dtype=dtype)),) for _ in model.kv_cache_specs()]
    )
    n = 20
    step = StepMetadata(("r",), torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                        (torch.tensor([[2, 0]], dtype=torch.int32),),
                        (torch.cat([torch.arange(32, 48), torch.arange(0, 4)]),),
                        torch.arange(n), (0, n), (n,), 16, n)  # fmt: skip
    with torch.no_grad():
        return model.compute_logits(model(torch.arange(n) * 5 % TINY["vocab_size"], torch.arange(n), step))


# --- refusals ---------------------------------------------------------------------------------


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    expect_error(ckpt, "config.json", "missing")


def test_corrupt_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect_error(ckpt, "config.json", "cannot parse")


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    expect_error(ckpt, "tokenizer.json", "missing")


def test_missing_weights(ckpt):
    (ckpt / WEIGHTS).unlink()
    expect_error(ckpt, str(ckpt), "missing weights")


def test_pickle_weights_refused(ckpt):
    (ckpt / WEIGHTS).unlink()
    torch.save({"x": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    expect_error(ckpt, "pytorch_model.bin", "pickle checkpoints are not loaded; convert to safetensors")


def test_unknown_model_type(ckpt):
    edit_config(ckpt, model_type="llama_next")
    msg = expect_error(ckpt, "config.json", "'llama_next'")
    assert all(t in msg for t in supported_model_types())


def test_bad_config_value(ckpt):
    edit_config(ckpt, rope_scaling={"type": "su", "factor": 2.0}, rope_parameters=None)
    expect_error(ckpt, "config.json", "rope type 'su'")


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    expect_error(ckpt, str(ckpt), "missing", "model.layers.1.mlp.down_proj.weight")


def test_unexpected_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.7.extra.weight": torch.zeros(3)}))
    expect_error(ckpt, WEIGHTS, "unexpected", "model.layers.7.extra.weight")


def test_shape_mismatch(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    expect_error(ckpt, WEIGHTS, "model.norm.weight", "[31]", "[32]")


def test_layers_the_files_lack_are_named_before_the_model_is_built(tmp_path):
    path = make_checkpoint(tmp_path / "m", num_hidden_layers=4)
    edit_tensors(path, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.2.")])
    expect_error(path, str(path), "config.json says num_hidden_layers 4 but the safetensors hold 3 layers (0, 1, 3)")


def test_config_integers_outside_the_limits(ckpt):
    edit_config(ckpt, hidden_size=-32)
    expect_error(ckpt, "config.json: hidden_size -32 must be positive")
    edit_config(ckpt, hidden_size=1 << 20)
    expect_error(ckpt, "config.json: hidden_size 1048576 is above the limit of 65536")


def test_truncated_safetensors(ckpt):
    path = ckpt / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    expect_error(ckpt, WEIGHTS, "truncated")


def test_truncated_inside_header(ckpt):
    path = ckpt / WEIGHTS
    path.write_bytes(path.read_bytes()[:50])
    expect_error(ckpt, WEIGHTS, "truncated or corrupt")


def test_corrupt_header_json(ckpt):
    path = ckpt / WEIGHTS
    data = bytearray(path.read_bytes())
    data[8:12] = b"#!@$"  # inside the JSON header
    path.write_bytes(bytes(data))
    expect_error(ckpt, WEIGHTS, "corrupt safetensors header")


def test_sharded_index_names_missing_shard(tmp_path):
    path = make_checkpoint(tmp_path / "m", _shard="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (path / shards[-1]).unlink()
    expect_error(path, "model.safetensors.index.json", shards[-1], "missing")


def test_error_before_any_allocation(ckpt, monkeypatch):
    """A shape mismatch is reported by load_checkpoint before the model is materialised."""
    edit_tensors(ckpt, lambda t: t.update({"lm_head.weight": torch.zeros(5, 32)}))
    calls = []
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda self, **kw: calls.append(kw))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(ckpt, torch.float32, "cpu", progress=False)
    assert calls == []


# --- checkpoints that load --------------------------------------------------------------------


def test_inspect_reports_files_and_bytes(ckpt):
    info = inspect_checkpoint(ckpt)
    assert info.model_type == "qwen3" and info.weight_files == (ckpt / WEIGHTS,)
    assert info.total_bytes == sum(t.numel() * 4 for t in load_file(ckpt / WEIGHTS).values())
    assert info.model_class is get_model_class("qwen3")


def test_loads_logs_summary_and_progress(ckpt, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="tandem"):
        model, report = load_checkpoint(ckpt, torch.float32, "cpu")
    assert report.num_tensors == len(load_file(ckpt / WEIGHTS))
    assert any(r.getMessage().startswith(f"Loaded qwen3 from {ckpt}: {report.num_tensors} tensors,") for r in caplog.records)
    assert "Loading weights" in capsys.readouterr().err
    assert torch.equal(model.model.norm.weight, load_file(ckpt / WEIGHTS)["model.norm.weight"])


def test_read_only_directory_loads(ckpt):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.iterdir())
    modes = {p: p.stat().st_mode for p in [ckpt, *ckpt.iterdir()]}
    try:
        for p in modes:
            os.chmod(p, stat.S_IRUSR | stat.S_IXUSR if p.is_dir() else stat.S_IRUSR)
        model, _ = load_checkpoint(ckpt, torch.float32, "cpu", progress=False)
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ckpt.iterdir()) == before  # nothing written
    assert torch.isfinite(run_logits(model)).all()


def test_sharded_checkpoint_loads_same_as_single(tmp_path):
    single = make_checkpoint(tmp_path / "single")
    sharded = make_checkpoint(tmp_path / "sharded", _shard="20KB")
    info = inspect_checkpoint(sharded)
    assert len(info.weight_files) > 1
    a, _ = load_checkpoint(single, torch.float32, "cpu", progress=False)
    b, _ = load_checkpoint(sharded, torch.float32, "cpu", progress=False)
    assert torch.equal(run_logits(a), run_logits(b))


def test_auto_map_is_ignored(ckpt):
    marker = ckpt.parent / "code_was_run"
    (ckpt / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    edit_config(ckpt, auto_map={"AutoModelForCausalLM": "evil.EvilForCausalLM", "AutoConfig": "evil.EvilConfig"})
    model, _ = load_checkpoint(ckpt, torch.float32, "cpu", progress=False)
    assert not marker.exists()
    assert type(model) is get_model_class("qwen3")


def test_tied_checkpoint_with_or_without_lm_head(tmp_path):
    path = make_checkpoint(tmp_path / "m", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / WEIGHTS)
    model, _ = load_checkpoint(path, torch.float32, "cpu", progress=False)
    ref = run_logits(model)
    # Some tied checkpoints still carry a copy of lm_head.weight: it is ignored.
    edit_tensors(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model, _ = load_checkpoint(path, torch.float32, "cpu", progress=False)
    assert torch.equal(run_logits(model), ref)


def test_rotary_cache_keys_are_ignored(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    info = inspect_checkpoint(ckpt)
    assert info.unused == ("model.layers.0.self_attn.rotary_emb.inv_freq",)
    load_checkpoint(ckpt, torch.float32, "cpu", progress=False)


def test_dtype_conversion_keeps_rotary_fp32(ckpt):
    edit_tensors(ckpt, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    fp32, _ = load_checkpoint(ckpt, torch.float32, "cpu", progress=False)
    bf16, report = load_checkpoint(ckpt, torch.bfloat16, "cpu", progress=False)
    assert report.dtype == torch.bfloat16
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert fp32.model.rotary_emb.inv_freq.dtype == bf16.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(fp32.model.rotary_emb.inv_freq, bf16.model.rotary_emb.inv_freq)
    assert {s.dtype for s in bf16.kv_cache_specs()} == {torch.bfloat16}
    assert (run_logits(fp32) - run_logits(bf16)).abs().max() < 0.1
