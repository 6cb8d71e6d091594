"""The small-batch Triton MoE kernels (tandem/kernels/moe_small.py) against the torch references: the
routed experts (`fused_moe_small`, and the "grouped" executor's dispatch to it) and the fused router
(`route_topk` against `SparseMoeBlock.route`'s torch code).

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1) on tiny shapes. With
CUDA (`-m gpu`): bf16 on the Qwen3-30B-A3B layer shape, CUDA-graph capture/replay, and a timing
printout of the small path against the `_grouped_mm` path.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before this module's imports decorate kernels

from moe_refs import dense_reference, make_clamped_experts, make_experts, rel_err  # noqa: E402
from tandem.kernels.fused import fused_ops  # noqa: E402
from triton_interp import interpreted_module, kernel_test_setup  # noqa: E402, F401 (autouse fixture)
from tandem.kernels.moe_crossover import choose_limit, graph_seconds, token_grid, tune_small_batch  # noqa: E402
from tandem.kernels.moe_grouped import GroupedMoEExecutor  # noqa: E402
from tandem.models.layers.moe import SparseMoeBlock, make_moe_executor  # noqa: E402

E, K, H, INTER = 8, 2, 64, 32
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def moe_small():
    # Our kernels use triton.language's own @jit helpers (tl.zeros, tl.sum, ...), decorated when
    # Triton is first imported: both may need re-decorating for the interpreter.
    yield from interpreted_module("tandem.kernels.moe_small", "_gate_up_kernel", language=True)


def routing(mode: str, tokens: int, num=E, k=K, device="cpu", seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_ids [T, k] int64, topk_weights [T, k] fp32) for a routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if mode == "random":  # distinct experts per token, as the router gives
        ids = torch.rand(tokens, num, generator=g).argsort(-1)[:, :k]
    elif mode == "shared":  # distinct within a token, experts 2 and 5 in every token
        rest = torch.tensor([e for e in range(num) if e not in (2, 5)])
        ids = torch.cat([torch.tensor([[5, 2]]).expand(tokens, 2),
                         rest[torch.rand(tokens, len(rest), generator=g).argsort(-1)[:, : k - 2]]], 1)
    elif mode == "one_expert":  # every slot on expert 5 (the executor interface allows repeats)
        ids = torch.full((tokens, k), 5)
    else:
        raise ValueError(mode)
    w = torch.rand(tokens, k, generator=g) + 0.1
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def torch_route(logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoeBlock.route's torch code, from the logits on."""
    block = SparseMoeBlock(8, 4, logits.shape[1], k, norm)
    block.gate.forward = lambda hidden: logits  # route() then runs its torch code on these logits
    with fused_ops(False):  # on CUDA route() would call the kernel under test
        return block.route(torch.empty(logits.shape[0], 8, dtype=dtype, device=logits.device))


