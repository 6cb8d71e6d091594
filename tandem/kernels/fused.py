"""Fused Triton kernels for the small per-layer ops of a decoder step, plus the switch that picks them.

At batch-1 decode these ops (RMSNorm, residual add, per-head q/k RMSNorm, rotary, SiLU*up) are
dozens of 1-2 us elementwise/reduce kernels per layer, bound by launch latency even inside a CUDA
graph. Each op here is one launch:

- `rms_norm(x, w, eps)` and `add_rms_norm(x, residual, w, eps) -> (normed, x + residual)`
- `qk_norm_rope(q, k, q_w, k_w, cos, sin, eps) -> (q, k)`: per-head RMSNorm then rotary (rotate-half
  layout) for q and k in one launch; `q_w = k_w = None` skips the norm (rotary only)
- `silu_mul(gate_up) -> silu(gate) * up` and `silu_mul_split(gate, up)`

Every kernel repeats its torch reference's rounding steps (the reference casts to the model dtype
between some ops, e.g. RMSNorm casts before the weight multiply), so bf16 results equal the torch
path bit for bit except where the float32 statistics round differently (reduction order, rsqrt, exp):
then they are within one bf16 ulp. Math is float32; outputs have the input dtype.

The layers call these only when `use_fused(...)` says so: a CUDA tensor, matching dtypes, Triton
importable and the process-wide setting on (`set_fused_ops`, default on). The torch code in the
layers stays the reference and the CPU path. All wrappers launch on fixed grids from host ints and
never read device values, so they are CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterator

import torch

# `triton.language`, bound by `_triton()` on first use; the kernel bodies below read it when they
# are jitted (their annotations are strings, so defining them needs no Triton). Importing the layers
# must not import Triton: the interpreter (TRITON_INTERPRET=1) is chosen when Triton is imported.
tl = None

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class FusedOps:
    """The process-wide setting. `enabled` only matters for CUDA tensors; CPU always runs torch.
    On by default, as `RunnerConfig.fused_ops`; the engine sets it from its config."""

    enabled: bool = True


_SETTINGS = FusedOps()


def set_fused_ops(enabled: bool) -> None:
    """Turn the fused kernels on or off for every layer (`--no-fused-ops` turns them off).

    Set it before CUDA graphs are captured: a captured graph keeps the kernels it recorded."""
    _SETTINGS.enabled = bool(enabled)


def fused_ops_enabled() -> bool:
    return _SETTINGS.enabled


@contextmanager
def fused_ops(enabled: bool) -> Iterator[None]:
    """Scoped override of the setting (tests, A/B runs); restores the previous value."""
    previous = _SETTINGS.enabled
    _SETTINGS.enabled = bool(enabled)
    try:
        yield
    finally:
        _SETTINGS.enabled = previous


def use_fused(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether a layer should call the fused op for these operands: x on CUDA, the setting on,
    Triton present, and every operand in x's (float) dtype — with mixed dtypes the torch reference
    promotes, which the kernels do not replicate. Host-side checks only (no sync)."""
    if not (x.is_cuda and _SETTINGS.enabled and x.dtype in SUPPORTED_DTYPES):
        return False
    return all(t.dtype == x.dtype for t in others) and _triton() is not None


@functools.cache
def _triton() -> ModuleType | None:
    """Import Triton once, on first use; None where it is not installed (the torch path runs)."""
    global tl
    try:
        import triton
        import triton.language
    except ImportError:
        return None
    tl = triton.language
    return triton


@functools.cache
def _jit(fn: Callable) -> Callable:
    """The jitted kernel for `fn` (one per function, made on its first launch)."""
    triton = _triton()
    if triton is None:
        raise RuntimeError("the fused kernels need Triton, which failed to import; install triton "
                           "or turn fused ops off (set_fused_ops(False) / --no-fused-ops)")
    return triton.jit(fn)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


# --- RMSNorm, optionally with the residual add -------------------------------------------------


