"""DeepSeek-V4's compressor state and entries for decode / verify steps in three Triton kernels,
replacing ~40 torch launches per compressor and step (the position-bias add and the ring write, the
window gathers, the slot softmax, the weighted sum, `kv_norm`, the rotary tail and the page write),
and, with prefix caching, a fourth that restores the overlap snapshot after a prefix hit.

    deepseek_v4_ring_write(ring, slots [T], positions [T], kv [T, W], gate [T, W], position_bias [m, W])
    deepseek_v4_compress_entries(ring [S + 1, R, 2W], slots [T], positions [T], ratio, head_dim,
                                 overlap, norm_weight [D], eps, inv_freq [rope_dim / 2], scaling,
                                 pages, page_slots [T], sink_slot, snapshots, snapshot_slots [T])
        -> entries [T, D] in the ring's dtype (also stored to the pages when given)
    deepseek_v4_snapshot_restore(rings [(S + 1, R, C)] x1-2, snapshots [(N + 1, m, C)] x1-2,
                                 request_slots [B], restore_ids [B], seq_lens [B], query_start_loc [B + 1])

For token t at position p of the request in ring slot s, window n = (p + 1) // m - 1 (m = ratio;
R = ring rows, a multiple of m; W = the projection width, 2D with `overlap` and D without) is
pooled exactly as `_compress` in tandem/models/deepseek_v4_decode.py does:

    rows j < m of window n:       ring[s, (n m + j) mod R]  = (kv | gate), each W wide
    slots (overlap):              m rows of window n - 1 (kv[:D], gate[W:W+D]; -inf gates when n = 0),
                                  then m rows of window n (kv[D:2D], gate[W+D:])
    slots (no overlap):           the m rows of window n (kv[:D], gate[W:])
    weights = softmax over the slots per channel (float32), rounded to the ring's dtype
    pooled  = sum over slots of round(kv * weight)                   (float32 sum, then rounded)
    entry   = rope_tail(kv_norm(pooled)) at position max(n, 0) m    (RMSNorm as layers/norm.py,
                                                                     cos/sin rounded as InterleavedRotary)

A token that closes no window (n < 0) pools rows anyway (its entry goes to the sink): the same work
whatever the position, so a graph captures it. `_pool_kernel` runs on (T, cdiv(D, BLOCK_D)): two
passes over the slots per channel tile (the max and the sum of exponentials, then the rounded
weights times the values), and with `snapshots` a copy of the m rows of window n (all 2W columns,
the tile's channel in each D-wide quarter or half) to snapshot row snapshot_slots[t] (the null row
unless the token ends a prefix unit). `_norm_rope_kernel` runs on (T,): the norm over D, then each
rotary channel with its pair partner (loaded again rather than shuffled in registers), and with
`pages` the store to the entry's page slot (or the sink). `_ring_write_kernel`, on (T, cdiv(W, BLOCK)),
is step 1 before them: the token's (kv | gate + position_bias[p % m]) to ring row p % R of its slot.
`_snapshot_restore_kernel`, on (B, m), runs before all of them, once for a layer's rings (a CSA
layer's compressor and indexer): for a request with restore id >= 0, ring rows of window
start // m - 1 (start = seq_len - query length) of its slot become the snapshot's; a request
without one (-1, pads too) loads and stores nothing. All of it is data
movement: bit-identical to the torch path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK_D = 32
_BLOCK_S = 32


@triton.jit
def _slot_layout(s, d, n, ratio, rows, head_dim, num_slots, in_d, OVERLAP: tl.constexpr):
    """Slots s [BS] of token's window n, channels d [BD] -> (ring rows [BS], kv columns [BS, BD]
    (the gate's are `width` further), the load mask, and where a slot is window -1's)."""
    in_s = s < num_slots
    if OVERLAP:  # slots < m: window n - 1's first half; the rest window n's second half
        prev = s < ratio
        window = tl.where(prev, n - 1, n)
        j = tl.where(prev, s, s - ratio)
        kv_col = tl.where(prev[:, None], d[None, :], head_dim + d[None, :])
        first = prev[:, None] & (n == 0) & (d[None, :] >= 0)
    else:
        window = n + 0 * s
        j = s
        kv_col = d[None, :] + 0 * s[:, None]
        first = (s[:, None] < 0) & (d[None, :] >= 0)
    row = ((window * ratio + j) % rows + rows) % rows  # Python's modulo: n may be negative
    return row, kv_col, in_s[:, None] & in_d[None, :], first


@triton.jit
def _pool_kernel(
    ring_ptr, slot_ptr, pos_ptr, out_ptr, snap_ptr, snap_slot_ptr,
    ratio, rows, head_dim, width,
    stride_rs, stride_rr, stride_ot, stride_ss, stride_sr,
    OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    SNAPSHOT: tl.constexpr, COLS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < head_dim
    slot = tl.load(slot_ptr + t)
    n = (tl.load(pos_ptr + t) + 1) // ratio - 1
    base = ring_ptr + slot * stride_rs
    if OVERLAP:
        num_slots = 2 * ratio
    else:
        num_slots = ratio
    # pass 1: per channel, the max and the sum of exponentials over the slots
    m_run = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        row, kv_col, mask, first = _slot_layout(s, d, n, ratio, rows, head_dim, num_slots, in_d, OVERLAP)
        g = tl.load(base + row[:, None] * stride_rr + width + kv_col, mask=mask, other=float("-inf")).to(tl.float32)
        g = tl.where(first, float("-inf"), g)  # window -1 does not exist
        m_new = tl.maximum(m_run, tl.max(g, axis=0))
        l_run = l_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(g - m_new[None, :]), axis=0)
        m_run = m_new
    # pass 2: the rounded weights times the values, summed in float32
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        row, kv_col, mask, first = _slot_layout(s, d, n, ratio, rows, head_dim, num_slots, in_d, OVERLAP)
        g = tl.load(base + row[:, None] * stride_rr + width + kv_col, mask=mask, other=float("-inf")).to(tl.float32)
        g = tl.where(first, float("-inf"), g)
        w = (tl.exp(g - m_run[None, :]) / l_run[None, :]).to(dtype).to(tl.float32)
        kv = tl.load(base + row[:, None] * stride_rr + kv_col, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(mask, (kv * w).to(dtype).to(tl.float32), 0.0), axis=0)
    tl.store(out_ptr + t * stride_ot + d, acc.to(dtype), mask=in_d)
    if SNAPSHOT:  # window n's m rows to the token's snapshot row; COLS D-wide column groups make 2W
        snap = snap_ptr + tl.load(snap_slot_ptr + t) * stride_ss
        for j0 in range(0, ratio, BLOCK_S):
            j = j0 + tl.arange(0, BLOCK_S)
            row = ((n * ratio + j) % rows + rows) % rows
            mask = (j < ratio)[:, None] & in_d[None, :]
            for k in tl.static_range(COLS):
                col = k * head_dim + d[None, :]
                v = tl.load(base + row[:, None] * stride_rr + col, mask=mask)
                tl.store(snap + j[:, None] * stride_sr + col, v.to(snap_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ring_write_kernel(
    kv_ptr, gate_ptr, bias_ptr, ring_ptr, slot_ptr, pos_ptr,
    ratio, rows, width,
    stride_kt, stride_gt, stride_b, stride_rs, stride_rr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_c = c < width
    pos = tl.load(pos_ptr + t)
    row = ring_ptr + tl.load(slot_ptr + t) * stride_rs + (pos % rows) * stride_rr
    dtype = ring_ptr.dtype.element_ty
    kv = tl.load(kv_ptr + t * stride_kt + c, mask=in_c, other=0.0)
    gate = tl.load(gate_ptr + t * stride_gt + c, mask=in_c, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + (pos % ratio) * stride_b + c, mask=in_c, other=0.0).to(tl.float32)
    tl.store(row + c, kv.to(dtype), mask=in_c)
    # torch adds in the projections' dtype (float32 math, one rounding), then the ring's cast
    tl.store(row + width + c, (gate + bias).to(gate_ptr.dtype.element_ty).to(dtype), mask=in_c)


@triton.jit
def _restore_row(ring_ptr, snap_ptr, slot, row, sid, j, cols, stride_rs, stride_rr, stride_ss, stride_sr,
                 BLOCK: tl.constexpr):
    """Ring row `row` of state slot `slot` becomes row j of snapshot sid; nothing when sid < 0."""
    dst = ring_ptr + slot * stride_rs + row * stride_rr
    src = snap_ptr + tl.maximum(sid, 0) * stride_ss + j * stride_sr
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        mask = (c < cols) & (sid >= 0)  # no restore: nothing loaded or stored
        tl.store(dst + c, tl.load(src + c, mask=mask).to(ring_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _snapshot_restore_kernel(
    ring_ptr, snap_ptr, ring2_ptr, snap2_ptr, slot_ptr, restore_ptr, seq_ptr, qsl_ptr,
    ratio, rows, cols, cols2,
    stride_rs, stride_rr, stride_ss, stride_sr, stride2_rs, stride2_rr, stride2_ss, stride2_sr,
    BLOCK: tl.constexpr, PAIRS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    sid = tl.load(restore_ptr + b)
    slot = tl.load(slot_ptr + b)
    start = (tl.load(seq_ptr + b) - (tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b))).to(tl.int64)
    # row j of window start // m - 1 (start is a multiple of m when sid >= 0; a pad's is anything)
    row = (((start // ratio - 1) * ratio + j) % rows + rows) % rows
    _restore_row(ring_ptr, snap_ptr, slot, row, sid, j, cols, stride_rs, stride_rr, stride_ss, stride_sr, BLOCK)
    if PAIRS == 2:  # a CSA layer's indexer ring: the same windows, narrower rows
        _restore_row(ring2_ptr, snap2_ptr, slot, row, sid, j, cols2, stride2_rs, stride2_rr, stride2_ss, stride2_sr,
                     BLOCK)


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, pos_ptr, inv_freq_ptr, out_ptr, page_ptr, page_slot_ptr,
    ratio, head_dim, rope_dim, eps, scaling, sink_slot,
    stride_xt, stride_ot, stride_page,
    BLOCK: tl.constexpr, WRITE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    in_c = c < head_dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_xt + c, mask=in_c, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    weight = tl.load(w_ptr + c, mask=in_c, other=0.0).to(tl.float32)
    y = ((x * r).to(dtype).to(tl.float32) * weight).to(dtype)  # RMSNorm: cast, then the weight
    nope = head_dim - rope_dim
    is_rope = (c >= nope) & in_c
    partner = tl.where(is_rope, c ^ 1, c)  # interleaved pairs (nope is even)
    xp = tl.load(x_ptr + t * stride_xt + partner, mask=in_c, other=0.0).to(tl.float32)
    yp = ((xp * r).to(dtype).to(tl.float32) * tl.load(w_ptr + partner, mask=in_c, other=0.0).to(tl.float32)).to(dtype)
    n = (tl.load(pos_ptr + t) + 1) // ratio - 1
    position = (tl.maximum(n, 0) * ratio).to(tl.float32)
    k = tl.where(is_rope, (c - nope) // 2, 0)
    freq = position * tl.load(inv_freq_ptr + k, mask=is_rope, other=0.0)
    cos = (tl.cos(freq) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(freq) * scaling).to(dtype).to(tl.float32)
    yf, ypf = y.to(tl.float32), yp.to(tl.float32)
    even = (c - nope) % 2 == 0
    rotated = tl.where(even, yf * cos - ypf * sin, yf * cos + ypf * sin)
    out = tl.where(is_rope, rotated.to(dtype), y.to(dtype))
    tl.store(out_ptr + t * stride_ot + c, out, mask=in_c)
    if WRITE:  # to the entry's slot when the token closes its window (n >= 0), else to the sink
        closes = ((tl.load(pos_ptr + t) + 1) % ratio == 0) & (n >= 0)
        dst = tl.where(closes, tl.load(page_slot_ptr + t), sink_slot).to(tl.int64)
        tl.store(page_ptr + dst * stride_page + c, out.to(page_ptr.dtype.element_ty), mask=in_c)


def deepseek_v4_ring_write(ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                           gate: torch.Tensor, position_bias: torch.Tensor) -> None:
    """Step 1 of `_compress` (tandem/models/deepseek_v4_decode.py) in one launch: ring row
    p % R of each token's slot becomes (kv | gate + position_bias[p % m]), kv/gate [T, W] the raw
    projections, position_bias [m, W]; the sum rounds to the projections' dtype as torch's add."""
    _, R, two_width = ring.shape
    T, width = kv.shape
    ratio = position_bias.shape[0]
    if two_width != 2 * width or gate.shape != kv.shape or position_bias.shape != (ratio, width) \
            or ring.stride(-1) != 1 or kv.stride(-1) != 1 or gate.stride(-1) != 1 or position_bias.stride(-1) != 1:
        raise ValueError(f"ring {tuple(ring.shape)}, kv {tuple(kv.shape)}, gate {tuple(gate.shape)} and position_bias "
                         f"{tuple(position_bias.shape)} do not fit (need [S + 1, R, 2W], [T, W] x2, [m, W], rows "
                         "contiguous)")
    if T == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _ring_write_kernel[(T, triton.cdiv(width, block))](
        kv, gate, position_bias, ring, slots, positions, ratio, R, width,
        kv.stride(0), gate.stride(0), position_bias.stride(0), ring.stride(0), ring.stride(1), BLOCK=block)


def deepseek_v4_compress_entries(ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, ratio: int,
                                 head_dim: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                                 inv_freq: torch.Tensor, scaling: float, pages: torch.Tensor | None = None,
                                 page_slots: torch.Tensor | None = None, sink_slot: int = 0,
                                 snapshots: torch.Tensor | None = None,
                                 snapshot_slots: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. `pages` (contiguous, rows [.., D] in the flat slot order of the
    paged cache) with `page_slots` [T]: each entry is also stored at flat row page_slots[t] when
    its token closes its window, else at `sink_slot` (what `_compress` writes). `snapshots`
    [N + 1, m, 2W] with `snapshot_slots` [T]: snapshot row snapshot_slots[t] becomes the m ring rows
    of token t's window, as `_compress`'s snapshot write (the null row N takes every other token)."""
    _, R, two_width = ring.shape
    width = two_width // 2
    if width != (2 * head_dim if overlap else head_dim) or R % ratio or ring.stride(-1) != 1:
        raise ValueError(f"ring {tuple(ring.shape)} does not hold ratio-{ratio} windows of head_dim {head_dim}"
                         f"{' (overlapping)' if overlap else ''}")
    rope_dim = 2 * inv_freq.numel()
    if rope_dim > head_dim or (head_dim - rope_dim) % 2:
        raise ValueError(f"rope_dim {rope_dim} does not fit head_dim {head_dim} as interleaved pairs")
    T = positions.shape[0]
    pooled = torch.empty(T, head_dim, dtype=ring.dtype, device=ring.device)
    out = torch.empty_like(pooled)
    if T == 0:
        return out
    snap = snapshots is not None
    if snap and (snapshot_slots is None or snapshots.shape[1:] != (ratio, two_width) or snapshots.stride(-1) != 1):
        raise ValueError(f"snapshots {tuple(snapshots.shape)} do not hold ratio-{ratio} windows of ring rows "
                         f"{two_width} wide (need [N + 1, {ratio}, {two_width}], rows contiguous, and snapshot_slots [T])")
    _pool_kernel[(T, triton.cdiv(head_dim, _BLOCK_D))](
        ring, slots, positions, pooled, snapshots if snap else pooled, snapshot_slots if snap else positions,
        ratio, R, head_dim, width, ring.stride(0), ring.stride(1), pooled.stride(0),
        snapshots.stride(0) if snap else 0, snapshots.stride(1) if snap else 0,
        OVERLAP=overlap, BLOCK_S=_BLOCK_S, BLOCK_D=_BLOCK_D, SNAPSHOT=snap, COLS=two_width // head_dim)
    write = pages is not None
    if write and (page_slots is None or pages.shape[-1] != head_dim or not pages.is_contiguous()):
        raise ValueError(f"the entry write takes contiguous pages of rows [.., {head_dim}] and page_slots [T]")
    _norm_rope_kernel[(T,)](
        pooled, norm_weight, positions, inv_freq, out, pages if write else out, page_slots if write else positions,
        ratio, head_dim, rope_dim, eps, scaling, sink_slot,
        pooled.stride(0), out.stride(0), head_dim, BLOCK=triton.next_power_of_2(head_dim), WRITE=write)
    return out


def deepseek_v4_snapshot_restore(rings: Sequence[torch.Tensor], snapshots: Sequence[torch.Tensor],
                                 request_slots: torch.Tensor, restore_ids: torch.Tensor, seq_lens: torch.Tensor,
                                 query_start_loc: torch.Tensor) -> None:
    """`_restore` (tandem/models/deepseek_v4_decode.py) in one launch, before the step's ring
    writes, for one or two rings (a CSA layer's compressor and indexer) and their snapshots: for
    each request b with restore_ids[b] >= 0, ring rows of window start // m - 1 of its slot
    request_slots[b] become snapshots[restore_ids[b]] [m, C] (start = seq_lens[b] - its query
    length, m = the snapshots' shape[1]); the others are left alone. No host sync: a graph captures it."""
    if not 1 <= len(rings) == len(snapshots) <= 2:
        raise ValueError(f"{len(rings)} rings and {len(snapshots)} snapshots: give one or two pairs")
    R, ratio, B = rings[0].shape[1], snapshots[0].shape[1], restore_ids.shape[0]
    for ring, snaps in zip(rings, snapshots):
        if ring.shape[1] != R or snaps.shape[1:] != (ratio, ring.shape[2]) or R % ratio or ring.stride(-1) != 1 \
                or snaps.stride(-1) != 1:
            raise ValueError(f"ring {tuple(ring.shape)} and snapshots {tuple(snaps.shape)} do not fit (need [S + 1, {R}, C] "
                             f"and [N + 1, {ratio}, C], {ratio} dividing {R}, rows contiguous)")
    if request_slots.shape != (B,) or seq_lens.shape != (B,) or query_start_loc.shape != (B + 1,):
        raise ValueError(f"request slots {tuple(request_slots.shape)}, restore ids {tuple(restore_ids.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)} and query_start_loc {tuple(query_start_loc.shape)}: need [B] x3, [B + 1]")
    if B == 0:
        return
    pairs = len(rings)
    ring2, snap2 = rings[-1], snapshots[-1]
    _snapshot_restore_kernel[(B, ratio)](
        rings[0], snapshots[0], ring2, snap2, request_slots, restore_ids, seq_lens, query_start_loc,
        ratio, R, rings[0].shape[2], ring2.shape[2],
        rings[0].stride(0), rings[0].stride(1), snapshots[0].stride(0), snapshots[0].stride(1),
        ring2.stride(0), ring2.stride(1), snap2.stride(0), snap2.stride(1),
        BLOCK=min(1024, triton.next_power_of_2(max(r.shape[2] for r in rings))), PAIRS=pairs)
