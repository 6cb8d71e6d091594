"""Reference paged attention in plain torch: gather each request's K/V through its block table and
run SDPA. Correct on any device; the fast GPU kernels (a later issue) are tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.backend import check_kv_scales, register_attention_backend
from tandem.core import StepMetadata
from tandem.kv.tensors import quantize_fp8


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Scatter this step's K/V ([T, Hkv, D]) into the paged cache ([2, N, bs, Hkv, D]); with
    `kv_scales` ([2, N, bs, Hkv]) quantized to fp8, each (token, head) vector with its scale."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, N*bs, Hkv, D]
    if kv_scales is None:
        flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    flat_scales = kv_scales.view(2, -1, kv_scales.shape[-1])  # [2, N*bs, Hkv]
    for i, x in enumerate((k, v)):
        stored, scale = quantize_fp8(x)  # [T, Hkv, D], [T, Hkv]
        # Through uint8 views: index_copy_ has no fp8 kernel.
        flat[i].view(torch.uint8).index_copy_(0, slot_mapping, stored.view(torch.uint8))
        flat_scales[i].index_copy_(0, slot_mapping, scale)


def _gather(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, i: int, blocks: torch.Tensor, seq_len: int,
            dtype: torch.dtype) -> torch.Tensor:
    """K (i = 0) or V (i = 1) of one request's first seq_len positions -> [S, Hkv, D] in `dtype`."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    if kv_scales is None:
        x = kv_cache[i, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        return x.to(dtype)
    x = kv_cache[i].view(torch.uint8)[blocks].view(kv_cache.dtype)  # fp8 has no indexing kernel everywhere
    x = x.reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    return (x * kv_scales[i, blocks].reshape(-1, num_kv_heads)[:seq_len, :, None]).to(dtype)


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
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_kv_scales(kv_cache, kv_scales)
        write_kv(k, v, kv_cache, step.slot_mappings[group], kv_scales)
        block_tables = step.block_tables[group]  # [B, max_blocks] int32
        bs = step.block_size
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        for i in range(step.num_requests):
            start, end = step.query_start_loc_cpu[i], step.query_start_loc_cpu[i + 1]
            seq_len = step.seq_lens_cpu[i]
            n_blocks = (seq_len + bs - 1) // bs
            blocks = block_tables[i, :n_blocks].long()
            keys = _gather(kv_cache, kv_scales, 0, blocks, seq_len, q.dtype)  # [S, Hkv, D]
            vals = _gather(kv_cache, kv_scales, 1, blocks, seq_len, q.dtype)
            q_len = end - start
            # Query token j sits at position seq_len - q_len + j: it sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, S]
            qi = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            ki = keys.transpose(0, 1)  # [Hkv, S, D]
            vi = vals.transpose(0, 1)
            if num_heads != num_kv_heads:
                rep = num_heads // num_kv_heads
                ki = ki.repeat_interleave(rep, dim=0)
                vi = vi.repeat_interleave(rep, dim=0)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start:end] = o.transpose(0, 1)
        return out
