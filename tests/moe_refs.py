"""References shared by the MoE kernel tests."""

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers.mlp import SwiGLUMLP


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


def make_experts(num: int = 8, hidden: int = 64, inter: int = 32, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0, std: float = 0.1) -> nn.ModuleList:
    """`num` random SwiGLU experts (weights ~ N(0, std)), frozen."""
    torch.manual_seed(seed)
    with torch.device(device):
        experts = nn.ModuleList(SwiGLUMLP(hidden, inter) for _ in range(num))
    experts.to(dtype).requires_grad_(False)
    for p in experts.parameters():
        p.normal_(0.0, std)
    return experts


def make_clamped_experts(limit: float, num: int = 8, hidden: int = 64, inter: int = 32, seed: int = 0,
                         std: float = 0.3) -> nn.ModuleList:
    """`num` random DeepSeek-V4 experts (SwiGLU with clamped pre-activations), fp32; std wide enough
    that `limit` bites on many rows."""
    from tandem.models.deepseek_v4_moe import ClampedSwiGLU

    torch.manual_seed(seed)
    experts = nn.ModuleList(ClampedSwiGLU(hidden, inter, limit) for _ in range(num)).requires_grad_(False)
    for p in experts.parameters():
        p.normal_(0.0, std)
    return experts
