"""The DeepSeek-V4 indexer-score kernel (tandem/kernels/deepseek_v4_indexer.py) against its torch
reference, the reference against the model's `IndexerScorer` with `Indexer.pick`'s closed mask, and
the stable top-k sort that follows.

Cases: several requests in one call with shuffled, out-of-order blocks; tokens with no entry closed
(p < ratio - 1), one, and many; decode and verify steps; fp32, bf16 and fp8 pages with scales. Every
slot no token may read (the sink row, unused table columns, slots past a request's closed entries)
holds NaN, so a stray read shows. Without CUDA the kernel runs in Triton's interpreter on tiny
shapes; with CUDA (`-m gpu`) on V4-Flash's shape, also replayed from a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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

from tandem.models.deepseek_v4_attention import IndexerScorer, closed_entries  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAN = float("nan")
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ix():
    # The kernel uses triton.language's own @jit helpers (tl.sum, tl.full, ...): both may need
    # re-decorating for the interpreter when an earlier test module imported Triton first.
    with bf16_interpreted_dot():
        yield from interpreted_module("tandem.kernels.deepseek_v4_indexer", "_indexer_scores_kernel", language=True)


@dataclass
class Case:
    """One call's inputs (`kwargs`, on the device) and each request's dense closed keys, for the model."""

    kwargs: dict
    spans: list[tuple[int, int]]  # per request: query positions [start, end)
    entries: list[torch.Tensor]  # per request: the keys its last token sees [end // ratio, Di] (fp32, as drawn)


def make_case(spans: list[tuple[int, int]], *, ratio: int = 4, heads: int = 4, head_dim: int = 16,
              block_size: int = 8, dtype: torch.dtype = torch.float32, pages_dtype: torch.dtype | None = None,
              table_width: int = 0, device: str = "cpu", seed: int = 0) -> Case:
    """Requests with query positions [start, end) each; a request's pages hold the end // ratio
    entries its last token sees (NaN after them). pages_dtype FP8 adds per-key scales. The table
    has at least one spare column (or `table_width` columns)."""
    g = torch.Generator().manual_seed(seed)
    D, bs = head_dim, block_size
    n_ent = [e // ratio for _, e in spans]
    n_blocks = [-(-n // bs) for n in n_ent]
    num_blocks = sum(n_blocks) + 2  # two blocks nobody owns
    ids = torch.randperm(num_blocks, generator=g).tolist()
    pages = torch.full((num_blocks + 1, bs, D), NAN)  # row num_blocks: the sink
    width = max(max(n_blocks) + 1, table_width)
    table = torch.full((len(spans), width), num_blocks, dtype=torch.int32)
    entries = []
    for r, (n, b) in enumerate(zip(n_ent, n_blocks)):
        table[r, :b] = torch.tensor(ids[:b], dtype=torch.int32)  # shuffled, not contiguous
        ids = ids[b:]
        keys = torch.randn(n, D, generator=g)
        idx = torch.arange(n)
        pages.view(-1, D)[table[r, idx // bs].long() * bs + idx % bs] = keys
        entries.append(keys)
    T = sum(e - s for s, e in spans)
    kwargs = {
        "q": torch.randn(T, heads, D, generator=g),
        "w": torch.randn(T, heads, generator=g) * heads**-0.5,
        "positions": torch.cat([torch.arange(s, e) for s, e in spans]),
        "token_request": torch.cat([torch.full((e - s,), r) for r, (s, e) in enumerate(spans)]),
        "index_pages": pages, "block_table": table, "ratio": ratio,
    }
    pages_dtype = pages_dtype or dtype
    if pages_dtype == FP8:  # as the cache writes them: one scale per key, amax / 448 (NaN stays NaN)
        scales = pages.abs().amax(dim=-1) / 448.0  # [NB + 1, bs]
        kwargs["index_pages"] = (pages / scales[..., None]).to(FP8)
        kwargs["index_scales"] = scales
    else:
        kwargs["index_pages"] = pages.to(pages_dtype)
    kwargs["q"] = kwargs["q"].to(dtype)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    return Case(kwargs, spans, entries)


def call(fn, case: Case, **extra) -> torch.Tensor:
    return fn(**case.kwargs, **extra)


def check_scores(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    """NaN-free, -inf exactly where the reference has it, the rest close."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not out.isnan().any()
    assert torch.equal(out == float("-inf"), ref == float("-inf"))
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def stable_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, k: int) -> torch.Tensor:
    """`_indexer_topk`'s pick from the scores: [T, k] entry numbers, -1 where not closed."""
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    closed = picked < closed_entries(positions, ratio)[:, None]
    return torch.where(closed, picked, -1)


