"""RMSNorm, with an optional fused residual add (the pre-norm decoder's hot pair)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import fused


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistics in float32.

    `forward(x)` returns the normed tensor. `forward(x, residual)` first adds the residual stream
    and returns `(normed, new_residual)` with `new_residual = x + residual`. On CUDA either runs as
    one fused Triton kernel (`tandem.kernels.fused`) unless fused ops are switched off; `_norm` and
    the add below are the reference.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply, as the reference implementation does.
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.use_fused(x, self.weight, *(() if residual is None else (residual,))):
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
