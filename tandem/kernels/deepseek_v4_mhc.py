"""DeepSeek-V4's manifold-constrained hyper-connections (mHC) around a block, in two Triton kernels
for decode / verify steps, where the torch reference's Sinkhorn alone is ~120 launches of 4x4
tensors per block (20 iterations of sum, add, divide over rows and columns).

    deepseek_v4_hc_pre(streams [T, N, H], mixes [T, (2+N)N] fp32, base, scale [3], hc_eps, iters)
        -> (collapsed [T, H], post [T, N] fp32, comb [T, N, N] fp32)
    deepseek_v4_hc_merge(streams [T, N, H], block_out [T, H], post, comb) -> streams [T, N, H]

`mixes` is the linear map of the RMS-normed flattened streams (`HyperConnection.fn`, one cuBLAS
call: it reads the [(2+N)N, N*H] weight, which only a wide GEMV reads at bandwidth). From it, per
token, as `HyperConnection.forward` in tandem/models/deepseek_v4.py (float32 throughout):

    pre_n  = sigmoid(mixes[n] * scale[0] + base[n]) + hc_eps                        n < N
    post_n = 2 * sigmoid(mixes[N + n] * scale[1] + base[N + n])
    comb   = sinkhorn(mixes[2N:] * scale[2] + base[2N:] as [N, N], iters, hc_eps)
    collapsed[h] = sum_n pre_n * streams[n, h]                                      (to streams' dtype)

and `HyperConnection.merge`, with the reference's roundings to the streams' dtype (comb and post
rounded first, the stream mix accumulated in float32 and rounded, then each sum):

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


@triton.jit
def _hc_pre_kernel(
    streams_ptr, mixes_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr,
    hidden, hc_eps,
    stride_st, stride_sn, stride_mt, stride_ot,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ITERS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = h < hidden
    mix = mixes_ptr + t * stride_mt
    s_pre = tl.load(scale_ptr).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n in tl.static_range(N):
        pre = tl.sigmoid(tl.load(mix + n) * s_pre + tl.load(base_ptr + n).to(tl.float32)) + hc_eps
        x = tl.load(streams_ptr + t * stride_st + n * stride_sn + h, mask=in_h, other=0.0).to(tl.float32)
        acc += pre * x
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=in_h)
    if tl.program_id(1) == 0:
        j = tl.arange(0, BLOCK_N)
        in_n = j < N
        s_post = tl.load(scale_ptr + 1).to(tl.float32)
        post_x = tl.load(mix + N + j, mask=in_n, other=0.0) * s_post + tl.load(base_ptr + N + j, mask=in_n, other=0.0)
        tl.store(post_ptr + t * N + j, 2.0 * tl.sigmoid(post_x), mask=in_n)
        # The Sinkhorn projection of the [N, N] mixing logits; padded lanes hold 0 after every pass.
        rows, cols = j[:, None], j[None, :]
        valid = (rows < N) & (cols < N)
        s_comb = tl.load(scale_ptr + 2).to(tl.float32)
        at = 2 * N + rows * N + cols
        logits = tl.load(mix + at, mask=valid, other=0.0) * s_comb + tl.load(base_ptr + at, mask=valid, other=0.0)
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
    streams_ptr, block_ptr, post_ptr, comb_ptr, out_ptr,
    hidden,
    stride_st, stride_sn, stride_bt, stride_ot, stride_on,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
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
    written = (post[:, None] * out[None, :]).to(dtype).to(tl.float32)
    new = written + mixed.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + k[:, None] * stride_on + h[None, :], new.to(dtype),
             mask=in_k[:, None] & in_h[None, :])


def _check_streams(streams: torch.Tensor) -> None:
    if streams.dim() != 3 or streams.stride(-1) != 1:
        raise ValueError(f"streams must be [T, N, H] with a contiguous last dim, got {tuple(streams.shape)} "
                         f"strides {streams.stride()}")


def deepseek_v4_hc_pre(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                       hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring: (collapsed [T, H] in streams' dtype, post [T, N], comb [T, N, N] fp32)."""
    _check_streams(streams)
    T, N, H = streams.shape
    if mixes.shape != (T, (2 + N) * N) or mixes.dtype != torch.float32 or mixes.stride(-1) != 1:
        raise ValueError(f"mixes must be float32 [{T}, {(2 + N) * N}], got {mixes.dtype} {tuple(mixes.shape)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    out = torch.empty(T, H, dtype=streams.dtype, device=streams.device)
    post = torch.empty(T, N, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, N, N, dtype=torch.float32, device=streams.device)
    if T:
        _hc_pre_kernel[(T, triton.cdiv(H, _BLOCK_H))](
            streams, mixes, base.contiguous(), scale.contiguous(), out, post, comb, H, hc_eps,
            streams.stride(0), streams.stride(1), mixes.stride(0), out.stride(0),
            N=N, BLOCK_N=triton.next_power_of_2(N), ITERS=iters, BLOCK_H=_BLOCK_H)
    return out, post, comb


def deepseek_v4_hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                         comb: torch.Tensor) -> torch.Tensor:
    """See the module docstring: the new streams [T, N, H] (contiguous, streams' dtype)."""
    _check_streams(streams)
    T, N, H = streams.shape
    if block_out.shape != (T, H) or block_out.stride(-1) != 1:
        raise ValueError(f"block_out must be [{T}, {H}] with a contiguous last dim, got {tuple(block_out.shape)}")
    if post.shape != (T, N) or comb.shape != (T, N, N) or not (post.is_contiguous() and comb.is_contiguous()):
        raise ValueError(f"post / comb must be contiguous [{T}, {N}] / [{T}, {N}, {N}]")
    out = torch.empty(T, N, H, dtype=streams.dtype, device=streams.device)
    if T:
        _hc_merge_kernel[(T, triton.cdiv(H, _BLOCK_H))](
            streams, block_out, post, comb, out, H,
            streams.stride(0), streams.stride(1), block_out.stride(0), out.stride(0), out.stride(1),
            N=N, BLOCK_N=triton.next_power_of_2(N), BLOCK_H=_BLOCK_H)
    return out
