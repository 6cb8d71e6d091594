"""MoE executors against the "torch" reference: the "grouped" executor (tandem/kernels/moe_grouped.py)
on CPU in fp32 and bf16, its weight packing, a whole tiny Qwen3-MoE model, and (marked gpu) bf16 on
CUDA, CUDA-graph capture and a Qwen3-30B-A3B-shaped timing printout."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch import nn

from tandem import LLM, SamplingParams
from tandem.kernels.moe_grouped import check_grouped_support, pack_expert_weights
from tandem.models.layers.moe import install_moe_executor, make_moe_executor
from moe_refs import dense_reference, make_clamped_experts, make_experts, rel_err
from tiny_models import save_tiny_model

E, K, H, INTER = 8, 2, 64, 32
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def routing(mode: str, tokens: int, num=E, k=K, device="cpu", seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_ids [T, k] int64, topk_weights [T, k] fp32) for a routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if mode == "random":  # distinct experts per token, as the router gives
        ids = torch.rand(tokens, num, generator=g).argsort(-1)[:, :k]
    elif mode == "sparse":  # only experts 1, 4 and 6 hit; the others get no rows
        pool = torch.tensor([1, 4, 6])
        ids = pool[torch.rand(tokens, len(pool), generator=g).argsort(-1)[:, :k]]
    elif mode == "one_expert":  # every slot of every token on expert 5 (the interface allows repeats)
        ids = torch.full((tokens, k), 5)
    else:
        raise ValueError(mode)
    w = torch.rand(tokens, k, generator=g) + 0.1
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("mode", ["random", "sparse", "one_expert"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matches_torch_reference(dtype, tokens, mode):
    experts = make_experts(dtype=dtype, seed=tokens)
    x = torch.randn(tokens, H).to(dtype)
    ids, w = routing(mode, tokens, seed=tokens)
    w = w.to(dtype)
    ref = make_moe_executor("torch", experts)(x, ids, w)
    out = make_moe_executor("grouped", experts)(x, ids, w)
    assert out.shape == (tokens, H) and out.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-5
    else:
        truth = dense_reference(experts, x, ids, w)
        # bf16: both paths round at the same places; grouped is no further from fp32 truth.
        assert rel_err(out, ref) < 2e-2
        assert rel_err(out, truth) < max(2 * rel_err(ref, truth), 1e-2)
    # The reference still works on the packed (view) weights and gives the same answer.
    assert torch.equal(make_moe_executor("torch", experts)(x, ids, w), ref)


@pytest.mark.parametrize("tokens", [5, 33])
def test_grouped_clamps_like_deepseek_v4s_experts(tokens):
    experts = make_clamped_experts(limit=0.5, seed=tokens)
    x = torch.randn(tokens, H)
    ids, w = routing("random", tokens, seed=tokens)
    ref = make_moe_executor("torch", experts)(x, ids, w)
    ex = make_moe_executor("grouped", experts)
    assert ex.limit == 0.5
    assert rel_err(ex(x, ids, w), ref) < 1e-5
    ex.limit = None  # the clamp matters in this case: without it the result moves
    assert rel_err(ex(x, ids, w), ref) > 1e-2


def test_grouped_is_deterministic_and_handles_empty_batch():
    experts = make_experts()
    ex = make_moe_executor("grouped", experts)
    x = torch.randn(17, H)
    ids, w = routing("random", 17)
    assert torch.equal(ex(x, ids, w), ex(x, ids, w))
    assert ex(x[:0], ids[:0], w[:0]).shape == (0, H)


def _storage_bytes(module: nn.Module) -> int:
    seen = {}
    for p in module.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_packing_keeps_names_and_shares_memory():
    experts = make_experts()
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    old = weakref.ref(experts[3].up_proj.weight)
    bytes_before = _storage_bytes(experts)

    ex = make_moe_executor("grouped", experts)
    w13, w2 = ex.w13, ex.w2
    assert w13.shape == (E, 2 * INTER, H) and w2.shape == (E, H, INTER)
    after = experts.state_dict()
    assert list(after) == list(before)
    for name, t in before.items():
        assert after[name].shape == t.shape and torch.equal(after[name], t), name
    for e, mlp in enumerate(experts):  # every weight is a view into the stacks
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.data_ptr() == w13[e, INTER:].data_ptr()
        assert mlp.down_proj.weight.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()
    gc.collect()
    assert old() is None  # the per-expert tensors were freed
    assert _storage_bytes(experts) == bytes_before  # held once, not twice
    # Re-making (e.g. install twice) reuses the stacks instead of packing again.
    again = make_moe_executor("grouped", experts)
    assert again.w13 is w13 and again.w2 is w2
    # Writing through the parameters (a reload with copy_) updates what the executor reads.
    experts[2].down_proj.weight.mul_(2.0)
    assert torch.equal(w2[2], experts[2].down_proj.weight)


def test_weights_replaced_after_packing_are_detected():
    experts = make_experts()
    ex = make_moe_executor("grouped", experts)
    experts.to(torch.float64)  # replaces every parameter's tensor: the stacks are stale
    x = torch.randn(3, H, dtype=torch.float64)
    ids, w = routing("random", 3)
    with pytest.raises(RuntimeError, match="re-install"):
        ex(x, ids, w.double())


def test_unsupported_configurations_fail_loudly():
    with pytest.raises(ValueError, match="bf16 on CUDA"):
        check_grouped_support(torch.float32, torch.device("cuda"), H, INTER)
    with pytest.raises(ValueError, match="float16 on cpu"):
        check_grouped_support(torch.float16, torch.device("cpu"), H, INTER)
    with pytest.raises(ValueError, match="meta device"):
        make_moe_executor("grouped", make_experts(device="meta"))
    with pytest.raises(ValueError, match="16-byte"):
        make_moe_executor("grouped", make_experts(hidden=62))
    assert pack_expert_weights is not None


def test_tiny_qwen3_moe_greedy_tokens_match_torch_executor(tmp_path):
    save_tiny_model(tmp_path, "qwen3_moe", seed=7)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (3, 20, 41)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    model = llm.engine.model
    names = {k: v.shape for k, v in model.state_dict().items()}
    assert install_moe_executor(model, "grouped") == len(model.moe_blocks()) == 2
    assert {k: v.shape for k, v in model.state_dict().items()} == names
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("mode", ["random", "sparse", "one_expert"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_grouped_matches_reference(tokens, mode):
    experts = make_experts(dtype=torch.bfloat16, device="cuda", seed=tokens)
    x = torch.randn(tokens, H, device="cuda").bfloat16()
    ids, w = routing(mode, tokens, device="cuda", seed=tokens)
    w = w.bfloat16()
    ref = make_moe_executor("torch", experts)(x, ids, w)
    out = make_moe_executor("grouped", experts)(x, ids, w)
    assert rel_err(out, ref) < 2e-2
    assert rel_err(out, dense_reference(experts, x, ids, w)) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_and_replay():
    experts = make_experts(dtype=torch.bfloat16, device="cuda")
    ex = make_moe_executor("grouped", experts)
    tokens = 8
    x = torch.randn(tokens, H, device="cuda").bfloat16()
    ids, w = routing("random", tokens, device="cuda")
    w = w.bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph (allocator, lazy init)
        for _ in range(2):
            ex(x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ex(x, ids, w)
    for seed, mode in [(1, "random"), (2, "sparse"), (3, "one_expert")]:  # new routing, same shapes
        new_ids, new_w = routing(mode, tokens, device="cuda", seed=seed)
        x.copy_(torch.randn(tokens, H, device="cuda"))
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ex(x, ids, w)), mode
        assert rel_err(out, make_moe_executor("torch", experts)(x, ids, w)) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_cuda_packing_peak_memory_is_one_layer():
    layers = [
        make_experts(num=32, hidden=512, inter=256, dtype=torch.bfloat16, device="cuda", seed=i) for i in range(4)
    ]
    layer_bytes = _storage_bytes(layers[0])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for experts in layers:  # as install_moe_executor does: layer by layer
        make_moe_executor("grouped", experts)
    gc.collect()
    assert torch.cuda.memory_allocated() <= base
    assert torch.cuda.max_memory_allocated() - base <= 1.05 * layer_bytes


@pytest.mark.gpu
@needs_cuda
def test_cuda_qwen3_30b_layer_timing():
    """Qwen3-30B-A3B MoE layer (E=128, k=8, H=2048, I=768, bf16): prints times, asserts closeness only.
    For T <= 32 (decode sizes) a CUDA-graph replay of "grouped" is timed too."""
    num, k, hidden, inter = 128, 8, 2048, 768
    experts = make_experts(num=num, hidden=hidden, inter=inter, dtype=torch.bfloat16, device="cuda", std=0.02)
    ref_ex = make_moe_executor("torch", experts)
    ex = make_moe_executor("grouped", experts)
    expert_bytes = 3 * hidden * inter * 2
    for tokens in (1, 8, 32, 256, 2048):
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        ids, w = routing("random", tokens, num=num, k=k, device="cuda", seed=tokens)
        w = w.bfloat16()
        assert rel_err(ex(x, ids, w), ref_ex(x, ids, w)) < 2e-2
        times = {}
        for name, fn in (("torch", ref_ex), ("grouped", ex)):
            for _ in range(3):
                fn(x, ids, w)
            torch.cuda.synchronize()
            reps = 20
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x, ids, w)
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0) / reps
        if tokens <= 32:  # decode sizes run inside a captured graph: time a replay too
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                ex(x, ids, w)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ex(x, ids, w)
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
            times["graph"] = (time.perf_counter() - t0) / reps
        hit = int(torch.unique(ids).numel())
        best = min(times["grouped"], times.get("graph", float("inf")))
        gbps = hit * expert_bytes / best / 1e9
        graph_note = f", graph {times['graph'] * 1e6:8.1f} us" if "graph" in times else ""
        print(
            f"\nMoE layer T={tokens:5d}: torch {times['torch'] * 1e6:9.1f} us, "
            f"grouped {times['grouped'] * 1e6:8.1f} us{graph_note} ({times['torch'] / best:.1f}x), "
            f"{hit} experts hit -> {gbps:.0f} GB/s of expert weights"
        )
