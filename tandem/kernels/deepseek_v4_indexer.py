"""DeepSeek-V4's lightning-indexer scores for decode / verify steps in Triton, and their torch reference.

    deepseek_v4_indexer_scores(q [T, Hi, Di], w [T, Hi], positions [T], token_request [T],
                               index_pages [NB + 1, bs, Di], block_table [B, max_blocks], ratio)
        -> scores [T, N], N = max_blocks * bs

For query token t (request row r, position p) and entry n of the request's index keys:

    score(t, n) = q_scale * sum_h w[t, h] * relu(q[t, h] . key(n))      q_scale = Di^-0.5
    score(t, n) = -inf where n >= (p + 1) // ratio                      (the entry is not closed yet)

which is `IndexerScorer` (tandem/models/deepseek_v4_attention.py) with the closed mask of
`Indexer.pick`, over every entry the block table covers (`_closed_entries` in deepseek_v4_decode.py).
The caller's stable sort of the scores then picks the top k as before.

One program scores one token against one tile of BLOCK_N entries: it loads the token's query heads
[BLOCK_H, BLOCK_D] (all heads of the token in the M dimension of one dot) and the tile's keys through
the block table, takes relu of the [BLOCK_H, BLOCK_N] dots, weights and sums them over the heads. A
tile wholly past the closed count only writes -inf (no key, query or table loads); in a partial tile
the unclosed keys are masked out of the loads, so whatever their slots hold never reaches a score.
Tokens vary fastest in the grid, so the tokens of a verify step read the same key tile close together
in time (from L2).

CUDA-graph capturable: the grid (T, cdiv(N, BLOCK_N)) and the tiles depend only on host ints fixed for
a captured shape (T, Hi, Di, N); positions, request rows and block tables are read on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_MAX_HEADS = 128  # every head of a token sits in one program's dot (V4-Flash: 64)
_MAX_HEAD_DIM = 256  # V4-Flash: 128
_MAX_GRID_Y = 65535  # CUDA's limit on the entry-tile axis of the grid


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, pos_ptr, req_ptr, out_ptr,  # q [T, Hi, Di]; w [T, Hi] fp32; positions, rows [T]; out [T, N]
    pages_ptr, scales_ptr, table_ptr,  # index pages [NB + 1, PAGE, Di]; scales [NB + 1, PAGE]; table [B, max_blocks]
    num_entries, ratio, q_scale, w_scale,
    stride_qt, stride_qh, stride_wt, stride_ot,
    stride_blk, stride_slot, stride_sblk, stride_sslot, stride_bt,
    PAGE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    in_range = n < num_entries
    out_row = out_ptr + t * stride_ot
    pos = tl.load(pos_ptr + t).to(tl.int64)
    closed = (pos + 1) // ratio
    if n0 >= closed:  # nothing in this tile is closed yet: no key is read
        tl.store(out_row + n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=in_range)
    else:
        valid = in_range & (n < closed)
        req = tl.load(req_ptr + t).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = heads < NUM_HEADS
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=h_ok, other=0.0).to(tl.float32) * w_scale  # [BLOCK_H]

        # Entry n sits in slot n % PAGE of block table[r, n // PAGE]; unclosed ones are never loaded.
        idx = tl.where(valid, n, 0)
        blk = tl.load(table_ptr + req * stride_bt + idx // PAGE, mask=valid, other=0).to(tl.int64)
        slot = idx % PAGE
        keys = tl.load(pages_ptr + (blk * stride_blk + slot * stride_slot)[:, None] + offs_d[None, :],
                       mask=valid[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:  # pages in another float type than q: both in fp32
            q = q.to(tl.float32)
            keys = keys.to(tl.float32)
        else:  # same type, or fp8 values (exact in bf16 / fp16 / fp32)
            keys = keys.to(q.dtype)
        dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0) * q_scale  # [BLOCK_N]
        if SCALED:  # key = value * scale, scale > 0: relu(s * x) = s * relu(x), so scale after the sum
            scale = tl.load(scales_ptr + blk * stride_sblk + slot * stride_sslot, mask=valid, other=0.0)
            score = score * scale.to(tl.float32)
        tl.store(out_row + n, tl.where(valid, score, float("-inf")), mask=in_range)


@dataclass(frozen=True)
class _Config:
    block_h: int  # query heads per program, padded (the M of the dot; >= 16 for tl.dot)
    block_d: int  # index head dim, padded (the K of the dot)
    block_n: int  # entries per program
    num_warps: int


def _pick_config(num_heads: int, head_dim: int, fp32: bool, block_n: int | None) -> _Config:
    """Fixed tiles from the static shape (no autotuning: it must not run inside graph capture)."""
    block_h = max(16, triton.next_power_of_2(num_heads))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:  # fp32 dots at Hi = 64, Di = 128: a smaller key tile keeps them in shared memory
        block_n = 64 if fp32 else 128
    return _Config(block_h, block_d, block_n, 8 if block_h * block_n >= 64 * 128 else 4)


def _check(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
           index_pages: torch.Tensor, block_table: torch.Tensor, ratio: int,
           index_scales: torch.Tensor | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"indexer queries must be [T, Hi, Di], got {tuple(q.shape)}")
    T, num_heads, head_dim = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"indexer kernel supports bf16/fp16/fp32 queries, got {q.dtype}")
    if num_heads > _MAX_HEADS or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"indexer kernel takes up to {_MAX_HEADS} heads of up to {_MAX_HEAD_DIM} dims, "
                         f"got {num_heads} x {head_dim}")
    if w.shape != (T, num_heads):
        raise ValueError(f"head weights {tuple(w.shape)} must be [T={T}, Hi={num_heads}]")
    if positions.shape != (T,) or token_request.shape != (T,):
        raise ValueError(f"positions {tuple(positions.shape)} and token_request {tuple(token_request.shape)} "
                         f"must be [T={T}]")
    if index_pages.dim() != 3 or index_pages.shape[2] != head_dim or index_pages.stride(-1) != 1:
        raise ValueError(f"index pages {tuple(index_pages.shape)} do not fit [NB + 1, block_size, {head_dim}] "
                         "with contiguous rows")
    fp8 = index_pages.dtype == torch.float8_e4m3fn
    if fp8 and index_scales is None:
        raise ValueError("fp8 index pages need index_scales [NB + 1, block_size] (one scale per key)")
    if index_scales is not None and index_scales.shape != index_pages.shape[:2]:
        raise ValueError(f"index scales {tuple(index_scales.shape)} must be [NB + 1, block_size] = "
                         f"{tuple(index_pages.shape[:2])}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_blocks], got {tuple(block_table.shape)}")
    if ratio < 1:
        raise ValueError(f"the indexer's compress ratio must be >= 1, got {ratio}")


def deepseek_v4_indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    index_pages: torch.Tensor,
    block_table: torch.Tensor,
    ratio: int,
    index_scales: torch.Tensor | None = None,
    *,
    w_scale: float = 1.0,
    block_n: int | None = None,
) -> torch.Tensor:
    """Lightning-indexer scores of every query token over every entry its block-table row covers.

    q [T, Hi, Di] (rotated; bf16/fp16/fp32, Hi <= 128, Di <= 256, any sizes: tiles are padded);
    w [T, Hi], the head weights weights_proj(hidden) * Hi^-0.5 in float32, or weights_proj(hidden)
    (any float dtype) with `w_scale` = Hi^-0.5, multiplied in float32 in the kernel; positions [T]
    int, the token's absolute position p; token_request [T] int, its request's row of the block table
    (`tandem.core.token_requests` builds it from query_start_loc);
    index_pages [NB + 1, bs, Di], the index keys, entry n of request r in slot
    block_table[r, n // bs] * bs + n % bs of block_table [B, max_blocks] int32; ratio: the
    indexer's compress ratio. fp8 (float8_e4m3fn) pages pass index_scales [NB + 1, bs] float32
    (positive, one a key: key = value * scale).

    Only the closed entries n < (p + 1) // ratio are read; the others score -inf, so their slots
    (and the table blocks behind them) may hold anything. Graph padding tokens need only a request
    row the table covers. `block_n` (a power of two >= 16) forces the entry tile, for tests.
    -> scores [T, N] float32, N = max_blocks * bs (fp32 accumulation; fp32 dots in IEEE precision)."""
    _check(q, w, positions, token_request, index_pages, block_table, ratio, index_scales)
    T, num_heads, head_dim = q.shape
    page = index_pages.shape[1]
    N = block_table.shape[1] * page
    scores = torch.empty(T, N, dtype=torch.float32, device=q.device)
    if T == 0 or N == 0:
        return scores
    # The kernel walks the last dim of each with unit stride (contiguous() is a no-op when it holds).
    q, w, positions, token_request, block_table = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q, w, positions, token_request, block_table))
    fp8 = index_pages.dtype == torch.float8_e4m3fn
    upcast = not fp8 and index_pages.dtype != q.dtype
    fp32 = q.dtype == torch.float32 or upcast
    cfg = _pick_config(num_heads, head_dim, fp32, block_n)
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {cfg.block_n}")
    tiles = triton.cdiv(N, cfg.block_n)
    if tiles > _MAX_GRID_Y:
        raise ValueError(f"{N} index entries make {tiles} tiles of {cfg.block_n}, over CUDA's grid limit of "
                         f"{_MAX_GRID_Y}; raise block_n")
    scales = index_scales if index_scales is not None else index_pages  # unused without scales
    s_strides = (index_scales.stride(0), index_scales.stride(1)) if index_scales is not None else (0, 0)
    _indexer_scores_kernel[(T, tiles)](
        q, w, positions, token_request, scores, index_pages, scales, block_table,
        N, ratio, head_dim**-0.5, float(w_scale),
        q.stride(0), q.stride(1), w.stride(0), scores.stride(0),
        index_pages.stride(0), index_pages.stride(1), *s_strides, block_table.stride(0),
        PAGE=page, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n,
        SCALED=index_scales is not None, UPCAST=upcast, PRECISION="ieee" if fp32 else "tf32",
        num_warps=cfg.num_warps,
    )
    return scores


# --- the torch reference -------------------------------------------------------------------------

def _indexer_keys(token_request: torch.Tensor, index_pages: torch.Tensor, block_table: torch.Tensor,
                 index_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Every entry each token's block-table row covers, gathered: [T, N, Di] float32 (fp8 values
    times their scales), N = max_blocks * bs."""
    bs, head_dim = index_pages.shape[1], index_pages.shape[2]
    idx = torch.arange(block_table.shape[1] * bs, device=index_pages.device)  # [N]
    slots = block_table[token_request.long()][:, idx // bs].long() * bs + idx % bs  # [T, N]
    keys = index_pages.reshape(-1, head_dim)[slots].float()
    if index_scales is not None:
        keys = keys * index_scales.reshape(-1)[slots][..., None].float()
    return keys


def deepseek_v4_indexer_scores_ref(
    q: torch.Tensor,
    w: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    index_pages: torch.Tensor,
    block_table: torch.Tensor,
    ratio: int,
    index_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`deepseek_v4_indexer_scores` in torch (same arguments), vectorised over tokens: the gather of
    `_closed_entries` and the math of `IndexerScorer` in float32, unclosed entries masked to -inf
    -> [T, N] float32. Materialises [T, N, Di] keys: tests and small shapes."""
    keys = _indexer_keys(token_request, index_pages, block_table, index_scales)  # [T, N, Di]
    dots = torch.matmul(q.float(), keys.transpose(-1, -2))  # [T, Hi, N]
    scores = (F.relu(dots) * q.shape[-1] ** -0.5 * w.float().unsqueeze(-1)).sum(dim=1)  # [T, N]
    idx = torch.arange(keys.shape[1], device=q.device)
    closed = idx[None, :] < ((positions + 1) // ratio)[:, None]  # [T, N]
    return scores.masked_fill(~closed, float("-inf"))
