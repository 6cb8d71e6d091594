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