def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  # x, residual [T, N]; w [N]; out, res_out [T, N]
    stride_x, stride_res, stride_out, stride_res_out,  # row strides (columns are contiguous)
    N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """One program per row: [res_out = x + res;] out = w * cast(x * rsqrt(mean(x^2) + eps))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # torch's add rounds to the model dtype
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    # The reference casts to the model dtype before the weight multiply; so do we.
    y = (xf * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (y * w).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] with contiguous columns (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _rms_norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({n},)")
    x2 = _rows(x)  # [R, N]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        res2 = _rows(residual)
        res_out = torch.empty_like(out)
    rows = x2.shape[0]
    if rows:
        block = _next_pow2(n)
        _jit(_rms_norm_kernel)[(rows,)](
            x2, res2 if res2 is not None else x2, weight.contiguous(), out, res_out if res_out is not None else out,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            n, float(eps),
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_num_warps(block),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if res_out is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> RMSNorm(x) [..., N] in x's dtype (same contract as layers.norm.RMSNorm)."""
    return _rms_norm_launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N] -> (RMSNorm(x + residual), x + residual), one launch."""
    out, res = _rms_norm_launch(x, residual, weight, eps)
    return out, res


# --- per-head q/k RMSNorm + rotary -------------------------------------------------------------


def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,  # q/k [T, H, D]; w [D]; cos/sin [T, D]
    HQ, HKV,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_ct, stride_st, eps,
    D: tl.constexpr, HALF_P: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
):
    """Grid (T, cdiv(HQ + HKV, BLOCK_H)): heads 0..HQ-1 are q's, HQ..HQ+HKV-1 are k's; a block may
    hold both (each row loads from and stores to its own tensor under a mask, so no branches).

    Optional RMSNorm over D, then rotate-half rotary. Rounds to the model dtype exactly where the
    torch path does: after the norm's scaling, after the weight multiply, after x*cos and
    rotate_half(x)*sin, and after their sum."""
    HALF: tl.constexpr = D // 2
    dtype = qo_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1] head over q then k
    d = tl.arange(0, HALF_P)[None, :]  # [1, HALF_P]
    dmask = d < HALF
    is_q = h < HQ
    q_mask = is_q & dmask
    k_mask = (h >= HQ) & (h < HQ + HKV) & dmask
    q_src = q_ptr + t * stride_qt + h * stride_qh + d
    k_src = k_ptr + t * stride_kt + (h - HQ) * stride_kh + d
    # Exactly one of each pair of loads is live per row; the other reads nothing and adds 0.
    x1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32) + tl.load(k_src, mask=k_mask, other=0.0).to(tl.float32)
    x2 = (tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
          + tl.load(k_src + HALF, mask=k_mask, other=0.0).to(tl.float32))
    if NORM:
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]  # [BH, 1]
        w1 = tl.where(is_q, tl.load(qw_ptr + d, mask=dmask, other=0.0), tl.load(kw_ptr + d, mask=dmask, other=0.0))
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d, mask=dmask, other=0.0),
                      tl.load(kw_ptr + HALF + d, mask=dmask, other=0.0))
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): out1 = x1*c1 - x2*s1, out2 = x2*c2 + x1*s2
    o1 = ((x1 * c1).to(dtype).to(tl.float32) + (-(x2 * s1)).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    q_dst = qo_ptr + t * stride_qot + h * stride_qoh + d
    k_dst = ko_ptr + t * stride_kot + (h - HQ) * stride_koh + d
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + HALF, o2, mask=q_mask)
    tl.store(k_dst, o1, mask=k_mask)
    tl.store(k_dst + HALF, o2, mask=k_mask)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_w: torch.Tensor | None,
    k_w: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], q_w/k_w [D] (both None: rotary only), cos/sin [T, D]
    -> new (q, k): `apply_rotary(RMSNorm_q(q), RMSNorm_k(k), cos, sin)` in one launch."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (T, hkv, d) or cos.shape != (T, d) or sin.shape != (T, d) or d % 2:
        raise ValueError(f"qk_norm_rope: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} cos {tuple(cos.shape)} "
                         f"sin {tuple(sin.shape)} (need q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D], even D)")
    norm = q_w is not None
    if norm != (k_w is not None):
        raise ValueError("qk_norm_rope: pass both q_w and k_w, or neither")
    q, k, cos, sin = _heads(q), _heads(k), _heads(cos), _heads(sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if T == 0:
        return q_out, k_out
    block_h = min(4, _next_pow2(hq + hkv))
    grid = (T, _cdiv(hq + hkv, block_h))
    qw = q_w.contiguous() if norm else cos  # any pointer: unused without NORM
    kw = k_w.contiguous() if norm else cos
    _jit(_qk_norm_rope_kernel)[grid](
        q, k, q_out, k_out, qw, kw, cos, sin,
        hq, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), float(eps),
        D=d, HALF_P=_next_pow2(d // 2), BLOCK_H=block_h, NORM=norm, num_warps=1 if d <= 128 else 2,
    )  # fmt: skip
    return q_out, k_out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary only: same contract as layers.rotary.apply_rotary."""
    return qk_norm_rope(q, k, None, None, cos, sin)


# --- SiLU(gate) * up ---------------------------------------------------------------------------

_SILU_BLOCK = 1024


def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr,  # gate, up, out [T, I] (columns contiguous)
    stride_g, stride_u, stride_o, I,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): out = cast(silu(gate)) * up, rounding like F.silu(g) * u."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu returns the model dtype
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(dtype), mask=mask)


def silu_mul_split(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] in one launch."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    inter = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)  # [R, I]
    if g2.shape[0] and inter:
        block = min(_SILU_BLOCK, _next_pow2(inter))
        grid = (g2.shape[0], _cdiv(inter, block))
        _jit(_silu_mul_kernel)[grid](g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), inter,
                               BLOCK=block, num_warps=_num_warps(block))
    return out.view(gate.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate columns first, then up, as the MoE's stacked w13) -> [..., I]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: last dim {gate_up.shape[-1]} is odd; expected [..., 2I]")
    inter = gate_up.shape[-1] // 2
    x = _rows(gate_up)  # [R, 2I]: the two halves are strided views, no copy
    return silu_mul_split(x[:, :inter], x[:, inter:]).view(*gate_up.shape[:-1], inter)
