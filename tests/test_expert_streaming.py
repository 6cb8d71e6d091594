"""PCIe expert streaming for long prefill steps (tandem/offload/streaming.py): the device-side
unpack of the CPU kernel's packed experts against the kernel's own unpack, the streamer's ring
(more groups than buffers, across layers, prefetched ahead) against the CPU experts, the cost
model's threshold, and through the engine: greedy tokens equal whichever path a step takes. On a
CPU run the "device" is the CPU: the same code without the copy stream."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import pytest
import torch

from tandem import LLM, SamplingParams

cpu_experts = pytest.importorskip("tandem.offload.cpu_experts")
from tiny_models import save_tiny_model  # noqa: E402

from tandem.offload import streaming  # noqa: E402
from tandem.offload.cpu_experts import CpuExpertLayer  # noqa: E402


def dense(num_experts: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, inter, hidden, generator=g) * 0.1,
            torch.randn(num_experts, inter, hidden, generator=g) * 0.1,
            torch.randn(num_experts, hidden, inter, generator=g) * 0.1)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "mxfp4"])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (48, 20), (40, 12)])  # padded tiles: H % 32, I % 8, I % 32
def test_unpack_matches_the_kernels_own_unpack(fmt, hidden, inter) -> None:
    if fmt == "mxfp4" and (hidden % 32 or inter % 32):
        pytest.skip("mxfp4 layers have sizes in multiples of 32")
    gate, up, down = dense(5, hidden, inter)
    layer = CpuExpertLayer.from_dense(gate, up, down, fmt)
    w13, w2 = streaming.unpack_experts(layer.data[1:4], fmt, hidden, inter)
    g, u, d = layer.dequantized()  # fp32, exactly what the kernel computes with
    assert w13.shape == (3, 2 * inter, hidden) and w2.shape == (3, hidden, inter)
    assert w13.dtype == (torch.bfloat16 if fmt == "bf16" else torch.float32)
    assert torch.equal(w13.float(), torch.cat((g[1:4], u[1:4]), dim=1))
    assert torch.equal(w2.float(), d[1:4])
    assert not torch.equal(w13[0], w13[1])  # different experts (a check that could pass on zeros would not)
    bf16 = streaming.unpack_experts(layer.data[1:4], fmt, hidden, inter, torch.bfloat16)
    assert bf16[0].dtype == torch.bfloat16 and torch.equal(bf16[0], w13.bfloat16())


def test_fp4_codes_decode_to_e2m1() -> None:
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert streaming._fp4_values(torch.arange(16, dtype=torch.uint8)).tolist() == want


def make_layers(num_layers: int, num_experts: int, hidden: int, inter: int, limit: float | None = None):
    weights = {i: dense(num_experts, hidden, inter, seed=i) for i in range(num_layers)}
    return weights, {i: CpuExpertLayer.from_dense(*w, "fp32", swiglu_limit=limit) for i, w in weights.items()}


@pytest.mark.parametrize("limit", [None, 0.3])
def test_streamer_ring_gives_the_cpu_experts_results(limit) -> None:
    E, H, I, k = 10, 64, 32, 3
    _, layers = make_layers(3, E, H, I, limit)
    # Room for groups of 3 experts: 4 groups a layer, 12 positions through 3 slots.
    memory = 3 * streaming.unpacked_bytes_per_expert(layers[0].bytes_per_expert, H, I, torch.float32)
    s = streaming.ExpertStreamer(layers, torch.device("cpu"), torch.float32, memory, min_tokens=8)
    assert (s.group, s.groups_per_layer, s.num_positions) == (3, 4, 12)
    assert not s.wants(7) and s.wants(8)
    g = torch.Generator().manual_seed(1)
    for rep in range(2):  # the second pass finds other positions in the slots
        for i, layer in layers.items():
            x = torch.randn(37, H, generator=g)
            ids = torch.rand(37, E, generator=g).argsort(-1)[:, :k]
            ids[:5] = torch.tensor([0, 1, 2])  # some experts crowded, and (below) a group left without rows
            ids[ids >= 6] = ids[ids >= 6] % 3 if i == 1 else ids[ids >= 6]
            w = torch.softmax(torch.randn(37, k, generator=g), -1)
            torch.testing.assert_close(s.run(i, x, ids, w, layer.swiglu_limit), layer(x, ids, w), rtol=1e-5, atol=1e-6)
    stats = s.stats()
    assert stats.layers == 6 and stats.bytes > 0
    unpack, pair = s.time_device()  # it borrows slot 0: the ring must not think it holds a position
    assert unpack > 0 and pair > 0 and s.holds[0] == -1
    x, ids = torch.randn(20, H, generator=g), torch.rand(20, E, generator=g).argsort(-1)[:, :k]
    w = torch.softmax(torch.randn(20, k, generator=g), -1)
    torch.testing.assert_close(s.run(0, x, ids, w, limit), layers[0](x, ids, w), rtol=1e-5, atol=1e-6)


def test_chunk_from_the_cost_model() -> None:
    # 3.4 GB a layer at 55 GB/s is a 61.8 ms copy; 4 ms of unpacking leaves 57.8 ms, which top-6
    # at 1 us a pair fills at 9,636 tokens: 9,728 in steps of 256.
    assert streaming.stream_chunk(3_400_000_000, 55e9, 4e-3, 1e-6, 6) == 9728
    assert streaming.stream_chunk(1_000, 55e9, 1.0, 1e-6, 6) == 256  # the GPU's fixed work already fills the copy
    with pytest.raises(ValueError, match="positive"):
        streaming.stream_chunk(1, 55e9, 0.0, 0.0, 6)
    copy = 3_400_000_000 / 55e9
    assert streaming.streamed_step_seconds(2048, 43, 3_400_000_000, 55e9, 4e-3, 1e-6, 6) == pytest.approx(43 * copy)
    assert streaming.streamed_step_seconds(32768, 2, 3_400_000_000, 55e9, 4e-3, 1e-6, 6) == pytest.approx(
        2 * (4e-3 + 32768 * 6e-6))  # past the knee the GPU's work counts


def test_auto_batched_tokens_is_the_streamers_chunk_within_the_plan(tmp_path, monkeypatch) -> None:
    from tandem.config import DEFAULT_BATCHED_TOKENS
    from tandem.engine import startup

    save_tiny_model(tmp_path, "qwen3_moe", seed=5, num_hidden_layers=2)
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True, stream_experts="on")
    llm = LLM(str(tmp_path), stream_experts_min_tokens=300, **kw)
    engine = llm.engine
    assert engine.config.scheduler.max_num_batched_tokens == DEFAULT_BATCHED_TOKENS  # no PCIe measured: the default
    assert LLM(str(tmp_path), max_num_batched_tokens=64, **kw).engine.config.scheduler.max_num_batched_tokens == 64
    sink = engine.model.cpu_experts
    layer = next(iter(sink.layers.values()))
    sink.streamer.h2d = layer.nbytes / 0.01  # a 10 ms copy a layer: 2 ms unpacking, 1 us a pair
    monkeypatch.setattr(sink.streamer, "time_device", lambda: (2e-3, 1e-6))
    auto = replace(engine.config, scheduler=replace(engine.config.scheduler, max_num_batched_tokens=None))
    knee = streaming.stream_chunk(layer.nbytes, sink.streamer.h2d, 2e-3, 1e-6, sink.top_k)
    assert knee == math.ceil(8e-3 / (sink.top_k * 1e-6) / 256) * 256  # 8 ms of the copy left for the pairs
    assert startup.batched_tokens(auto, engine.model, 1 << 20, 1 << 20) == knee
    assert startup.batched_tokens(auto, engine.model, 512, 1 << 20) == 512  # the plan's activations cap it
    assert startup.batched_tokens(auto, engine.model, 1 << 20, 400) == 400  # and --max-model-len
    sink.streamer.min_tokens = knee + 1000  # a chunk below the threshold would not stream
    assert startup.batched_tokens(auto, engine.model, 1 << 20, 1 << 20) == knee + 1000


def test_threshold_from_the_cost_model() -> None:
    # 12.9 GB a layer over 50 GB/s against 65 us a pair at top-6: streaming wins from 662 tokens.
    assert streaming.stream_threshold(12_900_000_000, 50e9, 65e-6, 6) == 662
    assert streaming.stream_threshold(1, 50e9, 1.0, 6) == 1
    with pytest.raises(ValueError, match="positive"):
        streaming.stream_threshold(1, 0.0, 1.0, 6)


def test_engine_streams_long_steps_and_gives_the_cpu_paths_tokens(tmp_path, caplog) -> None:
    save_tiny_model(tmp_path, "qwen3_moe", seed=5, num_hidden_layers=3)
    prompts = ["<|im_start|>user\nWrite a python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True)
    want = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(prompts, params)]
    cfg = json.loads((tmp_path / "config.json").read_text())
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_local_experts"]
    per_expert = streaming.unpacked_bytes_per_expert(CpuExpertLayer.empty(1, h, i, "fp32").bytes_per_expert, h, i,
                                                     torch.float32)
    memory = (e // 3) * per_expert  # groups of a third of the experts (or so): several copies a layer
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm = LLM(str(tmp_path), stream_experts="on", stream_experts_min_tokens=8, stream_experts_memory=memory, **kw)
    assert "Expert streaming: steps of >= 8 tokens stream" in caplog.text
    streamer = llm.engine.model.cpu_experts.streamer
    assert streamer is not None and streamer.groups_per_layer > 1  # several copies a layer
    with caplog.at_level(logging.INFO, logger="tandem"):
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert streamer.stats().layers == 3  # the prompt's one prefill step streamed its 3 layers; decode did not
    assert caplog.text.count("routed experts streamed over PCIe (3 layers") == 1  # the log names the path
    copied = streamer.stats().bytes
    assert f"Expert streaming: 3 layer calls, {copied / 1e9:.2f} GB" in llm.engine.stats_line()
    assert streamer.stats().layers == 0 and "Expert streaming" not in llm.engine.stats_line()  # a new window
    from prometheus_client import generate_latest

    assert "tandem:expert_stream_bytes_total{model_name=" in generate_latest(llm.engine.metrics.registry).decode()


def test_auto_streams_nothing_on_a_cpu_run_and_off_is_off(tmp_path) -> None:
    save_tiny_model(tmp_path, "qwen3_moe", seed=5, num_hidden_layers=2)
    for mode in ("auto", "off"):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True,
                  stream_experts=mode)
        assert llm.engine.model.cpu_experts.streamer is None



@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4"])
def test_engine_streams_quantized_experts_with_the_cpu_kernels_tokens(tmp_path, fmt) -> None:
    """The lossy formats stream as the values the CPU kernel decodes: the same greedy tokens."""
    save_tiny_model(tmp_path, "qwen3_moe", seed=5, num_hidden_layers=2)
    prompts = ["<|im_start|>user\nWhat is 17 plus 25?<|im_end|>\n<|im_start|>assistant\n"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True, cpu_moe_dtype=fmt)
    want = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(prompts, params)]
    llm = LLM(str(tmp_path), stream_experts="on", stream_experts_min_tokens=8, **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.model.cpu_experts.streamer.stats().layers == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_ring_streams_over_pcie_and_gives_the_cpu_experts_results() -> None:
    from tandem.offload.cpu_executor import pin_in_place

    E, H, I, k = 16, 256, 128, 4
    weights = {i: dense(E, H, I, seed=i) for i in range(3)}
    layers = {i: CpuExpertLayer.from_dense(*(t.bfloat16() for t in w), "bf16") for i, w in weights.items()}
    for layer in layers.values():
        pin_in_place(layer.data)
    memory = 3 * streaming.unpacked_bytes_per_expert(layers[0].bytes_per_expert, H, I, torch.bfloat16)  # 6 groups
    s = streaming.ExpertStreamer(layers, torch.device("cuda"), torch.bfloat16, memory, min_tokens=16)
    assert s.groups_per_layer == 6 and s.cuda
    g = torch.Generator().manual_seed(3)
    for rep in range(2):
        outs, wants = [], []
        for i, layer in layers.items():  # queued back to back: the copies run ahead of the computes
            x = (torch.randn(300, H, generator=g) * 0.5).bfloat16()
            ids = torch.rand(300, E, generator=g).argsort(-1)[:, :k]
            w = torch.softmax(torch.randn(300, k, generator=g), -1).bfloat16()
            outs.append(s.run(i, x.cuda(), ids.cuda(), w.cuda(), None))
            wants.append(layer(x, ids, w))  # the CPU kernel on the same bf16 weights
        for got, want in zip(outs, wants):
            torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    stats = s.stats()
    assert stats.layers == 6 and stats.bytes == 2 * 3 * E * layers[0].bytes_per_expert and stats.seconds > 0
    unpack, pair = s.time_device()  # the chunk's cost model, timed on the GPU
    assert 0 < unpack < 1 and 0 < pair < 1e-3 and s.holds[0] == -1


def test_deepseek_v4_streams_with_its_swiglu_clamp(tmp_path) -> None:
    """V4's experts clamp their SwiGLU (and its first layers route by token id): streamed prefill
    steps give the CPU kernel's tokens."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from test_deepseek_v4_engine import GREEDY as V4_GREEDY
    from test_deepseek_v4_engine import prompts, save_v4

    save_v4(tmp_path, "hash")
    ps = prompts((17, 30), seed=3)
    kw = dict(device="cpu", kv_cache_memory="8MiB", cpu_moe=True)
    want = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(ps, V4_GREEDY)]
    llm = LLM(str(tmp_path), stream_experts="on", stream_experts_min_tokens=4, **kw)
    streamer = llm.engine.model.cpu_experts.streamer
    assert [o.token_ids for o in llm.generate(ps, V4_GREEDY)] == want
    assert streamer.stats().layers >= len(streamer.order)  # at least one step streamed every layer
    assert all(b.executor.limit == 0.5 for b in llm.engine.model.moe_blocks().values())
