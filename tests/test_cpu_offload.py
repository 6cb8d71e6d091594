"""Routed experts in RAM through the engine: the per-layer plan, the loader's sink and the CPU
executor give the same greedy tokens as the model with every expert on its device."""

import os
import stat
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.builtin import DEMO_DIR
from tandem.cli import build_parser, offload_config
from tandem.models.loader import build_meta_model, inspect_checkpoint, load_checkpoint
from tandem.offload.cpu_executor import CpuMoEExecutor, OffloadedExperts
from tandem.offload.placement import plan_placement
from tandem.config import OffloadConfig
from tiny_models import save_tiny_model

cpu_experts = pytest.importorskip("tandem.offload.cpu_experts")

PROMPTS = ["<|im_start|>user\nWhat is 17 plus 25?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nWrite a python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("offload")
    save_tiny_model(d, "qwen3_moe", seed=3, num_hidden_layers=3)
    return d


def _cpu_placement(model_dir: Path):
    info = inspect_checkpoint(model_dir)
    meta = build_meta_model(info.model_class, info.config, torch.float32, model_dir / "config.json")
    return meta, plan_placement(meta, torch.float32, OffloadConfig(cpu_moe=True), None, 0)


def _greedy(llm: LLM, prompts, n: int = 24) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))]


def test_demo_model_greedy_tokens_with_every_expert_on_the_cpu_kernel():
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="64MiB", max_model_len=1024)
    ref = _greedy(LLM(str(DEMO_DIR), **kw), PROMPTS)
    llm = LLM(str(DEMO_DIR), cpu_moe=True, cpu_moe_threads=2, **kw)
    blocks = llm.engine.model.moe_blocks()
    assert all(isinstance(b.executor, CpuMoEExecutor) and b.offloaded for b in blocks.values())
    assert not any(".experts." in name for name in llm.engine.model.state_dict())
    assert _greedy(llm, PROMPTS) == ref


def test_n_cpu_moe_offloads_the_first_layers_only(tiny_dir):
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB")
    ref = _greedy(LLM(str(tiny_dir), **kw), PROMPTS[:1], 16)
    llm = LLM(str(tiny_dir), n_cpu_moe=2, **kw)
    blocks = llm.engine.model.moe_blocks()
    assert [i for i, b in blocks.items() if b.offloaded] == [0, 1] and not blocks[2].offloaded
    assert _greedy(llm, PROMPTS[:1], 16) == ref


def test_loading_from_a_read_only_directory_packs_each_expert(tiny_dir, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    for f in tiny_dir.iterdir():
        (ro / f.name).write_bytes(f.read_bytes())
        os.chmod(ro / f.name, stat.S_IRUSR)
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR)
    try:
        ref, _ = load_checkpoint(tiny_dir, torch.float32, "cpu", progress=False)
        _, placement = _cpu_placement(tiny_dir)
        model, report = load_checkpoint(ro, torch.float32, "cpu", progress=False, sink=OffloadedExperts(placement))
    finally:
        os.chmod(ro, stat.S_IRWXU)
    assert report.num_tensors == len(ref.state_dict())
    block, ref_block = model.moe_blocks()[1], ref.moe_blocks()[1]
    gate, up, down = block.executor.layer.dequantized()
    assert torch.equal(gate[5], ref_block.experts[5].gate_proj.weight)
    assert torch.equal(down[0], ref_block.experts[0].down_proj.weight)
    x = torch.randn(5, gate.shape[2])
    assert torch.allclose(block(x), ref_block(x), rtol=1e-5, atol=1e-6)


def test_a_missing_expert_tensor_is_named():
    meta, placement = _cpu_placement(DEMO_DIR)
    sink = OffloadedExperts(placement)
    sink.prepare(meta)
    sink.take("model.layers.3.mlp.experts.7.gate_proj.weight", torch.zeros(96, 256))
    with pytest.raises(RuntimeError, match="layer 3 expert 7: the checkpoint held only"):
        sink.install(meta, torch.device("cpu"), torch.float32)


def test_serve_flags_map_to_the_offload_config():
    args = build_parser().parse_args(["serve", "--cpu-moe", "--gpu-resident-moe-layers", "0,1",
                                      "--cpu-moe-threads", "3", "--cpu-moe-dtype", "int4", "--cpu-memory", "64GiB"])
    cfg = offload_config(args)
    assert cfg == OffloadConfig(True, None, (0, 1), 3, "int4", 64 << 30)
    with pytest.raises(ValueError, match="give one"):
        offload_config(build_parser().parse_args(["serve", "--cpu-moe", "--n-cpu-moe", "2"]))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "mxfp4"])
def test_the_planner_counts_the_kernels_bytes_per_expert(fmt):
    from tandem.offload.placement import expert_bytes

    for hidden, inter in ((2048, 768), (4096, 2048), (256, 96)):
        assert cpu_experts.CpuExpertLayer.empty(1, hidden, inter, fmt).bytes_per_expert == expert_bytes(fmt, hidden, inter)


def test_adaptive_auto_charges_the_experts_a_verify_reaches(tiny_dir):
    """With experts in RAM the K controller's cost model gets the CPU-expert hook: predicted step
    time grows with the draft depth beyond what the measured tables say."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": "auto"})
    cost = llm.engine.spec.auto.cost
    assert cost.extra is not None and cost.extra([3]) > cost.extra([1]) > cost.extra([0]) == 0.0
    assert _greedy(llm, PROMPTS[:1], 16) == _greedy(LLM(str(tiny_dir), device="cpu", dtype="float32",
                                                        kv_cache_memory="16MiB"), PROMPTS[:1], 16)
