"""Model runner: owns the device-side KV cache tensors and turns a scheduled batch into one forward
pass (eager in this version; CUDA graphs keyed by (batch bucket, tokens per sequence) come next)."""

from __future__ import annotations

import logging

import torch

from tandem.engine.metadata import StepMetadata
from tandem.engine.scheduler import ScheduledRequest
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import CacheGroup
from tandem.models.base import CausalLM

logger = logging.getLogger("tandem")


def allocate_kv_caches(
    model: CausalLM, groups: tuple[CacheGroup, ...], num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, Hkv, D] tensor per attention layer, bound to the model."""
    specs = model.kv_cache_specs()
    caches: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    layer_group = [0] * len(specs)
    for g, group in enumerate(groups):
        for layer in group.layer_indices:
            s = specs[layer]
            caches[layer] = torch.zeros(2, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)
            layer_group[layer] = g
    model.bind_kv_caches(caches, layer_group)
    return caches


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCacheManager, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size

    def build_step(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """Pack the batch's tokens; returns input_ids [T], positions [T] and the step metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        n_groups = len(self.kv.groups)
        slots: list[list[int]] = [[] for _ in range(n_groups)]
        tables: list[list[list[int]]] = [[] for _ in range(n_groups)]
        for s in batch:
            req = s.request
            start, end = s.start, s.start + s.num_tokens
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            for g in range(n_groups):
                ids = self.kv.block_ids(req.request_id, g)
                tables[g].append(ids)
                slots[g].extend(ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + s.num_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_indices.append(query_start[-1] - 1)

        def dev(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        block_tables = []
        for g in range(n_groups):
            width = max(len(t) for t in tables[g])
            padded = [t + [0] * (width - len(t)) for t in tables[g]]
            block_tables.append(dev(padded, torch.int32).view(len(batch), width))
        step = StepMetadata(
            request_ids=tuple(s.request.request_id for s in batch),
            query_start_loc=dev(query_start, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_tables=tuple(block_tables),
            slot_mappings=tuple(dev(sl, torch.int64) for sl in slots),
            logits_indices=dev(logits_indices, torch.int64),
            query_start_loc_cpu=tuple(query_start),
            seq_lens_cpu=tuple(seq_lens),
            block_size=bs,
        )
        return dev(input_ids, torch.int64), dev(positions, torch.int64), step

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Run one forward pass; returns logits [S, V] float32 for the requests that sample, in
        batch order."""
        input_ids, positions, step = self.build_step(batch)
        hidden = self.model(input_ids, positions, step)  # [T, H]
        return self.model.compute_logits(hidden[step.logits_indices])  # [S, V]
