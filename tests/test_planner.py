"""The memory plan (`tandem plan`), checked against what the engine actually allocates."""

from pathlib import Path

import pytest
import torch

from tandem import LLM
from tandem.cli import run
from tandem.offload.planner import GiB, kv_blocks, plan_memory
from tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plan")
    save_tiny_model(d, "qwen3_moe", seed=9)
    return d


def test_plan_matches_the_engine_on_cpu(model_dir):
    plan = plan_memory(model_dir, torch.float32, "cpu", kv_cache_memory=8 << 20, max_num_seqs=64)
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=8 << 20, max_num_seqs=64)
    eng = llm.engine
    assert plan.fits and plan.weights_total == eng.weights_bytes
    assert plan.kv_tokens == eng.kv.num_blocks * eng.kv.block_size
    assert plan.max_model_len == eng.max_model_len
    assert set(plan.weights) == {"routed experts", "embeddings + lm_head", "attention", "other (norms, router, dense MLP)"}


def test_plan_for_a_gpu_that_is_too_small(model_dir, capsys):
    plan = plan_memory(model_dir, torch.bfloat16, "cuda", device_bytes=GiB // 4)
    assert not plan.fits and "do not fit" in plan.problems[0]
    assert run(["plan", str(model_dir), "--gpu-memory", "256MiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert run(["plan", str(model_dir), "--gpu-memory", "24GiB"]) == 0
    assert "KV capacity" in capsys.readouterr().out


def test_plan_names_the_flag_when_the_kv_cache_is_too_small(model_dir):
    plan = plan_memory(model_dir, torch.float32, "cpu", kv_cache_memory=64 << 10, max_model_len=512)
    assert not plan.fits and "lower --max-model-len or raise --kv-cache-memory" in plan.problems[0]


def test_plan_for_cuda_without_a_gpu_asks_for_its_size(model_dir):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match="--gpu-memory"):
        plan_memory(model_dir, torch.bfloat16, "cuda")


def test_kv_blocks_caps_at_what_the_sequences_can_use():
    assert kv_blocks(10**9, 1000, max_model_len=64, block_size=16, max_num_seqs=2) == 4 * 2 + 1
    assert kv_blocks(10_000, 1000, max_model_len=64, block_size=16, max_num_seqs=2) == 9
    with pytest.raises(MemoryError):
        kv_blocks(3_000, 1000, max_model_len=64, block_size=16, max_num_seqs=2)


def test_bad_checkpoint_is_one_line_and_exit_1(tmp_path, capsys):
    assert run(["plan", str(tmp_path)]) == 1
    assert "config.json" in capsys.readouterr().err


def test_a_config_json_alone_is_planned_from_the_architecture(model_dir, tmp_path, capsys):
    # The same sizes as the checkpoint's, with no tokenizer and no weight files: a directory
    # holding config.json only, or the file itself.
    full = plan_memory(model_dir, torch.float32, "cpu", kv_cache_memory=8 << 20)
    alone = tmp_path / "bare"
    alone.mkdir()
    (alone / "config.json").write_text((model_dir / "config.json").read_text())
    for target in (alone, alone / "config.json"):
        plan = plan_memory(target, torch.float32, "cpu", kv_cache_memory=8 << 20)
        assert plan.from_config_only and plan.weights == full.weights and plan.kv_tokens == full.kv_tokens
    assert run(["plan", str(alone / "config.json"), "--device", "cpu", "--kv-cache-memory", "8MiB"]) == 0
    out = capsys.readouterr().out
    assert "from config.json alone" in out and "KV capacity" in out
    assert not full.from_config_only


def test_a_config_json_alone_for_a_model_that_does_not_fit(tmp_path, capsys):
    import json

    qwen3_30b_a3b = {  # Qwen/Qwen3-30B-A3B's config.json, the keys the architecture reads
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "norm_topk_prob": True, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
    }
    path = tmp_path / "qwen3-30b-a3b.json"
    path.write_text(json.dumps(qwen3_30b_a3b))
    assert run(["plan", str(path), "--gpu-memory", "24GiB", "--dtype", "bfloat16"]) == 1
    out = capsys.readouterr().out
    assert "routed experts" in out and "DOES NOT FIT" in out
    plan = plan_memory(path, torch.bfloat16, "cuda", device_bytes=24 * GiB)
    assert 55 * GiB < plan.weights_total < 62 * GiB  # Qwen3-30B-A3B: 30.5B parameters in bf16
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"model_type": "llama4"}))
    assert run(["plan", str(bad)]) == 1
    assert "model_type 'llama4' is not supported" in capsys.readouterr().err
