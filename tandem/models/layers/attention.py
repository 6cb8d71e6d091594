"""GQA self-attention over the paged KV cache: q/k/v projections, per-head q/k RMSNorm (Qwen3),
rotary, then the attention backend, which writes this step's K/V and attends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention import get_attention_backend
from tandem.attention.backend import AttentionBackend
from tandem.core import StepMetadata
from tandem.kernels import fused
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import apply_rotary
from tandem.models.layers.stacking import Stacked, stack_linears


class Attention(nn.Module):
    """Parameter names (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm) match HF checkpoints.

    The KV cache is not a parameter or buffer: the runner binds it after allocation through
    `bind_kv_cache`, so it never appears in `state_dict()` and survives `to_empty`. fp8 pages are
    bound with their scales (`LayerCache.scales`), which the backend reads and writes beside them.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        qk_norm: bool = True,
        rms_norm_eps: float = 1e-6,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.backend: AttentionBackend = get_attention_backend(backend)
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D]
        self.kv_scales: torch.Tensor | None = None  # fp8 pages: [2, num_blocks, block_size, Hkv] float32
        self.cache_group = 0
        # After `stack_qkv`: (weight [q + 2 kv, H], bias or None) that q/k/v_proj's tensors are views of.
        self._qkv: Stacked | None = None

    def bind_kv_cache(self, cache: torch.Tensor, group: int, scales: torch.Tensor | None = None) -> None:
        self.kv_cache = cache
        self.kv_scales = scales
        self.cache_group = group

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def stack_qkv(self) -> None:
        """q, k and v in one GEMM (tandem/models/layers/stacking.py): q_proj/k_proj/v_proj's
        weights and biases become views of one stack. Idempotent."""
        self._qkv = stack_linears((self.q_proj, self.k_proj, self.v_proj), self._qkv)

    def unstack_qkv(self) -> None:
        """Three GEMMs again (the weights stay views of the stack): the A/B of `stack_qkv`
        (`bench_gpu.py --compare-stacked`); a graph captured before keeps the path it holds."""
        self._qkv = None

    def _project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> q [T, Hq, D], k and v [T, Hkv, D] (views of one GEMM's output after
        `stack_qkv`: every kernel downstream takes their row stride)."""
        T = hidden.shape[0]
        if self._qkv is None:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        else:
            q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = F.linear(hidden, *self._qkv).split((q_rows, kv_rows, kv_rows), dim=-1)
        return (q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim))

    def _norm_rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k RMSNorm (Qwen3), then rotary. On CUDA one fused launch for all of it."""
        if self.q_norm is None:
            return apply_rotary(q, k, cos, sin)
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if self.q_norm.eps == self.k_norm.eps and fused.use_fused(q, k, cos, sin, qw, kw):
            return fused.qk_norm_rope(q, k, qw, kw, cos, sin, self.q_norm.eps)
        return apply_rotary(self.q_norm(q), self.k_norm(k), cos, sin)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepMetadata
    ) -> torch.Tensor:
        """hidden [T, H], cos/sin [T, D] -> [T, H]."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache; call model.bind_kv_caches() first")
        T = hidden.shape[0]
        q, k, v = self._project_qkv(hidden)
        q, k = self._norm_rope(q, k, cos, sin)
        out = self.backend.forward(q, k, v, self.kv_cache, step, self.cache_group, self.scale,
                                   kv_scales=self.kv_scales)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))
