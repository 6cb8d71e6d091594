"""Paged attention in Triton: one kernel for decode, speculative verify and (chunked) prefill,
reading K/V straight from the paged cache through the block table.

Each program owns one KV head of one request and a tile of that request's query tokens, and puts
*all* query heads of the KV head's group into the M dimension of its dot products, so every K/V
block is loaded once per group (decode: M = 1 token x group size heads). It walks the cache with an
online softmax up to the causal limit of its tile. When the grid is too small to fill the GPU
(decode at small batch), the cache is split across programs (flash-decoding) and a second kernel
merges the partial results.

fp8 pages (float8_e4m3fn, one float32 scale per token and KV head) are dequantized in registers.
fp8 values are exact in bf16 / fp16 / fp32, so a K tile goes into the dot as it is and each key's
scale then multiplies its column of the fp32 logits: k * s is never rounded to the dot's dtype, and
it costs BLOCK_M x BLOCK_N products instead of BLOCK_N x D (decode has BLOCK_M = 16). A V tile is
dequantized row by row (v * s in fp32, then the dot's dtype, as the torch reference rounds it):
folding V's scales into the probabilities instead would put p * s (p ~1e-6, s ~1e-3) into the
dot's dtype, far below fp16's normal range.

CUDA-graph capturable: the grid depends only on host ints (batch size, max query length, head
counts) that are fixed for a captured shape; lengths and block tables are read on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.attention.backend import check_kv_scales, register_attention_backend
from tandem.core import StepMetadata
from tandem.kernels.device import sm_count
from tandem.kv.tensors import FP8_MAX

_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: keeps fully masked rows NaN-free
_LOG2E = 1.4426950408889634
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr,  # k, v [T, Hkv, D]; cache [2, N, PAGE, Hkv, D]; slots [T] int64
    stride_kt, stride_vt, stride_kv, stride_slot,
    ROW: tl.constexpr, ROW_P: tl.constexpr,  # Hkv * D (K/V rows are contiguous) and its power of two
):
    """Scatter token t's K and V rows to cache slot slot_mapping[t]: one launch for both."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, ROW_P)
    mask = offs < ROW
    dst = kv_ptr + slot * stride_slot + offs
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_fp8(x, dst, scale_dst, head_ok):
    """Quantize the [HKV_P, D] rows x (one vector per KV head) as kv/tensors.py quantize_fp8 does, with
    round-to-nearest divisions (Triton's `/` is approximate) so the bytes equal torch's."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-12), _FP8_MAX)  # [HKV_P]
    q = tl.math.div_rn(x, scale[:, None]).to(dst.dtype.element_ty, fp_downcast_rounding="rtne")  # torch's rounding
    tl.store(dst, q, mask=head_ok[:, None])
    tl.store(scale_dst, scale, mask=head_ok)


@triton.jit
def _write_kv_fp8_kernel(
    k_ptr, v_ptr, kv_ptr, scales_ptr, slot_ptr,  # k, v [T, Hkv, D]; cache [2, N, PAGE, Hkv, D] fp8; slots [T] int64
    stride_kt, stride_vt, stride_kv, stride_slot, stride_skv, stride_sslot,  # scales [2, N, PAGE, Hkv] fp32
    HKV: tl.constexpr, HKV_P: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """_write_kv_kernel for fp8 pages: token t's K and V rows quantized per KV head, scales beside."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs_h = tl.arange(0, HKV_P)
    offs = offs_h[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]  # [HKV_P, D] within a row
    head_ok = offs_h < HKV
    dst = kv_ptr + slot * stride_slot + offs
    scale_dst = scales_ptr + slot * stride_sslot + offs_h
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=head_ok[:, None], other=0.0)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=head_ok[:, None], other=0.0)
    _store_fp8(k, dst, scale_dst, head_ok)
    _store_fp8(v, dst + stride_kv, scale_dst + stride_skv, head_ok)


