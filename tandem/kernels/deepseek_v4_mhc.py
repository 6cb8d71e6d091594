"""DeepSeek-V4's manifold-constrained hyper-connections (mHC) around a block, in three Triton kernels
for decode / verify steps, where the torch reference's Sinkhorn alone is ~120 launches of 4x4
tensors per block (20 iterations of sum, add, divide over rows and columns).

    deepseek_v4_hc_mix(streams [T, N, H], fn [M, N*H], norm_eps) -> mixes [T, S, M] fp32 (split-K partials)
    deepseek_v4_hc_pre(streams [T, N, H], mixes [T, (S,) (2+N)N] fp32, base, scale [3], hc_eps, iters)
        -> (collapsed [T, H], post [T, N] fp32, comb [T, N, N] fp32)
    deepseek_v4_hc_head(streams, mixes [T, (S,) N], base [N], scale [1], hc_eps) -> collapsed [T, H]
    deepseek_v4_hc_merge(streams [T, N, H], block_out [T, H], post, comb) -> streams [T, N, H]

`mixes` is the linear map of the RMS-normed flattened streams, `F.linear(x * rsqrt(mean(x^2) + eps),
fn)` in float32 over x = streams.flatten(-2) (`HyperConnection.fn`, or `HyperHead.hc_fn` with M = N).
`_hc_mix_kernel` computes it on a grid (T, S): every program takes the statistic over the whole row
(the row is N*H values, read from L2), scales its K chunk of x by it and dots that with its chunk
of every fn row (read in fn's dtype, widened to float32: the reference's `fn.float()`), writing
partial sums; the kernels that read `mixes` sum the S partials in one fixed order (one load of
all S, then a reduction; S = 1: the plain linear map). The torch path's four launches (cast, norm, weight cast, cuBLAS's split-K GEMV and its
reduce) become one; S programs keep fn's bytes (1.5 MB at V4-Flash in bf16) streaming.

From the mixes, per token, as `HyperConnection.forward` in tandem/models/deepseek_v4.py (float32 throughout):

    pre_n  = sigmoid(mixes[n] * scale[0] + base[n]) + hc_eps                        n < N
    post_n = 2 * sigmoid(mixes[N + n] * scale[1] + base[N + n])
    comb   = sinkhorn(mixes[2N:] * scale[2] + base[2N:] as [N, N], iters, hc_eps)
    collapsed[h] = sum_n pre_n * streams[n, h]                                      (to streams' dtype)

(`HyperHead` is the collapse alone) and `HyperConnection.merge`, with the reference's roundings to
the streams' dtype (comb and post rounded first, the stream mix accumulated in float32 and rounded,
then each sum):

    new[k, h] = post_k * block_out[h] + sum_j comb[j, k] * streams[j, h]

`_hc_pre_kernel` runs on a grid (T, cdiv(H, BLOCK_H)): every program collapses its tile of the
hidden size (pre is four scalar loads); program (t, 0) also runs the Sinkhorn in registers and writes
post and comb. `_hc_merge_kernel` runs on the same grid. Streams may be a broadcast view (stride 0
over N: the embedding's copies before the first layer). CUDA-graph capturable: grids and tiles
depend only on T, N and H.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 512
_MIX_CHUNK = 512  # K values per program of the mix: 32 programs at V4-Flash (N*H = 16384)
_MIX_BLOCK_K = 128
# Values per pass of the statistic: 8 passes at V4-Flash (with 128 passes of 128 values the kernel
# took 14.7 us a call on the H200, its passes latency-bound)
_MIX_STAT_K = 2048


@triton.jit
def _hc_mix_kernel(
    streams_ptr, fn_ptr, out_ptr,
    hidden, rows, eps,
    stride_st, stride_sn, stride_fn, stride_ot, stride_os,
    N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, STAT_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    K = N * hidden
    x_row = streams_ptr + t * stride_st
    # The statistic over the whole flattened row, in the same order in every program. Wide tiles:
    # the loop is latency-bound (one L2 read per pass), so few passes is what makes it cheap.
    sq = tl.zeros([STAT_K], dtype=tl.float32)
    for k0 in range(0, K, STAT_K):
        k = k0 + tl.arange(0, STAT_K)
        x = tl.load(x_row + (k // hidden) * stride_sn + k % hidden, mask=k < K, other=0.0).to(tl.float32)
        sq += x * x
    r = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    m = tl.arange(0, BLOCK_M)[:, None]  # [BM, 1] fn rows
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < K
        y = tl.load(x_row + (k // hidden) * stride_sn + k % hidden, mask=in_k, other=0.0).to(tl.float32) * r
        w = tl.load(fn_ptr + m * stride_fn + k[None, :], mask=(m < rows) & in_k[None, :], other=0.0).to(tl.float32)
        acc += w * y[None, :]
    mo = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + t * stride_ot + split * stride_os + mo, tl.sum(acc, axis=1), mask=mo < rows)


@triton.jit
def _mix_sum(mix, stride_ms, SPLITS, offs, mask, BLOCK_S: tl.constexpr):
    """The mixes at offs [BLOCK_N]: the sum of the SPLITS partials, all read in one load (a loop of
    dependent reads was most of `_hc_pre_kernel`'s time) and reduced in a fixed order, the same in
    every kernel that reads them (`_mix_sum_2d` too)."""
    s = tl.arange(0, BLOCK_S)[:, None]
    return tl.sum(tl.load(mix + s * stride_ms + offs[None, :], mask=(s < SPLITS) & mask[None, :], other=0.0), axis=0)


@triton.jit
def _mix_sum_2d(mix, stride_ms, SPLITS, offs, mask, BLOCK_S: tl.constexpr):
    """`_mix_sum` at offs [BLOCK_N, BLOCK_N]."""
    s = tl.arange(0, BLOCK_S)[:, None, None]
    ok = (s < SPLITS) & mask[None, :, :]
    return tl.sum(tl.load(mix + s * stride_ms + offs[None, :, :], mask=ok, other=0.0), axis=0)


@triton.jit
def _hc_pre_kernel(
    streams_ptr, mixes_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr,
    hidden, hc_eps, splits,
    stride_st, stride_sn, stride_mt, stride_ms, stride_ot,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ITERS: tl.constexpr, BLOCK_H: tl.constexpr, FULL: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = h < hidden
    mix = mixes_ptr + t * stride_mt
    s_pre = tl.load(scale_ptr).to(tl.float32)
    j = tl.arange(0, BLOCK_N)
    in_n = j < N
    pre_mix = _mix_sum(mix, stride_ms, splits, j, in_n, BLOCK_S)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n in tl.static_range(N):
        pre_n = tl.sum(tl.where(j == n, pre_mix, 0.0), axis=0)  # lane n (the others add 0)
        pre = tl.sigmoid(pre_n * s_pre + tl.load(base_ptr + n).to(tl.float32)) + hc_eps
        x = tl.load(streams_ptr + t * stride_st + n * stride_sn + h, mask=in_h, other=0.0).to(tl.float32)
        acc += pre * x
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=in_h)
    if FULL and tl.program_id(1) == 0:
        s_post = tl.load(scale_ptr + 1).to(tl.float32)
        post_x = (_mix_sum(mix, stride_ms, splits, N + j, in_n, BLOCK_S) * s_post
                  + tl.load(base_ptr + N + j, mask=in_n, other=0.0).to(tl.float32))
        tl.store(post_ptr + t * N + j, 2.0 * tl.sigmoid(post_x), mask=in_n)
        # The Sinkhorn projection of the [N, N] mixing logits; padded lanes hold 0 after every pass.
        rows, cols = j[:, None], j[None, :]
        valid = (rows < N) & (cols < N)
        s_comb = tl.load(scale_ptr + 2).to(tl.float32)
        at = 2 * N + rows * N + cols
        logits = (_mix_sum_2d(mix, stride_ms, splits, at, valid, BLOCK_S) * s_comb
                  + tl.load(base_ptr + at, mask=valid, other=0.0).to(tl.float32))
        logits = tl.where(valid, logits, -1e30)  # finite: a padded row's max minus itself is 0, not NaN
        e = tl.where(valid, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
        m = tl.where(valid, e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None] + hc_eps, 0.0)  # row softmax + eps
        m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            m = m / (tl.sum(m, axis=1)[:, None] + hc_eps)
            m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + rows * N + cols, m, mask=valid)


@triton.jit
def _hc_merge_kernel(
    streams_ptr, block_ptr, block2_ptr, post_ptr, comb_ptr, out_ptr,
    hidden,
    stride_st, stride_sn, stride_bt, stride_b2t, stride_ot, stride_on,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, SUM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = h < hidden
    k = tl.arange(0, BLOCK_N)
    in_k = k < N
    dtype = out_ptr.dtype.element_ty
    mixed = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(N):
        comb_j = tl.load(comb_ptr + t * N * N + j * N + k, mask=in_k, other=0.0).to(dtype).to(tl.float32)  # [k]
        x = tl.load(streams_ptr + t * stride_st + j * stride_sn + h, mask=in_h, other=0.0).to(tl.float32)
        mixed += comb_j[:, None] * x[None, :]
    post = tl.load(post_ptr + t * N + k, mask=in_k, other=0.0).to(dtype).to(tl.float32)
    out = tl.load(block_ptr + t * stride_bt + h, mask=in_h, other=0.0).to(tl.float32)
    if SUM:  # block_out + block_out2, rounded as torch's add in the streams' dtype
        out = (out + tl.load(block2_ptr + t * stride_b2t + h, mask=in_h, other=0.0).to(tl.float32)).to(dtype)
        out = out.to(tl.float32)
    written = (post[:, None] * out[None, :]).to(dtype).to(tl.float32)
    new = written + mixed.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + k[:, None] * stride_on + h[None, :], new.to(dtype),
             mask=in_k[:, None] & in_h[None, :])


def _check_streams(streams: torch.Tensor) -> None:
    if streams.dim() != 3 or streams.stride(-1) != 1:
        raise ValueError(f"streams must be [T, N, H] with a contiguous last dim, got {tuple(streams.shape)} "
                         f"strides {streams.stride()}")


def deepseek_v4_hc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """See the module docstring: streams [T, N, H], fn [M, N*H] (any float dtype) -> the split-K
    partials of `F.linear(unweighted_rms_norm(streams.flatten(-2).float()), fn.float())`, [T, S, M]
    float32 (their sum over S is the linear map)."""
    _check_streams(streams)
    T, N, H = streams.shape
    if fn.dim() != 2 or fn.shape[1] != N * H or fn.stride(-1) != 1:
        raise ValueError(f"fn must be [M, {N * H}] with contiguous rows, got {tuple(fn.shape)}")
    rows = fn.shape[0]
    splits = triton.cdiv(N * H, _MIX_CHUNK)
    out = torch.empty(T, splits, rows, dtype=torch.float32, device=streams.device)
    if T:
        _hc_mix_kernel[(T, splits)](
            streams, fn, out, H, rows, float(norm_eps),
            streams.stride(0), streams.stride(1), fn.stride(0), out.stride(0), out.stride(1),
            N=N, CHUNK=_MIX_CHUNK, BLOCK_K=_MIX_BLOCK_K, BLOCK_M=triton.next_power_of_2(rows),
            STAT_K=min(triton.next_power_of_2(N * H), _MIX_STAT_K), num_warps=4)
    return out


def _mix_partials(mixes: torch.Tensor, T: int, width: int) -> torch.Tensor:
    """mixes [T, width] or split-K partials [T, S, width] (float32, contiguous rows) -> [T, S, width]."""
    parts = mixes[:, None] if mixes.dim() == 2 else mixes
    if parts.dim() != 3 or parts.shape[0] != T or parts.shape[2] != width or parts.dtype != torch.float32 \
            or parts.stride(-1) != 1 or parts.shape[1] < 1:
        raise ValueError(f"mixes must be float32 [{T}, {width}] or [{T}, S, {width}], got {mixes.dtype} "
                         f"{tuple(mixes.shape)}")
    return parts


def _collapse(streams: torch.Tensor, parts: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
              iters: int, full: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, N, H = streams.shape
    out = torch.empty(T, H, dtype=streams.dtype, device=streams.device)
    post = torch.empty(T, N if full else 0, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, N if full else 0, N if full else 0, dtype=torch.float32, device=streams.device)
    if T:
        _hc_pre_kernel[(T, triton.cdiv(H, _BLOCK_H))](
            streams, parts, base.contiguous(), scale.contiguous(), out, post, comb, H, hc_eps, parts.shape[1],
            streams.stride(0), streams.stride(1), parts.stride(0), parts.stride(1), out.stride(0),
            N=N, BLOCK_N=triton.next_power_of_2(N), ITERS=max(iters, 1), BLOCK_H=_BLOCK_H, FULL=full,
            BLOCK_S=triton.next_power_of_2(parts.shape[1]))
    return out, post, comb


def deepseek_v4_hc_pre(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                       hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring: (collapsed [T, H] in streams' dtype, post [T, N], comb [T, N, N] fp32).
    mixes: [T, (2+N)N], or `deepseek_v4_hc_mix`'s partials [T, S, (2+N)N]."""
    _check_streams(streams)
    T, N, _ = streams.shape
    parts = _mix_partials(mixes, T, (2 + N) * N)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    return _collapse(streams, parts, base, scale, hc_eps, iters, True)


def deepseek_v4_hc_head(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                        hc_eps: float) -> torch.Tensor:
    """`HyperHead`'s collapse: sum_n (sigmoid(mixes[n] * scale[0] + base[n]) + hc_eps) * streams[n]
    -> [T, H] in streams' dtype; mixes [T, N] or partials [T, S, N] of `deepseek_v4_hc_mix`."""
    _check_streams(streams)
    T, N, _ = streams.shape
    return _collapse(streams, _mix_partials(mixes, T, N), base, scale, hc_eps, 1, False)[0]


def deepseek_v4_hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                         comb: torch.Tensor, block_out2: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring: the new streams [T, N, H] (contiguous, streams' dtype). With
    `block_out2` [T, H] the block output is block_out + block_out2, rounded to the streams' dtype
    (the MoE's routed + shared sum: one launch fewer)."""
    _check_streams(streams)
    T, N, H = streams.shape
    for b in (block_out, block_out2):
        if b is not None and (b.shape != (T, H) or b.stride(-1) != 1):
            raise ValueError(f"block_out must be [{T}, {H}] with a contiguous last dim, got {tuple(b.shape)}")
    if post.shape != (T, N) or comb.shape != (T, N, N) or not (post.is_contiguous() and comb.is_contiguous()):
        raise ValueError(f"post / comb must be contiguous [{T}, {N}] / [{T}, {N}, {N}]")
    out = torch.empty(T, N, H, dtype=streams.dtype, device=streams.device)
    second = block_out if block_out2 is None else block_out2
    if T:
        _hc_merge_kernel[(T, triton.cdiv(H, _BLOCK_H))](
            streams, block_out, second, post, comb, out, H,
            streams.stride(0), streams.stride(1), block_out.stride(0), second.stride(0), out.stride(0), out.stride(1),
            N=N, BLOCK_N=triton.next_power_of_2(N), BLOCK_H=_BLOCK_H, SUM=block_out2 is not None)
    return out