def assert_no_near_ties(scores: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    """The test's premise: within each row's top k + 1, finite scores are at least `tol` apart (the
    kernel's rounding cannot swap them) or both exactly 0 (a tie both sides break by entry number)."""
    top = scores.sort(dim=-1, descending=True).values[:, : k + 1]
    gaps, lower = top[:, :-1] - top[:, 1:], top[:, 1:]
    finite = lower.isfinite()
    clear = (gaps > tol) | ((gaps == 0) & (lower == 0))
    assert clear[finite].all(), "the seed made a near-tie; pick another"


# Block size 8, ratio 4: no entry closed yet (p < 3, also a graph pad at p = 0); one; a verify step
# of four tokens crossing an entry boundary (24 -> 25 closed, a partial block); 62 closed (8 blocks).
SPANS = [(0, 3), (5, 6), (97, 101), (250, 251)]
DECODE = [(2, 3), (9, 10), (45, 46), (140, 141)]  # closed 0, 2, 11, 35: partial last blocks


# --- the reference against the model's math ------------------------------------------------------

def test_reference_is_the_indexer_scorer(ix):
    """Per request, `IndexerScorer` on its closed keys with `Indexer.pick`'s mask equals the gathered
    reference over the table's coverage (entries past the request's keys: -inf)."""
    heads, head_dim, hidden_size = 4, 16, 24
    case = make_case(SPANS, heads=heads, head_dim=head_dim, seed=1)
    torch.manual_seed(1)
    scorer = IndexerScorer(hidden_size, heads, head_dim)
    kw = case.kwargs
    hidden = torch.randn(kw["q"].shape[0], hidden_size)
    with torch.no_grad():
        kw["w"] = scorer.weights_proj(hidden).float() * scorer.w_scale
        ref = call(ix.deepseek_v4_indexer_scores_ref, case)
        t0 = 0
        for r, (s, e) in enumerate(case.spans):
            sl = slice(t0, t0 + e - s)
            keys = case.entries[r]  # [n, Di]
            n = keys.shape[0]
            model = scorer(kw["q"][sl][None], keys[None], hidden[sl][None])[0]  # [T_r, n]
            closed = torch.arange(n) < closed_entries(kw["positions"][sl], kw["ratio"])[:, None]
            model = model.masked_fill(~closed, float("-inf"))
            torch.testing.assert_close(ref[sl, :n], model, rtol=1e-6, atol=1e-6)
            assert (ref[sl, n:] == float("-inf")).all()
            t0 += e - s


# --- the kernel against the reference (CPU: the interpreter) -----------------------------------

# name -> make_case arguments and the kernel's forced entry tile (None: the default tile)
CONFIGS = {
    "fp32": ({"heads": 4, "head_dim": 12}, 16),  # Di padded 12 -> 16; 72 entries: a partial last tile
    "fp32-bs16": ({"heads": 8, "head_dim": 32, "block_size": 16}, None),
    "bf16": ({"heads": 8, "head_dim": 20, "block_size": 16, "dtype": torch.bfloat16}, 32),
    "bf16-q-fp32-pages": ({"heads": 8, "head_dim": 16, "dtype": torch.bfloat16, "pages_dtype": torch.float32}, 16),
    "fp8-fp32-q": ({"heads": 4, "head_dim": 16, "pages_dtype": FP8}, 16),
    "fp8-bf16-q": ({"heads": 8, "head_dim": 24, "dtype": torch.bfloat16, "pages_dtype": FP8}, 32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_matches_reference(ix, name):
    shape, block_n = CONFIGS[name]
    case = make_case(SPANS, seed=2, **shape)
    out = call(ix.deepseek_v4_indexer_scores, case, block_n=block_n)
    ref = call(ix.deepseek_v4_indexer_scores_ref, case)
    # bf16 operands multiply exactly in fp32 on both sides: only the summation order differs.
    tol = 1e-5 if case.kwargs["q"].dtype == torch.float32 else 1e-4
    check_scores(out, ref, rtol=tol, atol=tol)
    assert (out[:3] == float("-inf")).all()  # p < ratio - 1: nothing closed


@contextmanager
def recorded_loads() -> Iterator[list[torch.Tensor]]:
    """While open, every load the interpreter runs appends the byte addresses it reads (its masked-on
    lanes) as an int64 tensor to the yielded list."""
    from triton.runtime.interpreter import InterpreterBuilder

    load = InterpreterBuilder.create_masked_load
    seen: list[torch.Tensor] = []

    def create_masked_load_recorded(self, ptrs, mask, other, *args):  # noqa: ANN001
        seen.append(torch.as_tensor(ptrs.data[mask.data.astype(bool)].astype("int64")))
        return load(self, ptrs, mask, other, *args)

    InterpreterBuilder.create_masked_load = create_masked_load_recorded
    try:
        yield seen
    finally:
        InterpreterBuilder.create_masked_load = load


def elements_read(seen: list[torch.Tensor], tensor: torch.Tensor) -> list[torch.Tensor]:
    """Per recorded load, the flat element indices it read of `tensor` (empty: it read elsewhere)."""
    base, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    return [(a[(a >= base) & (a < base + size)] - base) // tensor.element_size() for a in seen]


@pytest.mark.parametrize("pages_dtype", [torch.float32, FP8], ids=["fp32", "fp8"])
def test_unclosed_entries_are_never_read(ix, pages_dtype):
    """Decode tokens (their requests' slots past the closed entries are NaN, in a partial last block
    and tile too): the kernel reads only closed entries' slots (and scales) and the table columns
    holding them, and a tile with nothing closed reads no query. Scores are finite exactly where closed."""
    case = make_case(DECODE, heads=4, head_dim=16, pages_dtype=pages_dtype, seed=3)
    kw = case.kwargs
    with recorded_loads() as seen:
        out = call(ix.deepseek_v4_indexer_scores, case, block_n=16)
    closed = closed_entries(kw["positions"], kw["ratio"])  # [T], one token per request
    table, bs, D = kw["block_table"], kw["index_pages"].shape[1], kw["q"].shape[-1]
    allowed = torch.cat([table[r, torch.arange(c) // bs].long() * bs + torch.arange(c) % bs
                         for r, c in enumerate(closed.tolist())])  # flat slots of closed entries
    slots = torch.cat(elements_read(seen, kw["index_pages"])) // D  # one per element read
    assert torch.equal(slots.sort().values, allowed.repeat_interleave(D).sort().values)  # each once, nothing else
    if pages_dtype == FP8:
        scales = torch.cat(elements_read(seen, kw["index_scales"]))
        assert torch.equal(scales.sort().values, allowed.sort().values)
    cells = torch.cat(elements_read(seen, table))  # one per entry lane
    rows, cols = cells // table.shape[1], cells % table.shape[1]
    assert cells.numel() == closed.sum() and (cols < -(-closed[rows] // bs)).all()
    q_loads = sum(e.numel() > 0 for e in elements_read(seen, kw["q"]))
    assert q_loads == sum(-(-c // 16) for c in closed.tolist())  # one per tile holding a closed entry

    mask = torch.arange(out.shape[1]) < closed[:, None]
    assert torch.equal(out.isfinite(), mask) and (out[~mask] == float("-inf")).all()
    check_scores(out, call(ix.deepseek_v4_indexer_scores_ref, case), rtol=1e-5, atol=1e-5)


# --- the top-k pick that follows ----------------------------------------------------------------

@pytest.mark.parametrize("k", [4, 20])
def test_topk_picks_match(ix, k):
    # k = 20: tokens with fewer closed entries also sort -inf ones (stable: the lowest first), then drop them.
    case = make_case(SPANS, heads=8, head_dim=16, seed=4)
    out = call(ix.deepseek_v4_indexer_scores, case, block_n=16)
    ref = call(ix.deepseek_v4_indexer_scores_ref, case)
    assert_no_near_ties(ref, k)
    pos, ratio = case.kwargs["positions"], case.kwargs["ratio"]
    assert torch.equal(stable_topk(out, pos, ratio, k), stable_topk(ref, pos, ratio, k))


def test_zero_score_ties_pick_the_same(ix):
    """Queries and head weights positive; every third key negative in all dims (each head's relu is
    0) and every fifth zero: those score exactly 0 on both sides, so the full stable sort (positives,
    then the zero ties by entry number, then -inf) is the same permutation."""
    case = make_case(SPANS, heads=4, head_dim=16, seed=5)
    kw = case.kwargs
    kw["q"] = kw["q"].abs() + 0.1
    kw["w"] = kw["w"].abs() + 0.1
    flat, bs = kw["index_pages"].view(-1, kw["q"].shape[-1]), kw["index_pages"].shape[1]
    for r, keys in enumerate(case.entries):
        n = torch.arange(keys.shape[0])
        slots = kw["block_table"][r, n // bs].long() * bs + n % bs
        flat[slots[n % 3 == 0]] = -(flat[slots[n % 3 == 0]].abs() + 0.1)
        flat[slots[n % 5 == 0]] = 0.0
    out = call(ix.deepseek_v4_indexer_scores, case, block_n=16)
    ref = call(ix.deepseek_v4_indexer_scores_ref, case)
    check_scores(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out == 0, ref == 0) and (ref == 0).sum() > 20
    N = out.shape[1]
    assert_no_near_ties(ref, N)
    pos = kw["positions"]
    assert torch.equal(stable_topk(out, pos, 4, N), stable_topk(ref, pos, 4, N))


def test_bad_inputs_are_refused(ix):
    case = make_case(DECODE)
    kw = case.kwargs
    with pytest.raises(ValueError, match="head weights"):
        ix.deepseek_v4_indexer_scores(**{**kw, "w": kw["w"][:, :2]})
    fp8 = make_case(DECODE, pages_dtype=FP8).kwargs
    with pytest.raises(ValueError, match="index_scales"):
        ix.deepseek_v4_indexer_scores(**{**fp8, "index_scales": None})
    with pytest.raises(ValueError, match="block_n"):
        ix.deepseek_v4_indexer_scores(**kw, block_n=24)


# --- CUDA: V4-Flash's shape, eager and from a CUDA graph -----------------------------------------

@pytest.mark.parametrize("pages_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.gpu
@needs_cuda
def test_kernel_matches_reference_cuda(ix, pages_dtype):
    """Hi = 64, Di = 128, ratio 4, block size 64, bf16 queries; then a graph captured on one case
    replays another (same shapes, new positions, rows, tables and pages written in place)."""
    shape = {"heads": 64, "head_dim": 128, "block_size": 64, "dtype": torch.bfloat16, "pages_dtype": pages_dtype,
             "table_width": 120, "device": "cuda"}  # 7680 entries: 60 tiles of 128
    cases = [make_case(spans, seed=seed, **shape) for seed, spans in (  # 10 tokens each
        (6, [(0, 3), (127, 130), (9000, 9003), (30000, 30001)]),
        (7, [(29000, 29003), (60, 63), (2, 3), (4095, 4098)]),
    )]
    for case in cases:
        out = call(ix.deepseek_v4_indexer_scores, case)
        check_scores(out, call(ix.deepseek_v4_indexer_scores_ref, case), rtol=1e-3, atol=1e-3)

    first, second = cases
    static = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.kwargs.items()}
    for name in ("index_pages", "index_scales"):  # room for both cases' blocks
        if name in static:
            a, b = first.kwargs[name], second.kwargs[name]
            static[name] = torch.zeros(max(a.shape[0], b.shape[0]), *a.shape[1:], dtype=a.dtype, device="cuda")
            static[name][: a.shape[0]] = a
    static_case = Case(static, first.spans, [])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(ix.deepseek_v4_indexer_scores, static_case)  # JIT outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(ix.deepseek_v4_indexer_scores, static_case)
    for name, src in second.kwargs.items():
        if torch.is_tensor(src):
            static[name].zero_()
            static[name][: src.shape[0]] = src
    graph.replay()
    check_scores(out, call(ix.deepseek_v4_indexer_scores_ref, second), rtol=1e-3, atol=1e-3)
