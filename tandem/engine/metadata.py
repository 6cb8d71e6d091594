"""Per-step metadata: one object built by the runner for each forward pass, read by attention,
sampling and (later) speculative verification. Nothing reads step state from globals."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupState:
    """A compressed cache group's per-request state for one step (host values, in request order;
    tandem/kv/manager.py says what each is): the state slot, the overlap snapshot to copy into the
    slot's ring before the step (-1: none) and the positional snapshot ids this step may write
    (snapshot i holds the overlap at token (i + 1) * `StepMetadata.prefix_unit`)."""

    slots: tuple[int, ...]
    restore: tuple[int, ...]
    snapshots: tuple[tuple[int, ...], ...]
    null_snapshot: int  # the id placeholders read as (row `num_snapshots`: never a real one)


@dataclass(frozen=True)
class StepMetadata:
    """The token layout of one step.

    Tokens of all scheduled requests are packed back to back: request i owns query tokens
    `query_start_loc[i]:query_start_loc[i+1]` (1 for decode, 1+K for speculative verify, a chunk for
    prefill). `seq_lens[i]` counts its tokens in the cache *after* this step's writes.
    """

    request_ids: tuple[str, ...]
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    block_tables: tuple[torch.Tensor, ...]  # per cache group: [B, max_blocks] int32, device
    slot_mappings: tuple[torch.Tensor, ...]  # per cache group: [T] int64, device (block*bs + offset)
    logits_indices: torch.Tensor  # [S] int64, device: token rows whose logits are sampled
    # Host copies: the torch reference attention loops over requests with these.
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    max_query_len: int  # longest query of the step; fixed (1+K) in a captured decode graph
    # Per cache group: its GroupState when the group is compressed, else None (empty: no such group).
    group_states: tuple[GroupState | None, ...] = ()
    prefix_unit: int = 0  # tokens between overlap snapshots (KVCacheManager.unit)
    # The same on the device, for sync-free (capturable) steps; per group, None unless compressed.
    # Pads of a graph point at the sinks (the state slot `num_state_slots`, the null snapshot).
    state_slots: tuple[torch.Tensor | None, ...] = ()  # [T] int64: each token's state slot
    request_state_slots: tuple[torch.Tensor | None, ...] = ()  # [B] int64
    snapshot_slots: tuple[torch.Tensor | None, ...] = ()  # [T] int64: the snapshot a token's window close writes
    restore_ids: tuple[torch.Tensor | None, ...] = ()  # [B] int64: the snapshot to restore first, -1 none

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
