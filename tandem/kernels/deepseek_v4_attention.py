"""DeepSeek-V4 decode / verify attention over the paged caches in Triton, and its torch reference.

    deepseek_v4_paged_attention(q [T, Hh, D], positions [T], token_request [T], window pages + table, ...)
        -> out [T, Hh, D]

The math is `sink_attention` (tandem/models/deepseek_v4_attention.py) on the keys a query sees, read
straight from the cache tensors (tandem/kv/tensors.py) through the block tables. V4 has one shared
K=V head, so every query head of a token reads the same keys: a program owns one token and a group
of up to BLOCK_H heads, puts the heads in the M dimension of its dot products, and loads each key
tile once for both the QK and the PV product (V = K).

A token's keys form one virtual list, walked BLOCK_N at a time with an online softmax:

    [ window: the min(p + 1, W) positions p - W < j <= p, padded to a BLOCK_N multiple | entries ]

entries being every closed one, n < (p + 1) // ratio (HCA), or the indexer's top-k list (CSA: -1
pads and indices outside the closed range are skipped), or nothing (a sliding-only layer). The
sink logit joins at the end (or in the merge): it only adds exp(sink) to the denominator.

When T x head groups is too small to fill the GPU (decode at small batch), the list is split over
NUM_SPLITS programs (flash-decoding) and a second kernel merges their partials with the sink.

CUDA-graph capturable: the grid and the tile shapes depend only on host ints fixed for a captured
shape (T, Hh, D, the top-k width, the SM count); positions, request rows, block tables and top-k
lists are read on the device, and every loop bound is computed in the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.core import token_requests  # noqa: F401 (re-exported: the kernel's callers build its rows with it)
from tandem.kernels.device import sm_count

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: masked tiles stay NaN-free
_LOG2E = tl.constexpr(1.4426950408889634)  # logits run in log2 units: exp2 is the fast path

# Which compressed entries a layer adds to its window (the kernel's ENTRIES switch).
_NO_ENTRIES, _CLOSED_ENTRIES, _TOPK_ENTRIES = 0, 1, 2


@triton.jit
def _online_step(acc, m_i, l_i, q, kv, valid, qk_scale, PRECISION: tl.constexpr):
    """Fold one key tile into the running softmax. q [BLOCK_H, D]; kv [BLOCK_N, D] (K = V, masked
    rows zero); valid [BLOCK_N]; logits in log2 units."""
    s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_rows(pages_ptr, table_row, idx, valid, stride_blk, stride_slot, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows idx [BLOCK_N] (positions or entry numbers) of one request through its block table row
    -> [BLOCK_N, D], zeros where not valid."""
    idx = tl.where(valid, idx, 0)
    blk = tl.load(table_row + idx // PAGE, mask=valid, other=0).to(tl.int64)
    rows = blk * stride_blk + (idx % PAGE) * stride_slot  # element offset of each slot
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(pages_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _v4_attention_kernel(
    q_ptr, pos_ptr, req_ptr, sinks_ptr, out_ptr,  # q, out [T, Hh, D]; positions, requests [T]; sinks [Hh]
    part_acc_ptr, part_ml_ptr,  # split partials: [S, T, Hh, D] and [2, S, T, Hh] fp32 (unused if S == 1)
    win_ptr, win_bt_ptr,  # window pages [1, N + 1, PAGE, 1, D]; table [B, max_blocks] int32
    ent_ptr, ent_bt_ptr, topk_ptr,  # entry pages [N + 1, PAGE, D]; table [B, max_blocks]; top-k [T, K] int32
    num_tokens, num_heads, window, ratio, topk, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_wblk, stride_wslot, stride_wbt,
    stride_eblk, stride_eslot, stride_ebt, stride_kt,
    WIN_PAGE: tl.constexpr, ENT_PAGE: tl.constexpr, ENTRIES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    t64 = t.to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    q = tl.load(q_ptr + t64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None], other=0.0)  # [BLOCK_H, D]

    # The token's virtual key list: window keys [0, n_win), padded to win_end; entries after it.
    n_win = tl.minimum(pos + 1, window)
    win_end = tl.cdiv(n_win, BLOCK_N) * BLOCK_N
    closed = 0
    n_ent = 0
    if ENTRIES == 1:
        closed = (pos + 1) // ratio
        n_ent = closed
    if ENTRIES == 2:
        closed = (pos + 1) // ratio
        n_ent = topk
    total = win_end + n_ent
    if NUM_SPLITS == 1:
        lo = 0
        hi = total
    else:  # this program's share, a multiple of BLOCK_N so no tile straddles two splits
        per_split = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(total, lo + per_split)

    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    win_row = win_bt_ptr + req * stride_wbt
    first_pos = pos - n_win + 1  # window key i sits at position first_pos + i
    for i0 in range(lo, tl.minimum(hi, win_end), BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        valid = i < n_win
        kv = _load_rows(win_ptr, win_row, first_pos + i, valid, stride_wblk, stride_wslot, WIN_PAGE, HEAD_DIM)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, kv.to(q.dtype), valid, qk_scale, PRECISION)
    if ENTRIES != 0:
        ent_row = ent_bt_ptr + req * stride_ebt
        for i0 in range(tl.maximum(lo, win_end), hi, BLOCK_N):
            j = i0 - win_end + tl.arange(0, BLOCK_N)  # index into the entry list
            if ENTRIES == 2:
                n = tl.load(topk_ptr + t64 * stride_kt + j, mask=j < n_ent, other=-1).to(tl.int64)
                valid = (n >= 0) & (n < closed)
            else:
                n = j.to(tl.int64)
                valid = j < n_ent
            kv = _load_rows(ent_ptr, ent_row, n, valid, stride_eblk, stride_eslot, ENT_PAGE, HEAD_DIM)
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, kv.to(q.dtype), valid, qk_scale, PRECISION)

    if NUM_SPLITS == 1:
        sink = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        denom = l_i * alpha + tl.exp2(sink - m_f)  # > 0: the sink always counts
        o = acc * (alpha / denom)[:, None]
        tl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        # Unnormalised partials; a split past the list's end leaves m = _NEG_BIG, l = 0, acc = 0.
        cell = (split * num_tokens + t64) * num_heads + heads  # [BLOCK_H] index into [S, T, Hh]
        tl.store(part_acc_ptr + cell[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + cell, m_i, mask=h_ok)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + cell, l_i, mask=h_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr,
    num_tokens, num_heads, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)), M the max of
    the splits' maxima and the sink."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    cell = (offs_s * num_tokens + t) * num_heads + h  # [S]
    m = tl.load(part_ml_ptr + cell)
    l = tl.load(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + cell)
    acc = tl.load(part_acc_ptr + cell[:, None] * HEAD_DIM + offs_d[None, :])  # [S, D]
    sink = tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
    m_f = tl.maximum(tl.max(m, 0), sink)
    w = tl.exp2(m - m_f)
    denom = tl.sum(w * l, 0) + tl.exp2(sink - m_f)
    o = tl.sum(w[:, None] * acc, 0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class _Config:
    block_h: int  # query heads per program (the M of the dots; >= 16 for tl.dot)
    block_n: int  # keys per online-softmax step
    num_splits: int
    num_warps: int
    num_stages: int


_MAX_SPLITS = 16


def _pick_config(num_tokens: int, num_heads: int, head_dim: int, fp32: bool, num_sms: int,
                 block_n: int | None, num_splits: int | None) -> _Config:
    """Fixed tiles from the static shape (no autotuning: it must not run inside graph capture).
    Wide heads (V4: D = 512) keep the fp32 accumulator [BLOCK_H, D] small enough for registers."""
    wide = head_dim >= 256
    block_h = max(16, min(triton.next_power_of_2(num_heads), 16 if wide else 64))
    if block_n is None:  # fp32 at D = 512: 16 keys a tile keep the pipelined K=V tiles in shared memory
        block_n = 16 if wide and fp32 else 32 if wide or fp32 else 64
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = 1
        if programs < num_sms:  # too few programs to fill the GPU: split each token's key list
            num_splits = min(_MAX_SPLITS, triton.next_power_of_2(triton.cdiv(num_sms, programs)))
    return _Config(block_h, block_n, num_splits, 8 if wide else 4, 2)


def _check(q: torch.Tensor, window_pages: torch.Tensor, entry_pages: torch.Tensor | None,
           entry_table: torch.Tensor | None, ratio: int, topk_idx: torch.Tensor | None) -> None:
    T, _, head_dim = q.shape
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 512:
        raise ValueError(f"V4 attention kernel needs a power-of-two head_dim in 16..512, got {head_dim}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"V4 attention kernel supports bf16/fp16/fp32 queries, got {q.dtype}")
    if window_pages.dim() != 5 or window_pages.shape[0] != 1 or window_pages.shape[3] != 1 \
            or window_pages.shape[4] != head_dim or window_pages.stride(-1) != 1:
        raise ValueError(f"window pages {tuple(window_pages.shape)} do not fit [1, N + 1, block_size, 1, {head_dim}] "
                         "with contiguous rows (one K=V head)")
    if entry_pages is None:
        if topk_idx is not None:
            raise ValueError("topk_idx selects compressed entries: pass entry_pages and entry_table too")
        return
    if entry_table is None or ratio < 1:
        raise ValueError("a compressed layer needs entry_table and its compress ratio >= 1")
    if entry_pages.dim() != 3 or entry_pages.shape[2] != head_dim or entry_pages.stride(-1) != 1:
        raise ValueError(f"entry pages {tuple(entry_pages.shape)} do not fit [N + 1, block_size, {head_dim}] "
                         "with contiguous rows")
    if topk_idx is not None and (topk_idx.dim() != 2 or topk_idx.shape[0] != T):
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} must be [T={T}, K]")


def deepseek_v4_paged_attention(
    q: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    window_pages: torch.Tensor,
    window_table: torch.Tensor,
    window_size: int,
    scale: float,
    sinks: torch.Tensor,
    entry_pages: torch.Tensor | None = None,
    entry_table: torch.Tensor | None = None,
    ratio: int = 0,
    topk_idx: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Sink attention of every query token over its sliding window and compressed entries.

    q [T, Hh, D] (rotated; bf16/fp16/fp32, D a power of two in 16..512); positions [T] int64, the
    token's absolute position p; token_request [T] int: its request's row of the block tables
    (`tandem.core.token_requests` builds it from query_start_loc); window_pages [1, N + 1, bs, 1, D], the
    sliding group's K=V pages with window_table [B, max_blocks] int32 (position j in slot
    table[r, j // bs] * bs + j % bs; the window must already hold the step's own rows); the query
    sees the positions p - window_size < j <= p. sinks [Hh] (float32, natural-log units).

    Compressed layers also pass entry_pages [N' + 1, bs', D] with entry_table [B, max_blocks'] int32
    (entry n in slot table[r, n // bs'] * bs' + n % bs') and `ratio`. HCA (topk_idx None): the query
    sees every closed entry n < (p + 1) // ratio. CSA: topk_idx [T, K] int32 or int64, the pick per
    token; -1 pads (and anything outside [0, (p + 1) // ratio)) are skipped.

    Graph padding tokens need only a position and request row the tables cover (position 0 on a
    table of sink-row placeholders reads one sink row and emits finite garbage).

    `block_n` / `num_splits` (a power of two) force the tiling, for tests; None picks from the shape.
    -> out [T, Hh, D] in q's dtype (fp32 accumulation; fp32 dots in IEEE precision, not TF32)."""
    _check(q, window_pages, entry_pages, entry_table, ratio, topk_idx)
    T, num_heads, head_dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    cfg = _pick_config(T, num_heads, head_dim, q.dtype == torch.float32, sm_count(q.device) or 1,
                       block_n, num_splits)
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1) or cfg.num_splits < 1 \
            or cfg.num_splits & (cfg.num_splits - 1):
        raise ValueError(f"block_n must be a power of two >= 16 and num_splits a power of two, got {cfg}")
    S = cfg.num_splits
    if S > 1:
        part_acc = torch.empty(S, T, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(2 * S * T * num_heads, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    if entry_pages is None:
        entries, ent_pages, ent_table, topk, k = _NO_ENTRIES, window_pages, window_table, positions, 0
        e_strides, ent_page, stride_kt = (0, 0, 0), 1, 0
    else:
        assert entry_table is not None
        ent_pages, ent_table, ent_page = entry_pages, entry_table, entry_pages.shape[1]
        e_strides = (entry_pages.stride(0), entry_pages.stride(1), entry_table.stride(0))
        if topk_idx is None:
            entries, topk, k, stride_kt = _CLOSED_ENTRIES, positions, 0, 0
        else:
            entries, topk, k, stride_kt = _TOPK_ENTRIES, topk_idx, topk_idx.shape[1], topk_idx.stride(0)
            if topk_idx.stride(1) != 1:
                topk = topk_idx.contiguous()
                stride_kt = topk.stride(0)
    grid = (T, triton.cdiv(num_heads, cfg.block_h), S)
    _v4_attention_kernel[grid](
        q, positions, token_request, sinks, out, part_acc, part_ml,
        window_pages, window_table, ent_pages, ent_table, topk,
        T, num_heads, window_size, max(ratio, 1), k, scale * _LOG2E.value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        window_pages.stride(1), window_pages.stride(2), window_table.stride(0),
        *e_strides, stride_kt,
        WIN_PAGE=window_pages.shape[2], ENT_PAGE=ent_page, ENTRIES=entries,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, NUM_SPLITS=S,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if S > 1:
        _merge_splits_kernel[(T, num_heads)](
            part_acc, part_ml, sinks, out, T, num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=S, HEAD_DIM=head_dim, num_warps=4,
        )
    return out



# --- the torch reference -------------------------------------------------------------------------

def _slot_rows(pages: torch.Tensor, table_row: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx [S] (positions or entry numbers) of one request: pages [..., N + 1, bs, (1,) D]
    through its block table row -> [S, D]."""
    bs = pages.shape[2] if pages.dim() == 5 else pages.shape[1]
    flat = pages.reshape(-1, pages.shape[-1])  # [(N + 1) * bs, D], one row per slot
    return flat[table_row[idx // bs].long() * bs + idx % bs]


def visible_keys(positions: torch.Tensor, token_request: torch.Tensor, t: int, window_pages: torch.Tensor,
                 window_table: torch.Tensor, window_size: int, entry_pages: torch.Tensor | None = None,
                 entry_table: torch.Tensor | None = None, ratio: int = 0,
                 topk_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The keys token t sees (same arguments as `deepseek_v4_paged_attention`) -> [S, D]: its window
    in position order, then its entries (HCA: in entry order; CSA: in top-k list order)."""
    p, r = int(positions[t]), int(token_request[t])
    window = torch.arange(max(0, p - window_size + 1), p + 1, device=window_pages.device)
    keys = [_slot_rows(window_pages, window_table[r], window)]
    if entry_pages is not None:
        assert entry_table is not None
        closed = (p + 1) // ratio
        if topk_idx is None:
            n = torch.arange(closed, device=entry_pages.device)
        else:
            n = topk_idx[t].long()
            n = n[(n >= 0) & (n < closed)]
        keys.append(_slot_rows(entry_pages, entry_table[r], n))
    return torch.cat(keys)


def deepseek_v4_paged_attention_ref(
    q: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    window_pages: torch.Tensor,
    window_table: torch.Tensor,
    window_size: int,
    scale: float,
    sinks: torch.Tensor,
    entry_pages: torch.Tensor | None = None,
    entry_table: torch.Tensor | None = None,
    ratio: int = 0,
    topk_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`deepseek_v4_paged_attention` in torch, token by token (host loop; tests only): gathers the
    visible keys and runs the model's `sink_attention` on them in float32 -> [T, Hh, D] in q's dtype."""
    from tandem.models.deepseek_v4_attention import sink_attention  # the model's math (kernels import no model)

    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        keys = visible_keys(positions, token_request, t, window_pages, window_table, window_size,
                            entry_pages, entry_table, ratio, topk_idx).float()  # [S, D]
        visible = torch.ones(1, 1, keys.shape[0], dtype=torch.bool, device=q.device)
        out[t] = sink_attention(q[t].float()[None, None], keys[None], visible, sinks.float(), scale)[0, 0]
    return out
