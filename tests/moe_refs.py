"""References shared by the MoE kernel tests."""

import torch
import torch.nn.functional as F
from torch import nn


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def dense_reference(experts: nn.ModuleList, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ground truth: each token through each of its k experts, weighted and summed."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            mlp = experts[int(ids[t, j])]
            gate, up = xf[t] @ mlp.gate_proj.weight.float().T, xf[t] @ mlp.up_proj.weight.float().T
            out[t] += w[t, j].float() * ((F.silu(gate) * up) @ mlp.down_proj.weight.float().T)
    return out
