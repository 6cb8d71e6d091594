"""The DeepSeek-V4 paged attention kernel (tandem/kernels/deepseek_v4_attention.py) against its torch
reference, and the reference against the model's own attention math (`sink_attention` over the
visible set `DeepseekV4Attention.forward_step` builds from `sliding_window_visible` and
`closed_entries`).

Cases: several requests in one call with scattered, out-of-order blocks (one below the window, one
crossing block boundaries, one far past it whose early window blocks are placeholders on the sink
row); sliding-only, HCA and CSA layers; decode and verify steps. Every slot a query must not read
(sink row, unused blocks, rows behind the window, entries not yet closed) holds NaN, so a stray read
shows. Without CUDA the kernels run in Triton's interpreter on tiny shapes; with CUDA (`-m gpu`) on
V4-Flash's shape, also replayed from a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_interp import (
    bf16_interpreted_dot,
    interpret_without_cuda,
    interpreted_module,
    kernel_test_setup,  # noqa: F401 (autouse)
)

interpret_without_cuda()  # before anything imports Triton

from tandem.models.deepseek_v4_attention import closed_entries, sink_attention, sliding_window_visible  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAN = float("nan")


@pytest.fixture(scope="module")
def v4():
    # The kernel uses triton.language's own @jit helpers (tl.zeros, tl.max, ...): both may need
    # re-decorating for the interpreter when an earlier test module imported Triton first.
    with bf16_interpreted_dot():
        yield from interpreted_module("tandem.kernels.deepseek_v4_attention", "_v4_attention_kernel", language=True)


@dataclass
class Case:
    """One call's inputs (`kwargs`, on the device) and each request's dense rows, for the model math."""

    kwargs: dict
    spans: list[tuple[int, int]]  # per request: query positions [start, end)
    rows: list[torch.Tensor]  # per request: K=V rows of positions [0, end) [end, D] (NaN: not cached)
    entries: list[torch.Tensor]  # per request: closed entries [end // ratio, D]


def _pool_ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randperm(n, generator=g).tolist()


def make_case(spans: list[tuple[int, int]], kind: str, *, ratio: int = 4, topk: int = 5, heads: int = 4,
              head_dim: int = 16, window: int = 6, block_size: int = 16, entry_block_size: int = 8,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Case:
    """Requests with query positions [start, end) each; kind: "sliding", "hca" or "csa"."""
    g = torch.Generator().manual_seed(seed)
    D = head_dim
    # Window: blocks wholly behind the first query's window are placeholders (the sink row).
    first = [max(0, s - window + 1) // block_size for s, _ in spans]
    n_blocks = [-(-e // block_size) for _, e in spans]
    num_blocks = sum(n - f for n, f in zip(n_blocks, first)) + 2  # two blocks nobody owns
    ids = _pool_ids(num_blocks, g)
    pages = torch.full((1, num_blocks + 1, block_size, 1, D), NAN)  # row num_blocks: the sink
    width = max(n_blocks) + 1
    table = torch.full((len(spans), width), num_blocks, dtype=torch.int32)
    rows = []
    for r, ((s, e), f, n) in enumerate(zip(spans, first, n_blocks)):
        table[r, f:n] = torch.tensor(sorted(ids[: n - f], reverse=True), dtype=torch.int32)
        ids = ids[n - f:]
        dense = torch.full((e, D), NAN)
        lo = max(0, s - window + 1)  # the rows a cache holds: the window's, and the step's own
        dense[lo:] = torch.randn(e - lo, D, generator=g)
        pos = torch.arange(lo, e)
        pages.view(-1, D)[table[r, pos // block_size].long() * block_size + pos % block_size] = dense[lo:]
        rows.append(dense)
    T = sum(e - s for s, e in spans)
    positions = torch.cat([torch.arange(s, e) for s, e in spans])
    qsl = torch.tensor([0] + [e - s for s, e in spans]).cumsum(0).to(torch.int32)
    kwargs = {
        "q": torch.randn(T, heads, D, generator=g), "positions": positions, "query_start_loc": qsl,
        "window_pages": pages, "window_table": table, "window_size": window, "scale": D**-0.5,
        "sinks": torch.randn(heads, generator=g),
    }
    entries: list[torch.Tensor] = []
    if kind != "sliding":
        n_ent = [e // ratio for _, e in spans]
        e_blocks = [-(-n // entry_block_size) for n in n_ent]
        num_e = sum(e_blocks) + 2
        ids = _pool_ids(num_e, g)
        e_pages = torch.full((num_e + 1, entry_block_size, D), NAN)
        e_table = torch.full((len(spans), max(e_blocks) + 1), num_e, dtype=torch.int32)
        for r, (n, b) in enumerate(zip(n_ent, e_blocks)):
            e_table[r, :b] = torch.tensor(ids[:b], dtype=torch.int32)
            ids = ids[b:]
            ent = torch.randn(n, D, generator=g)
            idx = torch.arange(n)
            e_pages.view(-1, D)[e_table[r, idx // entry_block_size].long() * entry_block_size
                                + idx % entry_block_size] = ent
            entries.append(ent)
        kwargs.update(entry_pages=e_pages, entry_table=e_table, ratio=ratio)
        if kind == "csa":
            kwargs["topk_idx"] = _topk_lists(positions, ratio, topk, g)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    for name in ("q", "window_pages", "entry_pages"):
        if name in kwargs:
            kwargs[name] = kwargs[name].to(dtype)
    return Case(kwargs, spans, rows, entries)


def _topk_lists(positions: torch.Tensor, ratio: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """Per token: up to `topk` distinct closed entries and -1 pads, in a random order -> [T, topk] int32."""
    lists = []
    for p in positions.tolist():
        closed = (p + 1) // ratio
        picked = torch.randperm(closed, generator=g)[:topk].tolist()
        slots = picked + [-1] * (topk - len(picked))
        lists.append([slots[i] for i in torch.randperm(topk, generator=g).tolist()])
    return torch.tensor(lists, dtype=torch.int32)


def call(fn, case: Case, v4, **extra) -> torch.Tensor:
    kwargs = dict(case.kwargs)
    qsl = kwargs.pop("query_start_loc")
    token_request = v4.token_requests(qsl, kwargs["q"].shape[0])
    return fn(token_request=token_request, **kwargs, **extra)


# Request spans [start, end) with W = 6, block size 16: below the window; crossing block 0 -> 1;
# a window crossing block 1 -> 2; far past W (blocks 0..3 are placeholders).
DECODE = [(2, 3), (16, 17), (35, 36), (70, 71)]
VERIFY = [(2, 5), (14, 17), (33, 36), (70, 73)]
# kind -> (layer, ratio, top-k width); csa4k20's lists span two key tiles of 16.
KINDS = {"sliding": ("sliding", 4, 0), "hca4": ("hca", 4, 0), "hca8": ("hca", 8, 0), "csa4": ("csa", 4, 5),
         "csa4k20": ("csa", 4, 20)}


# --- the reference against the model's math ------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_is_the_models_attention(v4, kind):
    """Per request, `sink_attention` on all its rows with forward_step's visible mask (window by
    `sliding_window_visible`, entries by `closed_entries` or the top-k pick) equals the gathered
    reference. NaN rows (not cached) are zeroed here: the model masks them, NaN * 0 would not."""
    layer, ratio, topk = KINDS[kind]
    case = make_case(VERIFY, layer, ratio=ratio, topk=topk)
    kw, W = case.kwargs, case.kwargs["window_size"]
    ref = call(v4.deepseek_v4_paged_attention_ref, case, v4)
    t0 = 0
    for r, (s, e) in enumerate(case.spans):
        positions = torch.arange(s, e)
        q = kw["q"][t0: t0 + e - s]
        keys = case.rows[r].nan_to_num(0.0)  # [e, D], positions 0..e-1
        visible = sliding_window_visible(positions, W, torch.arange(e))  # [T, e]
        if layer != "sliding":
            n = case.entries[r].shape[0]
            if layer == "hca":
                entry_visible = torch.arange(n) < closed_entries(positions, ratio)[:, None]
            else:  # the indexer's pick as a mask, as Indexer.pick returns it
                idx = kw["topk_idx"][t0: t0 + e - s].long()
                entry_visible = torch.zeros(e - s, n + 1, dtype=torch.bool)
                entry_visible.scatter_(1, torch.where(idx < 0, n, idx), True)
                entry_visible = entry_visible[:, :n]
            keys = torch.cat((keys, case.entries[r]))
            visible = torch.cat((visible, entry_visible), dim=-1)
        model = sink_attention(q[None], keys[None], visible[None], kw["sinks"], kw["scale"])[0]
        torch.testing.assert_close(ref[t0: t0 + e - s], model, rtol=1e-5, atol=1e-5)
        t0 += e - s


# --- the kernel against the reference (CPU: the interpreter) -----------------------------------

@pytest.mark.parametrize("spans", [DECODE, VERIFY], ids=["decode", "verify"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_matches_reference_fp32(v4, kind, spans):
    layer, ratio, topk = KINDS[kind]
    case = make_case(spans, layer, ratio=ratio, topk=topk)
    out = call(v4.deepseek_v4_paged_attention, case, v4, block_n=16)  # several key tiles per token
    ref = call(v4.deepseek_v4_paged_attention_ref, case, v4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("kind", ["sliding", "hca4", "csa4"])
def test_split_keys_match_reference(v4, kind, splits):
    # Flash-decoding splits and their merge with the sink; short requests leave some splits empty.
    layer, ratio, topk = KINDS[kind]
    case = make_case(VERIFY, layer, ratio=ratio, topk=topk, seed=1)
    out = call(v4.deepseek_v4_paged_attention, case, v4, block_n=16, num_splits=splits)
    ref = call(v4.deepseek_v4_paged_attention_ref, case, v4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_matches_reference_bf16(v4, kind):
    # Block size 8 for both caches, 20 heads (two head groups, the second partly masked).
    layer, ratio, topk = KINDS[kind]
    case = make_case(VERIFY, layer, ratio=ratio, topk=topk, heads=20, block_size=8, entry_block_size=4,
                     dtype=torch.bfloat16, seed=2)
    out = call(v4.deepseek_v4_paged_attention, case, v4)
    ref = call(v4.deepseek_v4_paged_attention_ref, case, v4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_window_over_several_key_tiles(v4):
    # W = 20 > block_n = 16: the window itself takes two tiles (block size 8: three blocks).
    spans = [(2, 5), (18, 21), (60, 63)]
    case = make_case(spans, "hca", ratio=4, window=20, block_size=8, seed=3)
    out = call(v4.deepseek_v4_paged_attention, case, v4, block_n=16)
    torch.testing.assert_close(out, call(v4.deepseek_v4_paged_attention_ref, case, v4), rtol=1e-5, atol=1e-5)


def test_topk_entries_not_yet_closed_are_skipped(v4):
    # Entry (p + 1) // ratio is not closed for the query at p (its slot may be NaN): both skip it.
    case = make_case(VERIFY, "csa", ratio=4, topk=5, seed=4)
    topk = case.kwargs["topk_idx"].clone()
    topk[:, 0] = closed_entries(case.kwargs["positions"], 4).to(torch.int32)
    case.kwargs["topk_idx"] = topk
    out = call(v4.deepseek_v4_paged_attention, case, v4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, call(v4.deepseek_v4_paged_attention_ref, case, v4), rtol=1e-5, atol=1e-5)


def test_token_requests_pads_to_the_last_request(v4):
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    assert v4.token_requests(qsl, 8).tolist() == [0, 1, 1, 1, 2, 2, 2, 2]


def test_bad_inputs_are_refused(v4):
    case = make_case(DECODE, "csa")
    narrow = Case({**case.kwargs, "q": case.kwargs["q"][..., :12]}, [], [], [])
    with pytest.raises(ValueError, match="head_dim"):
        call(v4.deepseek_v4_paged_attention, narrow, v4)
    no_entries = Case({k: v for k, v in case.kwargs.items() if k not in ("entry_pages", "entry_table")}, [], [], [])
    with pytest.raises(ValueError, match="entry_pages"):
        call(v4.deepseek_v4_paged_attention, no_entries, v4)


# --- CUDA: V4-Flash's shape, bf16, eager and from a CUDA graph ------------------------------------

@pytest.mark.parametrize("kind", ["sliding", "csa4", "hca128"])
@pytest.mark.gpu
@needs_cuda
def test_kernel_matches_reference_cuda(v4, kind):
    """Hh = 64, D = 512, W = 128, CSA top-k 512 / HCA ratio 128; then a graph captured on one case
    replays another (same shapes, new positions, tables and lists written in place)."""
    layer, ratio = {"sliding": ("sliding", 4), "csa4": ("csa", 4), "hca128": ("hca", 128)}[kind]
    shape = {"ratio": ratio, "topk": 512, "heads": 64, "head_dim": 512, "window": 128, "block_size": 64,
             "entry_block_size": 64, "dtype": torch.bfloat16, "device": "cuda"}
    cases = [make_case(spans, layer, seed=seed, **shape) for seed, spans in (
        (3, [(5, 8), (127, 130), (3000, 3003), (9000, 9003)]),
        (4, [(8000, 8003), (60, 63), (4095, 4098), (200, 203)]),
    )]
    for case in cases:
        out = call(v4.deepseek_v4_paged_attention, case, v4)
        torch.testing.assert_close(out.float(), call(v4.deepseek_v4_paged_attention_ref, case, v4).float(),
                                   rtol=2e-2, atol=2e-2)

    # Capture on buffers sized for both cases, then refill them with the second one and replay.
    first, second = cases
    static = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.kwargs.items()}
    for name in ("window_pages", "entry_pages", "window_table", "entry_table"):
        if name in static:
            a, b = first.kwargs[name], second.kwargs[name]
            size = [max(x, y) for x, y in zip(a.shape, b.shape)]
            static[name] = torch.zeros(size, dtype=a.dtype, device="cuda")
            static[name][tuple(slice(0, n) for n in a.shape)] = a
    static_case = Case(static, first.spans, [], [])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(v4.deepseek_v4_paged_attention, static_case, v4)  # JIT outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(v4.deepseek_v4_paged_attention, static_case, v4)
    for name, src in second.kwargs.items():
        if torch.is_tensor(src):
            static[name].zero_()
            static[name][tuple(slice(0, n) for n in src.shape)] = src
    graph.replay()
    torch.testing.assert_close(out.float(), call(v4.deepseek_v4_paged_attention_ref, second, v4).float(),
                               rtol=2e-2, atol=2e-2)
