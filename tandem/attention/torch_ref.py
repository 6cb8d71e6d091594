"""Reference paged attention in plain torch: gather each request's K/V through its block table and
run SDPA. Correct on any device; the fast GPU kernels (a later issue) are tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.backend import register_attention_backend
from tandem.core import StepMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, Hkv, D]) into the paged cache ([2, N, bs, Hkv, D])."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, N*bs, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


@register_attention_backend("torch")
class TorchPagedAttention:
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        step: StepMetadata,
        group: int,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, step.slot_mappings[group])
        block_tables = step.block_tables[group]  # [B, max_blocks] int32
        bs = step.block_size
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        for i in range(step.num_requests):
            start, end = step.query_start_loc_cpu[i], step.query_start_loc_cpu[i + 1]
            seq_len = step.seq_lens_cpu[i]
            n_blocks = (seq_len + bs - 1) // bs
            blocks = block_tables[i, :n_blocks].long()
            keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, q.shape[2])[:seq_len]  # [S, Hkv, D]
            vals = kv_cache[1, blocks].reshape(-1, num_kv_heads, q.shape[2])[:seq_len]
            q_len = end - start
            # Query token j sits at position seq_len - q_len + j: it sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, S]
            qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            ki = keys.transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
            vi = vals.transpose(0, 1).to(q.dtype)
            if num_heads != num_kv_heads:
                rep = num_heads // num_kv_heads
                ki = ki.repeat_interleave(rep, dim=0)
                vi = vi.repeat_interleave(rep, dim=0)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start:end] = o.transpose(0, 1)
        return out