class CountCalls:
    def __init__(self, fn):  # noqa: ANN001
        self.fn, self.calls = fn, 0

    def __call__(self, *args):  # noqa: ANN002
        self.calls += 1
        return self.fn(*args)


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize(
    "tokens,k,mode", [(1, 2, "random"), (3, 2, "random"), (8, 2, "random"), (5, 4, "shared"), (3, 4, "one_expert")]
)
def test_small_path_matches_torch_reference(moe_small, monkeypatch, tokens, k, mode):
    experts = make_experts(seed=tokens)
    x = torch.randn(tokens, H)
    ids, w = routing(mode, tokens, k=k, seed=tokens)
    ref = make_moe_executor("torch", experts)(x, ids, w)
    ex = GroupedMoEExecutor(experts, small_batch=True)
    spy = CountCalls(moe_small.fused_moe_small)
    monkeypatch.setattr(moe_small, "fused_moe_small", spy)
    out = ex(x, ids, w)
    assert spy.calls == 1  # T * k <= 64: the executor took the small path
    assert out.shape == (tokens, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(ex(x, ids, w), out)  # deterministic


@pytest.mark.parametrize("tokens", [1, 6])
def test_small_path_clamps_like_deepseek_v4s_experts(moe_small, tokens):
    experts = make_clamped_experts(limit=0.5, seed=tokens)
    x = torch.randn(tokens, H)
    ids, w = routing("random", tokens, seed=tokens)
    ref = make_moe_executor("torch", experts)(x, ids, w)
    ex = GroupedMoEExecutor(experts, small_batch=True)
    out = moe_small.fused_moe_small(x, ids, w, ex.w13, ex.w2, ex.limit)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(ex(x, ids, w), out)  # the executor hands the limit on
    unclamped = moe_small.fused_moe_small(x, ids, w, ex.w13, ex.w2)
    assert (unclamped - ref).abs().max() > 1e-2


def test_small_path_reads_the_packed_stacks_directly(moe_small):
    experts = make_experts()
    ex = GroupedMoEExecutor(experts, small_batch=True)
    x = torch.randn(4, H)
    ids, w = routing("random", 4)
    out = moe_small.fused_moe_small(x, ids, w, ex.w13, ex.w2)
    torch.testing.assert_close(out, dense_reference(experts, x, ids, w), atol=1e-5, rtol=0)
    experts[ids[0, 0].item()].down_proj.weight.mul_(2.0)  # a reload writes through the views
    assert not torch.allclose(moe_small.fused_moe_small(x, ids, w, ex.w13, ex.w2)[0], out[0])


def test_small_path_rows_do_not_depend_on_the_batch(moe_small):
    """Fixed per-row summation order: a token's output is bit-identical alone or in a batch."""
    experts = make_experts()
    ex = GroupedMoEExecutor(experts, small_batch=True)
    x = torch.randn(6, H)
    ids, w = routing("random", 6)
    full = moe_small.fused_moe_small(x, ids, w, ex.w13, ex.w2)
    for t in (0, 5):
        alone = moe_small.fused_moe_small(x[t : t + 1], ids[t : t + 1], w[t : t + 1], ex.w13, ex.w2)
        assert torch.equal(alone[0], full[t])


def test_dispatch_rule(moe_small, monkeypatch):
    experts = make_experts()
    spy = CountCalls(moe_small.fused_moe_small)
    monkeypatch.setattr(moe_small, "fused_moe_small", spy)
    small = GroupedMoEExecutor(experts, small_batch=True)
    x = torch.randn(33, H)
    ids, w = routing("random", 33)
    small(x, ids, w)  # 33 * 2 = 66 pairs > 64: the grouped GEMMs
    assert spy.calls == 0
    small(x[:32], ids[:32], w[:32])  # 64 pairs: small
    assert spy.calls == 1
    assert small(x[:0], ids[:0], w[:0]).shape == (0, H) and spy.calls == 1
    GroupedMoEExecutor(experts)(x[:2], ids[:2], w[:2])  # CPU default: the grouped GEMMs
    assert spy.calls == 1
    assert make_moe_executor("grouped", experts).small is None
    small.small_max_pairs = 66  # what moe_crossover sets after measuring
    small(x, ids, w)
    assert spy.calls == 2
    small.small_max_pairs = 0  # the small path lost at one token
    small(x[:1], ids[:1], w[:1])
    assert spy.calls == 2


def test_crossover_keeps_the_small_path_up_to_its_first_loss():
    assert token_grid(20) == [1, 2, 3, 4, 5, 7, 9, 12, 15, 19, 20] and token_grid(1) == [1]
    rows = [(1, 1.0, 2.0), (4, 1.5, 2.0), (9, 2.0, 2.0), (12, 2.5, 2.0), (15, 1.0, 2.0)]
    assert choose_limit(rows, top_k=4) == 36  # ties keep the small path; a later win is not trusted
    assert choose_limit([(1, 3.0, 2.0)], top_k=8) == 0
    assert choose_limit([], top_k=8) == 0


def test_crossover_sets_each_shape_and_a_failed_measurement_keeps_the_default(moe_small, monkeypatch, caplog):
    """One measurement per distinct shape, its limit set on every executor of that shape; a
    shape whose measurement raises (out of memory, say) keeps its limit and is logged."""
    from tandem.kernels import moe_crossover

    a, b = GroupedMoEExecutor(make_experts(), small_batch=True), GroupedMoEExecutor(make_experts(), small_batch=True)
    other = GroupedMoEExecutor(make_experts(num=4), small_batch=True)
    seen = []

    def fake_measure(group, top_k, max_tokens):  # noqa: ANN001, ANN202
        seen.append(len(group))
        if group[0] is other:
            raise RuntimeError("CUDA out of memory")
        return moe_crossover.Crossover(top_k, ((1, 1.0, 2.0), (5, 3.0, 2.0)), choose_limit([(1, 1.0, 2.0), (5, 3.0, 2.0)], top_k))

    monkeypatch.setattr(moe_crossover, "measure", fake_measure)
    found = tune_small_batch([(a, 2), (b, 2), (other, 2)], max_tokens=8)
    assert seen == [2, 1] and len(found) == 1
    assert a.small_max_pairs == b.small_max_pairs == 2  # up to 1 token of top-2
    assert other.small_max_pairs == moe_small.SMALL_MAX_PAIRS
    assert "could not be measured" in caplog.text and "CUDA out of memory" in caplog.text


@pytest.mark.parametrize("num,k,tokens", [(8, 2, 5), (60, 4, 3), (128, 8, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_torch_route(moe_small, num, k, tokens, norm):
    logits = torch.randn(tokens, num, generator=torch.Generator().manual_seed(num)) * 3
    ids, w = moe_small.route_topk(logits, k, norm)
    ref_ids, ref_w = torch_route(logits, k, norm, torch.float32)
    assert ids.dtype == torch.int64 and ids.shape == (tokens, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)


def test_router_bf16_out_and_empty(moe_small):
    logits = torch.randn(4, 16).bfloat16()
    ids, w = moe_small.route_topk(logits, 4, True, out_dtype=torch.bfloat16)
    ref_ids, ref_w = torch_route(logits, 4, True, torch.bfloat16)
    assert torch.equal(ids, ref_ids) and w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float(), ref_w.float(), atol=4e-3, rtol=0)  # one bf16 ulp at most
    empty_ids, empty_w = moe_small.route_topk(logits[:0], 4, True)
    assert empty_ids.shape == (0, 4) and empty_w.shape == (0, 4)
    with pytest.raises(ValueError, match="top_k"):
        moe_small.route_topk(logits, 17, True)


# ---------------------------------------------------------------------------------------------- GPU

QWEN = dict(num=128, k=8, hidden=2048, inter=768)


@pytest.fixture(scope="module")
def qwen_experts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return make_experts(num=QWEN["num"], hidden=QWEN["hidden"], inter=QWEN["inter"], dtype=torch.bfloat16,
                        device="cuda", std=0.02)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("mode", ["random", "shared"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_qwen3_layer_matches_reference(moe_small, qwen_experts, tokens, mode):
    x = torch.randn(tokens, QWEN["hidden"], device="cuda").bfloat16()
    ids, w = routing(mode, tokens, num=QWEN["num"], k=QWEN["k"], device="cuda", seed=tokens)
    w = w.bfloat16()
    ex = make_moe_executor("grouped", qwen_experts)
    assert ex.small is not None  # on CUDA the grouped executor dispatches small batches
    out = ex(x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, make_moe_executor("torch", qwen_experts)(x, ids, w)) < 2e-2
    assert rel_err(out, dense_reference(qwen_experts, x, ids, w)) < 1e-2  # fp32 inside: near the truth
    assert torch.equal(out, moe_small.fused_moe_small(x, ids, w, ex.w13, ex.w2))


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.gpu
@needs_cuda
def test_cuda_router_matches_torch_route(moe_small, tokens, norm):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 128, device="cuda", generator=g) * 3
    ids, w = moe_small.route_topk(logits, 8, norm)
    ref_ids, ref_w = torch_route(logits, 8, norm, torch.float32)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=2e-6, rtol=0)  # tl.exp is the fast exp2 on GPU
    lb = logits.bfloat16()
    ids, w = moe_small.route_topk(lb, 8, norm, out_dtype=torch.bfloat16)
    ref_ids, ref_w = torch_route(lb, 8, norm, torch.bfloat16)
    # bf16 logits tie often, and tied experts may come in either order; their weights are equal, so
    # the weights compare position by position whatever the ids
    torch.testing.assert_close(w.float(), ref_w.float(), atol=8e-3, rtol=0)


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_and_replay_router_and_experts(moe_small, qwen_experts, tokens):
    hidden, num, k = QWEN["hidden"], QWEN["num"], QWEN["k"]
    ex = make_moe_executor("grouped", qwen_experts)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    logits = torch.randn(tokens, num, device="cuda").bfloat16()

    def step():
        ids, w = moe_small.route_topk(logits, k, True, out_dtype=torch.bfloat16)
        return ex(x, ids, w), ids

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the graph
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids = step()
    for seed in (1, 2, 3):  # new inputs and routing, same shapes
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(tokens, hidden, device="cuda", generator=g))
        logits.copy_(torch.randn(tokens, num, device="cuda", generator=g) * 2)
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_ids = step()
        assert torch.equal(ids, eager_ids) and torch.equal(out, eager_out), seed


def _time_us(fn) -> float:
    """GPU time per call of fn, replayed from a CUDA graph (as the decode step runs it)."""
    return graph_seconds(fn, reps=50) * 1e6


@pytest.mark.gpu
@needs_cuda
def test_cuda_qwen3_layer_timing_small_vs_grouped(moe_small, qwen_experts):
    """Prints per-layer times (graph replays) of the small path, the `_grouped_mm` path and the
    routers; asserts closeness only."""
    hidden, num, k, inter = QWEN["hidden"], QWEN["num"], QWEN["k"], QWEN["inter"]
    small = GroupedMoEExecutor(qwen_experts, small_batch=True)
    grouped = GroupedMoEExecutor(qwen_experts, small_batch=False)
    expert_bytes = 3 * hidden * inter * 2
    for tokens in (1, 2, 4, 8):
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        ids, w = routing("random", tokens, num=num, k=k, device="cuda", seed=tokens)
        w = w.bfloat16()
        assert rel_err(small(x, ids, w), grouped(x, ids, w)) < 2e-2
        t_small = _time_us(lambda: small(x, ids, w))
        t_grouped = _time_us(lambda: grouped(x, ids, w))
        hit = int(torch.unique(ids).numel())
        print(
            f"\nMoE layer T={tokens}: small {t_small:6.1f} us ({hit * expert_bytes / t_small / 1e3:5.0f} GB/s), "
            f"_grouped_mm {t_grouped:6.1f} us ({hit * expert_bytes / t_grouped / 1e3:5.0f} GB/s), "
            f"{hit} experts hit, {t_grouped / t_small:.2f}x"
        )
    logits = torch.randn(1, num, device="cuda").bfloat16()

    def torch_router():
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        return ids, (weights / weights.sum(dim=-1, keepdim=True)).bfloat16()

    t_fused = _time_us(lambda: moe_small.route_topk(logits, k, True, out_dtype=torch.bfloat16))
    print(f"\nrouter T=1: fused {t_fused:5.1f} us, torch {_time_us(torch_router):5.1f} us")


@pytest.mark.gpu
@needs_cuda
def test_cuda_crossover_is_measured_per_shape_and_keeps_results(moe_small, qwen_experts):
    """The Qwen3-30B-A3B shape and a demo-sized one (experts in L2): each gets its own measured
    limit, consistent with its timed rows, and a step above the old fixed limit that now takes
    the small path gives the grouped path's result."""
    tiny = make_experts(num=16, hidden=256, inter=128, dtype=torch.bfloat16, device="cuda", std=0.05)
    qwen = GroupedMoEExecutor(qwen_experts)
    small = [GroupedMoEExecutor(tiny), GroupedMoEExecutor(tiny)]
    found = tune_small_batch([(qwen, QWEN["k"]), (small[0], 4), (small[1], 4)], max_tokens=96)
    assert len(found) == 2  # one measurement per distinct shape
    for result in found:
        assert result.max_pairs == choose_limit(result.rows, result.top_k)
        print(f"\n{result.describe()}")
    assert qwen.small_max_pairs == found[0].max_pairs
    assert small[0].small_max_pairs == small[1].small_max_pairs == found[1].max_pairs
    tokens = found[1].max_pairs // 4
    if tokens * 4 > moe_small.SMALL_MAX_PAIRS:
        x = torch.randn(tokens, 256, device="cuda").bfloat16()
        ids, w = routing("random", tokens, num=16, k=4, device="cuda", seed=3)
        w = w.bfloat16()
        assert small[0].takes_small(tokens * 4)
        assert rel_err(small[0](x, ids, w), small[0].grouped(x, ids, w)) < 2e-2
