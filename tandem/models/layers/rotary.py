"""Rotary position embedding, computed from each token's absolute position.

Positions come per token ([T] int64), so packed requests, chunked prefill and speculative verify
need no special casing. Supported rope types: "default", "linear" and "yarn" (Qwen3's long-context
setting). The config is read in both spellings found in the wild:

- transformers v5: `rope_parameters: {rope_type, rope_theta, factor, original_max_position_embeddings, ...}`
- older (real Qwen3 checkpoints): top-level `rope_theta` plus `rope_scaling: {type|rope_type, factor, ...}`
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.kernels import fused

ROPE_TYPES = ("default", "linear", "yarn")
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float = DEFAULT_THETA
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # yarn: the pretraining context length
    attention_factor: float | None = None  # yarn: cos/sin scale; None derives it from factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        """Read an HF config dict (either spelling). Raises ValueError for unsupported settings."""
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        theta = params.get("rope_theta", cfg.get("rope_theta")) or DEFAULT_THETA
        max_pos = cfg.get("max_position_embeddings")
        # A top-level original_max_position_embeddings wins (transformers does the same).
        orig = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        if rope_type == "yarn" and orig is None:
            orig = max_pos
        factor = params.get("factor")
        if factor is None:
            if rope_type == "yarn" and orig and max_pos:
                factor = max_pos / orig
            elif rope_type != "default":
                raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
            else:
                factor = 1.0
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor),
            original_max_position_embeddings=int(orig) if orig is not None else None,
            attention_factor=params.get("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] float32 on CPU, attention scaling applied to cos/sin)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # [dim/2]
    pos_freqs = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "linear":
        # Scaling positions by 1/factor equals scaling the frequencies.
        return 1.0 / pos_freqs / rope.factor, 1.0

    # YaRN: keep high-frequency dims as trained (extrapolate), interpolate low-frequency dims by
    # `factor`, with a linear ramp between the two measured in number of rotations over the
    # original context; cos/sin are scaled by an attention temperature.
    factor = rope.factor
    if rope.attention_factor is not None:
        attn_scale = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_scale = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_scale = _yarn_mscale(factor)
    orig = rope.original_max_position_embeddings
    assert orig is not None

    def dim_for_rotations(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_for_rotations(rope.beta_fast), dim_for_rotations(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # 1: keep the trained frequency, 0: fully interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, attn_scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> rotated q, k (neox / half-split layout)."""
    if fused.use_fused(q, k, cos, sin):
        return fused.rope(q, k, cos, sin)  # one launch; the code below is the reference
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """Owns the float32 `inv_freq` buffer (non-persistent: never in a checkpoint).

    The buffer is recomputed whenever the module is moved or materialised (`to`, `to_empty`),
    so it stays float32 and exact even after `model.to(torch.bfloat16)` or loading from meta.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        inv_freq, self.attention_scaling = compute_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] float32

    def reset_buffers(self) -> None:
        """Recompute `inv_freq` on its current device (after `to_empty` left it uninitialised)."""
        inv_freq, self.attention_scaling = compute_inv_freq(self.rope, self.head_dim)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        self.reset_buffers()
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, D] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2] float32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
