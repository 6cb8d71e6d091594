"""Expert placement (tandem/offload/placement.py): which MoE layers' routed experts go to RAM, from
the flags and the budgets, before anything is loaded."""

import json
from pathlib import Path

import pytest
import torch

from tandem.cli import run
from tandem.config import OffloadConfig
from tandem.models.loader import build_meta_model
from tandem.models.registry import get_model_class
from tandem.offload.placement import GiB, expert_bytes, plan_placement, predict_decode_seconds
from tandem.offload.planner import plan_memory

# 8 layers of 64 experts of 3 x 1024 x 512: 192 MiB of bf16 experts per layer.
CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
    "num_experts": 64, "num_experts_per_tok": 4, "norm_topk_prob": True, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
}  # fmt: skip
LAYER_EXPERTS = 64 * 3 * 1024 * 512 * 2


@pytest.fixture(scope="module")
def meta_model():
    return build_meta_model(get_model_class("qwen3_moe"), CONFIG, torch.bfloat16, Path("config.json"))


def place(model, budget, **flags):
    """The placement, with expert streaming off unless asked for (its buffers are tested on their own)."""
    flags.setdefault("stream_experts", "off")
    return plan_placement(model, torch.bfloat16, OffloadConfig(**flags), budget, kv_min_bytes=64 << 20)


def test_everything_on_the_gpu_when_it_fits(meta_model):
    p = place(meta_model, 8 * GiB)
    assert not p.offloaded and p.gpu_moe_layers == tuple(range(8)) and not p.problems
    assert p.gpu_bytes == sum(q.numel() * 2 for q in meta_model.parameters())


def test_automatic_offload_keeps_whole_layers_while_they_fit(meta_model):
    fixed = place(meta_model, 8 * GiB).gpu_bytes - 8 * LAYER_EXPERTS + (64 << 20)
    budget = fixed + 3 * LAYER_EXPERTS + LAYER_EXPERTS // 2  # room for 3.5 layers of experts
    p = place(meta_model, budget)
    assert p.cpu_layers == (3, 4, 5, 6, 7) and p.gpu_moe_layers == (0, 1, 2) and not p.problems
    assert "3 whole MoE layers kept on the GPU (auto: 0-2)" in p.reason
    assert p.gpu_bytes + (64 << 20) <= budget < p.gpu_bytes + (64 << 20) + LAYER_EXPERTS
    assert p.cpu_bytes == 5 * expert_bytes("bf16", 1024, 512) * 64 == 5 * LAYER_EXPERTS