def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scales: torch.Tensor | None = None) -> None:
    """Same as torch_ref.write_kv in one kernel launch instead of two index copies."""
    T, num_kv_heads, head_dim = k.shape
    if T == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    if (kv_cache.stride(3) != head_dim or kv_cache.stride(2) != num_kv_heads * head_dim
            or kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2)):
        raise ValueError("triton attention needs each cache slot's [Hkv, D] contiguous")
    if kv_scales is not None:
        if kv_scales.stride(3) != 1 or kv_scales.stride(1) != kv_cache.shape[2] * kv_scales.stride(2):
            raise ValueError("triton attention needs each cache slot's [Hkv] scales contiguous")
        _write_kv_fp8_kernel[(T,)](
            k, v, kv_cache, kv_scales, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(2),
            kv_scales.stride(0), kv_scales.stride(2),
            HKV=num_kv_heads, HKV_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, num_warps=4,
        )
        return
    row = num_kv_heads * head_dim
    _write_kv_kernel[(T,)](
        k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(2),
        ROW=row, ROW_P=triton.next_power_of_2(row), num_warps=4,
    )


@triton.jit
def _attend_block(
    acc, m_i, l_i, q,  # running state [BLOCK_M, D], [BLOCK_M], [BLOCK_M]; queries [BLOCK_M, D]
    k_head, v_head, bt_row,  # K / V cache base pointers at this KV head; this request's block table row
    ks_head, vs_head,  # fp8: K / V scale base pointers at this KV head (unused otherwise)
    start_n, pos_m, kv_end, qk_scale,
    stride_blk, stride_slot, stride_sblk, stride_sslot,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """One BLOCK_N-position step of the online softmax. MASKED=False only for blocks every row of
    the tile may see in full (below the tile's first query position), which skips all masking.
    FP8: the K/V tiles are fp8 with one scale per position (see the module docstring)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # cache positions [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        valid_n = offs_n < kv_end
        blk = tl.load(bt_row + offs_n // PAGE, mask=valid_n, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    rows = blk * stride_blk + (offs_n % PAGE) * stride_slot  # element offset of each position [BLOCK_N]
    if MASKED:
        k = tl.load(k_head + rows[:, None] + offs_d[None, :], mask=valid_n[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        k = tl.load(k_head + rows[:, None] + offs_d[None, :])
    if FP8:
        s_rows = blk * stride_sblk + (offs_n % PAGE) * stride_sslot  # scale offset of each position [BLOCK_N]
        if MASKED:
            k_scale = tl.load(ks_head + s_rows, mask=valid_n, other=0.0)
            v_scale = tl.load(vs_head + s_rows, mask=valid_n, other=0.0)
        else:
            k_scale = tl.load(ks_head + s_rows)
            v_scale = tl.load(vs_head + s_rows)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * (k_scale * qk_scale)[None, :]
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        see = (offs_n[None, :] <= pos_m[:, None]) & valid_n[None, :]
        s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_head + rows[:, None] + offs_d[None, :], mask=valid_n[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        v = tl.load(v_head + rows[:, None] + offs_d[None, :])
    if FP8:
        v = v.to(tl.float32) * v_scale[:, None]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr,  # q [T, Hq, D]; cache [2, N, PAGE, Hkv, D]; out [T, Hq, D]
    kvs_ptr,  # FP8: scales [2, N, PAGE, Hkv] fp32 (unused otherwise)
    part_acc_ptr, part_ml_ptr,  # split-KV partials: [S, T, Hq, D] and [S, 2, T, Hq] fp32 (unused if S == 1)
    qsl_ptr, seq_lens_ptr, bt_ptr,  # [B+1] int32, [B] int32, [B, max_blocks] int32
    num_tokens, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_blk, stride_slot, stride_kvh, stride_bt,
    stride_skv, stride_sblk, stride_sslot, stride_skvh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    tile = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    req = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    tile_start = tile * BLOCK_Q
    if tile_start >= q_len:
        return

    # Row m of the tile is query token (tile_start + m // GROUP_P) of head (kvh * GROUP + m % GROUP_P).
    offs_m = tl.arange(0, BLOCK_M)
    tok = tile_start + offs_m // GROUP_P  # token index within the request
    head = kvh * GROUP + offs_m % GROUP_P
    row_ok = (tok < q_len) & (offs_m % GROUP_P < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    # Query token j of the request sits at cache position seq_len - q_len + j.
    first_pos = seq_len - q_len + tile_start
    pos_m = first_pos + offs_m // GROUP_P  # [BLOCK_M]
    kv_end = tl.minimum(seq_len, first_pos + tl.minimum(BLOCK_Q, q_len - tile_start))  # exclusive
    kv_end = tl.maximum(kv_end, 0)
    # This program's share of [0, kv_end): a multiple of BLOCK_N so blocks never straddle splits.
    if NUM_SPLITS == 1:
        lo = 0
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(kv_end, lo + per_split)
    # Positions below first_pos + 1 are visible to every row: those whole blocks need no mask.
    full_end = tl.minimum(hi, (tl.maximum(first_pos + 1, 0) // BLOCK_N) * BLOCK_N)
    full_end = tl.maximum(full_end, lo)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head = kv_ptr + kvh * stride_kvh
    v_head = kv_ptr + stride_kv + kvh * stride_kvh
    ks_head = kvs_ptr + kvh * stride_skvh
    vs_head = kvs_ptr + stride_skv + kvh * stride_skvh
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_head, v_head, bt_row, ks_head, vs_head, start_n, pos_m,
                                      kv_end, qk_scale, stride_blk, stride_slot, stride_sblk, stride_sslot,
                                      PAGE, BLOCK_N, HEAD_DIM, False, PRECISION, FP8)
    for start_n in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_head, v_head, bt_row, ks_head, vs_head, start_n, pos_m,
                                      kv_end, qk_scale, stride_blk, stride_slot, stride_sblk, stride_sslot,
                                      PAGE, BLOCK_N, HEAD_DIM, True, PRECISION, FP8)

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key (seq_len 0): output zeros
        o = acc / l_safe[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Unnormalised partials; an empty split leaves m = _NEG_BIG, l = 0, acc = 0.
        hq = tl.num_programs(2) * GROUP
        cell = (split * num_tokens + q_rows) * hq + head  # [BLOCK_M] index into [S, T, Hq]
        tl.store(part_acc_ptr + cell[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + cell, m_i, mask=row_ok)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tokens * hq + cell, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, qsl_ptr, num_requests,
    num_tokens, num_heads, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of one row."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_requests):  # rows past the last request were never computed
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    cell = (offs_s * num_tokens + t) * num_heads + h  # [S]
    m = tl.load(part_ml_ptr + cell)
    l = tl.load(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + cell)
    acc = tl.load(part_acc_ptr + cell[:, None] * HEAD_DIM + offs_d[None, :])  # [S, D]
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.sum(w[:, None] * acc, 0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class _Config:
    block_q: int  # query tokens per program; rows per program = block_q * group_p
    block_n: int  # cache positions per inner step
    num_splits: int
    num_warps: int
    num_stages: int


def _max_query_len(step: StepMetadata) -> int:
    """The longest query of the step (host int; fixed 1+K for a captured decode graph)."""
    v = getattr(step, "max_query_len", None)
    if v is not None:
        return int(v)
    qsl = step.query_start_loc_cpu
    return max((qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)), default=0)


_MAX_SPLITS = 32
_SMALL_M = 64  # rows per program up to which a step counts as decode/verify (and may split the cache)


def _pick_config(max_q: int, group_p: int, num_programs_per_tile: int, head_dim: int, fp32: bool,
                 num_sms: int, force_splits: int | None) -> _Config:
    """Fixed tile shapes by step shape (no autotuning: it must not run inside graph capture).
    `num_programs_per_tile` = batch * KV heads."""
    small = triton.next_power_of_2(max(max_q, 1)) * group_p <= _SMALL_M
    if small:
        # Decode / verify: one tile covers all of a request's queries; tl.dot needs M >= 16.
        block_q = max(triton.next_power_of_2(max(max_q, 1)), 16 // group_p, 1)
        block_n = 32 if fp32 and head_dim > 64 else 64
        num_warps, num_stages = 4, 2
    else:
        # Prefill: ~128 rows per program (tokens x group heads).
        rows = 64 if fp32 else 128
        block_q = max(1, rows // group_p)
        block_n = 32 if fp32 else 64
        num_warps, num_stages = (8 if head_dim > 64 else 4), 2 if fp32 else 3
    num_tiles = triton.cdiv(max(max_q, 1), block_q)
    if force_splits is not None:
        splits = force_splits
    elif small and num_tiles * num_programs_per_tile < num_sms:
        # Too few programs to fill the GPU: split each request's cache across programs.
        splits = min(_MAX_SPLITS, triton.next_power_of_2(triton.cdiv(num_sms, num_tiles * num_programs_per_tile)))
    else:
        splits = 1
    return _Config(block_q, block_n, splits, num_warps, num_stages)


def _num_sms(device: torch.device) -> int:
    return sm_count(device) or 1  # the interpreter (CPU) counts as one SM


@functools.cache
def _has_fp8(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)  # Triton's float8e4nv needs Ada / Hopper


def _check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":  # the interpreter
        return
    if not _has_fp8(device.index if device.index is not None else torch.cuda.current_device()):
        raise ValueError("triton attention reads fp8 KV pages on compute capability 8.9+ only; "
                         "pass --attention-backend torch or drop --kv-cache-dtype fp8")


@register_attention_backend("triton")
class TritonPagedAttention:
    """Paged attention over the full cache group. Head dims 64/128 (any power of two 16..256),
    q dtypes bf16/fp16/fp32 (fp32 accumulation; fp32 dots use IEEE precision, not TF32), pages
    unscaled in a float dtype or float8_e4m3fn with `kv_scales` (compute capability 8.9+).

    `num_kv_splits` forces the split-KV count (a power of two; tests use it); None chooses it from
    the grid size and the GPU's SM count."""

    def __init__(self, num_kv_splits: int | None = None) -> None:
        if num_kv_splits is not None and (num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1)):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        step: StepMetadata,
        group: int,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # fp8 pages: [2, num_blocks, block_size, Hkv] float32
    ) -> torch.Tensor:  # [T, Hq, D]
        T, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        page = kv_cache.shape[2]
        if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
            raise ValueError(f"triton attention needs a power-of-two head_dim in 16..256, got {head_dim}")
        if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"triton attention supports bf16/fp16/fp32 queries, got {q.dtype}")
        if num_heads % num_kv_heads:
            raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
        if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[4] != head_dim or kv_cache.stride(-1) != 1:
            raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} does not fit [2, N, bs, {num_kv_heads}, {head_dim}]")
        if page != step.block_size:
            raise ValueError(f"KV cache block size {page} differs from the step's {step.block_size}")
        check_kv_scales(kv_cache, kv_scales)
        fp8 = kv_scales is not None
        if fp8:
            _check_fp8_device(q.device)

        _write_kv(k, v, kv_cache, step.slot_mappings[group], kv_scales)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        B = step.num_requests
        if B == 0 or T == 0:
            return out

        group_size = num_heads // num_kv_heads
        group_p = triton.next_power_of_2(group_size)
        max_q = _max_query_len(step)
        fp32 = q.dtype == torch.float32
        cfg = _pick_config(max_q, group_p, B * num_kv_heads, head_dim, fp32, _num_sms(q.device), self.num_kv_splits)
        num_tiles = triton.cdiv(max(max_q, 1), cfg.block_q)
        S = cfg.num_splits
        if S > 1:
            part_acc = torch.empty(S, T, num_heads, head_dim, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(S * 2 * T * num_heads, dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = out  # unused
        block_tables = step.block_tables[group]  # [B, max_blocks] int32, device
        scales = kv_scales if fp8 else kv_cache  # unused without fp8
        s_strides = kv_scales.stride() if fp8 else (0, 0, 0, 0)
        grid = (num_tiles * S, B, num_kv_heads)
        _paged_attention_kernel[grid](
            q, kv_cache, out, scales, part_acc, part_ml,
            step.query_start_loc, step.seq_lens, block_tables,
            T, scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
            *s_strides,
            GROUP=group_size, GROUP_P=group_p, BLOCK_Q=cfg.block_q, NUM_SPLITS=S, PAGE=page,
            BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, PRECISION="ieee" if fp32 else "tf32", FP8=fp8,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if S > 1:
            _merge_splits_kernel[(T, num_heads)](
                part_acc, part_ml, out, step.query_start_loc, B, T, num_heads, out.stride(0), out.stride(1),
                NUM_SPLITS=S, HEAD_DIM=head_dim, num_warps=4,
            )
        return out
