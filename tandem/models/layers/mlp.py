"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import fused
from tandem.models.layers.stacking import Stacked, stack_linears


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
        self._gate_up: Stacked | None = None  # after `stack_gate_up`: ([2I, H] gate rows then up rows, None)

    def stack_gate_up(self) -> None:
        """gate and up in one GEMM (tandem/models/layers/stacking.py; a dense layer's, e.g. a draft
        model's): gate_proj/up_proj's weights become views of one [2I, H] stack. Idempotent. Not
        for a MoE's experts: their executor stacks them its own way (tandem/kernels/moe_grouped.py)."""
        self._gate_up = stack_linears((self.gate_proj, self.up_proj), self._gate_up)

    def unstack_gate_up(self) -> None:
        """Two GEMMs again (the weights stay views of the stack): the A/B of `stack_gate_up`
        (`bench_gpu.py --compare-stacked`)."""
        self._gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self._gate_up is not None:
            gate_up = F.linear(x, *self._gate_up)  # [T, 2I]
            if fused.use_fused(gate_up):
                return self.down_proj(fused.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = self.gate_proj(x), self.up_proj(x)  # [T, I] each
        if fused.use_fused(gate, up):
            return self.down_proj(fused.silu_mul_split(gate, up))  # one launch instead of two
        return self.down_proj(F.silu(gate) * up)