def test_the_expert_streaming_buffers_are_planned_with_the_experts_in_ram(meta_model):
    fixed = place(meta_model, 8 * GiB).gpu_bytes - 8 * LAYER_EXPERTS + (64 << 20)
    budget = fixed + 3 * LAYER_EXPERTS + LAYER_EXPERTS // 2
    expert = LAYER_EXPERTS // 64  # 3 MiB in bf16, in RAM as on the GPU
    # A layer's 64 experts want 64 x (3 ring slots + 2 unpacked) x 3 MiB = 960 MiB (< the 2 GiB
    # default), planned before whole layers are kept: with room for 6.5 layers of experts, 5 of them
    # go to the buffers and one layer stays.
    roomy = place(meta_model, fixed + 6 * LAYER_EXPERTS + LAYER_EXPERTS // 2, stream_experts="auto")
    assert roomy.stream_bytes == 64 * 5 * expert and roomy.gpu_moe_layers == (0,) and not roomy.problems
    assert "(streaming)" in "\n".join(roomy.render())
    # Room for 3.5 layers: the default buffers do not fit beside every expert in RAM, so streaming
    # gets one expert a copy and the three layers still stay.
    p = place(meta_model, budget, stream_experts="auto")
    assert p.stream_bytes == 5 * expert and p.gpu_moe_layers == (0, 1, 2) and not p.problems
    assert "expert streaming gets" in p.reason
    assert place(meta_model, fixed + 5 * expert - 1, stream_experts="auto").stream_bytes == 0  # no room at all
    small = place(meta_model, budget, stream_experts="auto", stream_experts_memory=64 << 20)
    assert small.stream_bytes == 64 << 20 and small.gpu_moe_layers == (0, 1, 2)
    assert place(meta_model, 8 * GiB, stream_experts="auto").stream_bytes == 0  # nothing in RAM: no buffers
    forced = place(meta_model, fixed + 2 * LAYER_EXPERTS, cpu_moe=True, stream_experts="auto",
                   stream_experts_memory=4 * GiB)
    assert "expert-streaming buffers: lower --stream-experts-memory" in forced.problems[0]


def test_cpu_moe_puts_every_layer_in_ram_but_the_resident_ones(meta_model):
    assert place(meta_model, 8 * GiB, cpu_moe=True).cpu_layers == tuple(range(8))
    p = place(meta_model, 8 * GiB, cpu_moe=True, gpu_resident_moe_layers=(0, 1))
    assert p.cpu_layers == tuple(range(2, 8)) and p.gpu_moe_layers == (0, 1)
    assert place(meta_model, 8 * GiB, cpu_moe=True, gpu_resident_moe_layers="auto").cpu_layers == ()
    with pytest.raises(ValueError, match="--gpu-resident-moe-layers 9: not MoE layers"):
        place(meta_model, 8 * GiB, cpu_moe=True, gpu_resident_moe_layers=(0, 9))


def test_n_cpu_moe_is_the_first_layers_and_names_the_n_that_fits(meta_model):
    p = place(meta_model, 8 * GiB, n_cpu_moe=3)
    assert p.cpu_layers == (0, 1, 2) and not p.problems
    fixed = place(meta_model, 8 * GiB).gpu_bytes - 8 * LAYER_EXPERTS + (64 << 20)
    small = place(meta_model, fixed + 2 * LAYER_EXPERTS, n_cpu_moe=3)
    assert small.problems and "raise --n-cpu-moe to 6" in small.problems[0]
    assert not place(meta_model, fixed + 2 * LAYER_EXPERTS, n_cpu_moe=6).problems
    with pytest.raises(ValueError, match="not --n-cpu-moe"):
        place(meta_model, 8 * GiB, n_cpu_moe=3, gpu_resident_moe_layers=(5,))


def test_a_gpu_too_small_even_for_the_rest_is_refused_with_the_shortfall(meta_model):
    p = place(meta_model, 100 << 20)
    assert not p.offloaded and "do not fit even with every routed expert in RAM" in p.problems[0]
    assert "short); lower --max-model-len" in p.problems[0]
    forced = place(meta_model, 100 << 20, cpu_moe=True, gpu_resident_moe_layers=(0,))
    assert "keep fewer --gpu-resident-moe-layers" in forced.problems[0]


def test_a_cpu_run_offloads_only_when_asked(meta_model):
    assert not place(meta_model, None).offloaded
    assert place(meta_model, None, cpu_moe=True).cpu_layers == tuple(range(8))
    assert place(meta_model, None, n_cpu_moe=2).cpu_layers == (0, 1)


def test_formats_and_lossy(meta_model):
    n = 3 * 1024 * 512
    assert expert_bytes("fp32", 1024, 512) == 4 * n and expert_bytes("bf16", 1024, 512) == 2 * n
    assert expert_bytes("mxfp4", 1024, 512) == n // 2 + n // 32  # 4.25 bits per weight
    assert expert_bytes("int4", 1024, 512) < expert_bytes("int8", 1024, 512) < 2 * n
    assert not place(meta_model, None, cpu_moe=True).lossy
    assert place(meta_model, None, cpu_moe=True, cpu_moe_dtype="int4").lossy
    assert plan_placement(meta_model, torch.float32, OffloadConfig(cpu_moe=True), None, 0).cpu_format == "fp32"


def test_table_folds_identical_layers_and_step_bytes(meta_model):
    p = place(meta_model, 8 * GiB, cpu_moe=True, gpu_resident_moe_layers=(0,))
    text = "\n".join(p.render())
    assert "    0            moe    gpu" in text and "    1-7          moe    cpu" in text and " each" in text
    gpu, cpu = p.bytes_per_step(1)
    assert cpu == 7 * 4 * expert_bytes("bf16", 1024, 512)  # top-4 experts of 7 layers
    assert p.distinct_experts(1) == pytest.approx(4) and 4 < p.distinct_experts(4) < 16
    step = predict_decode_seconds(p, 1, ram_read=50e9, gpu_read=4e12, roundtrip=20e-6)
    assert step == pytest.approx(gpu / 4e12 + cpu / 50e9 + 7 * 20e-6)


def test_offload_config_checks_its_flags():
    with pytest.raises(ValueError, match="give one"):
        OffloadConfig(cpu_moe=True, n_cpu_moe=2)
    with pytest.raises(ValueError, match="--cpu-moe-dtype"):
        OffloadConfig(cpu_moe_dtype="fp8")
    assert OffloadConfig.parse_layers("1, 0,1") == (0, 1) and OffloadConfig.parse_layers("none") == ()
    assert OffloadConfig.parse_layers("auto") == "auto" and OffloadConfig.parse_layers(None) is None
    with pytest.raises(ValueError, match="comma-separated"):
        OffloadConfig.parse_layers("first")


def test_plan_prints_the_per_layer_table_and_checks_ram(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    assert run(["plan", str(cfg), "--gpu-memory", "2GiB", "--dtype", "bfloat16", "--max-model-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "routed experts in RAM as bf16" in out and "whole MoE layers kept on the GPU" in out
    assert "predicted decode speed: run with --measure" in out
    assert run(["plan", str(cfg), "--gpu-memory", "2GiB", "--dtype", "bfloat16", "--cpu-moe",
                "--cpu-memory", "512MiB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT: the routed experts in RAM need 1.50 GiB but --cpu-memory is 0.50 GiB" in out
    plan = plan_memory(cfg, torch.bfloat16, "cuda", device_bytes=2 * GiB, offload=OffloadConfig(cpu_moe=True))
    assert plan.weights["routed experts in RAM (bf16)"] == 8 * LAYER_EXPERTS and "routed experts" not in plan.weights


def test_measured_plan_predicts_decode_and_streamed_prefill(tmp_path):
    from tandem.offload.measure import MachineConstants

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    machine = MachineConstants(ram_read=100e9, gpu_read=3e12, h2d=50e9, roundtrip=20e-6)
    plan = plan_memory(cfg, torch.bfloat16, "cuda", device_bytes=4 * GiB, offload=OffloadConfig(cpu_moe=True),
                       machine=machine, max_num_batched_tokens=4096)
    text = plan.render()
    assert "predicted decode, batch 1:" in text and "(streaming)" in text
    seconds = 8 * LAYER_EXPERTS / 50e9  # every expert over PCIe once a chunk
    assert f"at most {4096 / seconds:7.0f} tok/s in chunks of 4096 tokens" in text
    off = plan_memory(cfg, torch.bfloat16, "cuda", device_bytes=4 * GiB, machine=machine,
                      offload=OffloadConfig(cpu_moe=True, stream_experts="off"))
    assert "expert streaming" not in off.render()


def test_auto_batched_tokens_plans_a_streamed_chunk_only_when_the_experts_stream(tmp_path):
    from tandem.config import DEFAULT_BATCHED_TOKENS, MAX_AUTO_CHUNK

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    kw = dict(device_bytes=8 * GiB, max_model_len=32768)
    streamed = plan_memory(cfg, torch.bfloat16, "cuda", offload=OffloadConfig(cpu_moe=True), **kw)
    off = plan_memory(cfg, torch.bfloat16, "cuda", offload=OffloadConfig(cpu_moe=True, stream_experts="off"), **kw)
    on_gpu = plan_memory(cfg, torch.bfloat16, "cuda", **kw)
    assert streamed.placement.stream_bytes and streamed.chunk_tokens == MAX_AUTO_CHUNK
    assert f"(steps of up to {MAX_AUTO_CHUNK} tokens: --max-num-batched-tokens)" in streamed.render()
    assert off.chunk_tokens == on_gpu.chunk_tokens == DEFAULT_BATCHED_TOKENS
    assert streamed.activation_bytes > off.activation_bytes  # the longer chunk's activations are reserved
    short = plan_memory(cfg, torch.bfloat16, "cuda", offload=OffloadConfig(cpu_moe=True), device_bytes=8 * GiB,
                        max_model_len=4096)
    assert short.chunk_tokens == 4096  # never past --max-model-len
    given = plan_memory(cfg, torch.bfloat16, "cuda", offload=OffloadConfig(cpu_moe=True), max_num_batched_tokens=512,
                        **kw)
    assert given.chunk_tokens == 512


def test_a_drafter_takes_its_share_of_the_gpu():
    from tandem.builtin import DEMO_DIR
    from tandem.config import SpecConfig

    plain = plan_memory(DEMO_DIR, torch.bfloat16, "cuda", device_bytes=2 * GiB, max_model_len=2048)
    spec = plan_memory(DEMO_DIR, torch.bfloat16, "cuda", device_bytes=2 * GiB, max_model_len=2048,
                       spec=SpecConfig.parse({"method": "dspark"}))
    drafter = spec.weights["speculative drafter"]
    dspark = sum(f.stat().st_size for f in (DEMO_DIR / "dspark").glob("*.safetensors"))
    assert 0.9 * dspark < drafter <= dspark  # bf16 on disk, bf16 planned (less the headers)
    assert spec.kv_budget == plain.kv_budget - drafter
    assert "speculative drafter" not in plan_memory(DEMO_DIR, torch.bfloat16, "cuda", device_bytes=2 * GiB,
                                                    spec=SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3})).weights
