"""DeepSeek-V4's per-head norm + interleaved rotary tail for decode / verify steps, one launch where
the torch path (`apply_rope_tail` after `unweighted_rms_norm` or `RMSNorm` in
tandem/models/deepseek_v4_attention.py) is ~10-17 elementwise launches per call.

    deepseek_v4_rope_tail(x [T, Hh, D], cos [T, R / 2], sin [T, R / 2], norm=..., eps, inverse, pages, slots)
        -> out [T, Hh, D] in x's dtype

Per row (token t, head h), as the torch path rounds (float32 math, rounded to x's dtype where it
rounds):

    norm "unweighted" (the attention's q):  y = x * round(rsqrt(mean(x^2) + eps))
    norm = weight [D] (RMSNorm, kv_norm):   y = round(weight * round(x * rsqrt(mean(x^2) + eps)))
    norm None:                              y = x
    rotary on the trailing R channels, interleaved pairs (y0, y1), cos/sin of the token (in x's dtype):
        (y0 cos - y1 sin, y1 cos + y0 sin), in float32, then rounded     (`inverse`: sin negated,
                                                                           the output's rotation back)

The products and sums are kept apart (`enable_fp_fusion=False`: no fused multiply-add), as torch's
separate launches compute them, so every value but the norm's statistic (a float32 sum in another
order) is the torch path's bit for bit. `pages` / `slots`: the rows (one head) are also stored at
flat slot slots[t] of the paged K=V window ([.., D] rows, in the pages' dtype): the window write.

One program per (token, tile of BLOCK_H heads); CUDA-graph capturable (grid and tiles from T, Hh, D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NO_NORM, _WEIGHTED, _UNWEIGHTED = 0, 1, 2
_TILE = 2048  # elements a program holds: heads x padded head_dim


@triton.jit
def _rope_tail_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, page_ptr, slot_ptr,
    num_heads, eps, sin_sign,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    NORM: tl.constexpr, WRITE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    c = tl.arange(0, BLOCK_D)[None, :]  # [1, BD]
    in_c = c < HEAD_DIM
    mask = (h < num_heads) & in_c
    nope: tl.constexpr = HEAD_DIM - ROPE_DIM
    is_rope = (c >= nope) & in_c
    partner = tl.where(is_rope, c ^ 1, c)  # the other channel of its interleaved pair (nope is even)
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM == 1:
        r = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [BH, 1]
        w = tl.load(w_ptr + c, mask=in_c, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=in_c, other=0.0).to(tl.float32)
        y = ((x * r).to(dtype).to(tl.float32) * w).to(dtype)
        yp = ((xp * r).to(dtype).to(tl.float32) * wp).to(dtype)
    elif NORM == 2:
        r = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None].to(dtype).to(tl.float32)
        y = (x * r).to(dtype)
        yp = (xp * r).to(dtype)
    else:
        y = x.to(dtype)
        yp = xp.to(dtype)
    k = tl.where(is_rope, (c - nope) // 2, 0)
    cos = tl.load(cos_ptr + t * stride_ct + k, mask=is_rope, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + k, mask=is_rope, other=0.0).to(tl.float32) * sin_sign
    yf, ypf = y.to(tl.float32), yp.to(tl.float32)
    even = (c - nope) % 2 == 0
    rotated = tl.where(even, yf * cos - ypf * sin, yf * cos + ypf * sin)
    out = tl.where(is_rope, rotated.to(dtype), y)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + c, out, mask=mask)
    if WRITE:  # one head: row t also goes to its window slot
        slot = tl.load(slot_ptr + t).to(tl.int64)
        tl.store(page_ptr + slot * HEAD_DIM + c, out.to(page_ptr.dtype.element_ty), mask=mask)


def deepseek_v4_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                          norm: str | torch.Tensor | None = None, eps: float = 1e-6, inverse: bool = False,
                          pages: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. x [T, Hh, D]; cos, sin [T, R / 2] (R even, at
    most D, D - R even); norm: None, "unweighted" or an RMSNorm weight [D]; pages (one head: Hh = 1)
    any paged tensor whose last dim is D, contiguous, with slots [T] int: flat row indices into it."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, Hh, D], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, heads, head_dim = x.shape
    rope_dim = 2 * cos.shape[-1]
    if cos.shape != (T, rope_dim // 2) or sin.shape != cos.shape or rope_dim > head_dim or (head_dim - rope_dim) % 2:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit x {tuple(x.shape)} "
                         "(need [T, R / 2], R <= D, D - R even)")
    if isinstance(norm, torch.Tensor) and norm.shape != (head_dim,):
        raise ValueError(f"norm weight {tuple(norm.shape)} must be [{head_dim}]")
    if isinstance(norm, str) and norm != "unweighted":
        raise ValueError(f"norm must be None, 'unweighted' or a weight tensor, got {norm!r}")
    write = pages is not None
    if write and (slots is None or heads != 1 or pages.shape[-1] != head_dim or not pages.is_contiguous()):
        raise ValueError("the window write takes one head, contiguous pages of rows [.., D] and slots [T]")
    cos, sin = (v if v.stride(-1) == 1 else v.contiguous() for v in (cos, sin))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T == 0 or heads == 0:
        return out
    mode = _WEIGHTED if isinstance(norm, torch.Tensor) else _UNWEIGHTED if norm is not None else _NO_NORM
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(heads), _TILE // block_d))
    w = norm.contiguous() if mode == _WEIGHTED else cos  # any pointer when unused
    _rope_tail_kernel[(T, triton.cdiv(heads, block_h))](
        x, w, cos, sin, out, pages if write else out, slots if write else cos,
        heads, float(eps), -1.0 if inverse else 1.0,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, BLOCK_D=block_d, BLOCK_H=block_h, NORM=mode, WRITE=write,
        num_warps=4 if block_h * block_d >= 1024 else 1, enable_fp_fusion=False,
    )
    return out
