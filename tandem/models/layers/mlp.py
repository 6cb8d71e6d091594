"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import fused


def check_activation(name: str) -> None:
    if name != "silu":
        raise ValueError(f"hidden_act {name!r} is not supported; only 'silu' (SwiGLU) is")


class SwiGLUMLP(nn.Module):
    """Parameter names gate_proj / up_proj / down_proj match HF checkpoints."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        check_activation(hidden_act)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_proj(x), self.up_proj(x)  # [T, I] each
        if fused.use_fused(gate, up):
            return self.down_proj(fused.silu_mul_split(gate, up))  # one launch instead of two
        return self.down_proj(F.silu(gate) * up)
