"""Where the small-batch MoE kernels stop beating the grouped GEMMs, measured on this GPU.

The grouped executor (`moe_grouped.GroupedMoEExecutor`) runs a step of T tokens with top-k routing
through one of two paths: the small-batch GEMV kernels of `moe_small` (each (token, slot) pair reads
its expert's rows itself) or the sort + two `torch._grouped_mm` calls (each expert hit read once,
plus a fixed cost of ~8 kernels). Which is faster depends on the layer shape and the GPU: on the
Qwen3-30B-A3B shape (9.4 MB per expert) a pair more is 9.4 MB more to read, so the GEMMs win early;
on a small model whose experts sit in L2 the GEMV kernels stay faster far beyond the fixed default
(`moe_small.SMALL_MAX_PAIRS`): with it, verify steps of more than 16 tokens on the demo model cost
about twice a decode step on the H200 (0.32 -> 0.68 ms in session 12's start-up table; the table
after the crossover is in BENCHMARKS.md, 2026-12-06).

`tune_small_batch` times both paths on the layers of each distinct shape, each call replayed from a
CUDA graph (as the decode and verify steps run it; the calls go round the layers, so each one's
weights arrive cold as in a forward), at token counts rising geometrically up to the
largest step the runner will capture, with uniform random routing over distinct experts (a neutral
choice: real routing that favours hot experts helps both paths). The small path keeps every count
up to the first one at which it is slower; that limit is set on every executor of the shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.kernels.moe_grouped import GroupedMoEExecutor

logger = logging.getLogger("tandem")


@dataclass(frozen=True)
class Crossover:
    """One layer shape's measurement: the (tokens, small-path s, grouped-path s) rows timed, and
    the pair limit chosen from them."""

    top_k: int
    rows: tuple[tuple[int, float, float], ...]
    max_pairs: int

    def describe(self) -> str:
        shown = ", ".join(f"T={t} {s * 1e6:.0f}/{g * 1e6:.0f}" for t, s, g in self.rows)
        return (f"small-batch kernels up to {self.max_pairs // self.top_k} tokens (k={self.top_k}, "
                f"{self.max_pairs} pairs); us per layer, small/grouped: {shown}")


def token_grid(max_tokens: int) -> list[int]:
    """1, 2, 3, .. rising by ~25% a step up to `max_tokens` (included)."""
    grid, t = [], 1
    while t < max_tokens:
        grid.append(t)
        t = max(t + 1, math.ceil(t * 1.25))
    return grid + [max(max_tokens, 1)]


def choose_limit(rows: Sequence[tuple[int, float, float]], top_k: int) -> int:
    """The pair limit from timed rows (tokens ascending): every count up to the first one where
    the small path is slower than the grouped path; 0 when it loses at the first."""
    limit = 0
    for tokens, small_s, grouped_s in rows:
        if small_s > grouped_s:
            break
        limit = tokens * top_k
    return limit


def graph_seconds(fn: Callable[[], object], reps: int = 10, trials: int = 3) -> float:
    """GPU seconds per call of `fn`, `reps` calls captured in one CUDA graph, best of `trials`
    replays (warmed up and compiled outside the graph first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    best = math.inf
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    del graph
    return best


def measure(executors: Sequence[GroupedMoEExecutor], top_k: int, max_tokens: int, seed: int = 0) -> Crossover:
    """Time both paths at `token_grid(max_tokens)`, stopping at the first count where the small
    path loses (the limit cannot rise past it). `executors`: layers of one shape; the calls of a
    graph go round them, so each call's weights arrive cold from HBM, as in a forward where the
    layers between two calls of one layer evict it from L2."""
    w13 = executors[0].w13
    num_experts, hidden = w13.shape[0], w13.shape[2]
    gen = torch.Generator(device=w13.device).manual_seed(seed)
    layers = list(executors)
    rows = []
    for tokens in token_grid(max_tokens):
        x = torch.randn(tokens, hidden, device=w13.device, generator=gen).to(w13.dtype) * 0.1
        ids = torch.rand(tokens, num_experts, device=w13.device, generator=gen).argsort(-1)[:, :top_k]
        w = torch.rand(tokens, top_k, device=w13.device, generator=gen) + 0.1
        w = (w / w.sum(-1, keepdim=True)).to(w13.dtype)
        turn = iter(range(1 << 62))

        def small() -> torch.Tensor:
            ex = layers[next(turn) % len(layers)]
            return ex.small.fused_moe_small(x, ids, w, ex.w13, ex.w2, ex.limit)

        def grouped() -> torch.Tensor:
            return layers[next(turn) % len(layers)].grouped(x, ids, w)

        small_s, grouped_s = graph_seconds(small), graph_seconds(grouped)
        rows.append((tokens, small_s, grouped_s))
        if small_s > grouped_s:
            break
    return Crossover(top_k, tuple(rows), choose_limit(rows, top_k))


def tune_small_batch(executors: Sequence[tuple[GroupedMoEExecutor, int]], max_tokens: int) -> list[Crossover]:
    """Measure the crossover once per distinct layer shape among `executors` ((executor, top_k)
    pairs; those without the small path are left as they are) for steps of up to `max_tokens`
    tokens, set each executor's `small_max_pairs`, log one line per shape. Call on CUDA, outside
    any graph capture, before the steps' graphs are captured. A shape whose measurement fails
    (e.g. out of memory) keeps its limit, with a warning."""
    shapes: dict[tuple, list[GroupedMoEExecutor]] = {}
    for ex, top_k in executors:
        if ex.small is None or not ex.small.fused_ops_enabled():
            continue
        key = (tuple(ex.w13.shape), tuple(ex.w2.shape), ex.w13.dtype, ex.limit, top_k)
        shapes.setdefault(key, []).append(ex)
    results = []
    with torch.inference_mode():
        for key, group in shapes.items():
            try:
                found = measure(group, key[-1], max_tokens)
            except RuntimeError as e:  # e.g. out of memory: serving goes on with the default limit
                logger.warning("MoE layers %s: the small-batch crossover could not be measured (%s); keeping the "
                               "default of %d pairs", "x".join(map(str, key[0])), e, group[0].small_max_pairs)
                continue
            for ex in group:
                ex.small_max_pairs = found.max_pairs
            logger.info("MoE layers %s x %d: %s", "x".join(map(str, key[0])), len(group), found.describe())
            results.append(found)
    return results


__all__ = ["Crossover", "choose_limit", "graph_seconds", "measure", "token_grid", "tune_small_batch"]
