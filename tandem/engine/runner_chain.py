"""The model runner's chained decode steps: forwards of one query token per request, each fed the
tokens the caller picked, on the device, from the previous forward's logits, with nothing read back
to the host in between. A draft model's K draft steps run this way (tandem/spec/draft_model.py):
staged once, then one replay (or eager forward) per draft token and a few device ops between them,
where each step used to pay the host's scheduling and a device sync. A mixin of `ModelRunner`,
like runner_ahead.py, whose static inputs and graphs it shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.static_inputs import host_to_device

# pick(j, logits [n, V]) -> the [n] int64 tokens forward j + 1 is fed (device; rows whose request
# took no part in forward j are the caller's to ignore).
Pick = Callable[[int, torch.Tensor], torch.Tensor]


class ChainRunning:
    """`ModelRunner`'s chained steps (see the module docstring)."""

    def can_chain(self) -> bool:
        """Whether this runner's caches take chained steps: their slots follow from a position and
        the block table alone (full and sliding-window groups; not a compressed group's entries)."""
        return all(g.spec.kind != "compressed" for g in self.kv.groups)

    @torch.inference_mode()
    def execute_chain(self, batch: list[ScheduledRequest], first: torch.Tensor, lives: Sequence[int],
                      pick: Pick) -> str:
        """Run max(lives) forwards of one query token per request; returns how they ran
        (`ForwardOutput.mode`: "cuda_graph" or "eager").

        `batch[i]` is request i's first forward (one query token at `start`, sampling; its slots
        for `lives[i]` tokens from there already allocated), fed `first[i]` ([n] int64, device).
        Request i takes part in its first `lives[i]` >= 1 forwards, each one position on, writing
        its K/V; after that its row runs on writing to the sink, its logits unused. After forward j
        `pick(j, logits)` gives the next forward's tokens; it is called after the last one too."""
        if not self.can_chain():
            raise ValueError("chained steps need caches whose slots follow from the position (no compressed group)")
        n, steps = len(batch), max(lives)
        if n == 0 or min(lives) < 1 or any(s.num_tokens != 1 or not s.samples for s in batch):
            raise ValueError("a chain needs requests of one sampling query token each and lives >= 1")
        live = host_to_device(list(lives), torch.int64, self.device)
        bucket = next((b for b in self.buckets if b >= n and (b, 1) in self.graphs), None)
        if bucket is None:
            if self.graphs:
                self._warn_fallback(batch)
            return self._chain_eagerly(batch, first, lives, live, pick)
        self._stage_inputs(batch, bucket, 1)
        entry, tokens = self.graphs[(bucket, 1)], first
        for j in range(steps):
            if j:
                self._advance(j, live, self._pos[:n], self._seq[:n], [s[:n] for s in self._slots],
                              [t[:n] for t in self._tables])
            self._ids[:n].copy_(tokens)
            entry.graph.replay()
            tokens = pick(j, entry.logits[:n])
        return "cuda_graph"

    def _chain_eagerly(self, batch: list[ScheduledRequest], first: torch.Tensor, lives: Sequence[int],
                       live: torch.Tensor, pick: Pick) -> str:
        """execute_chain without a graph: the step's tensors from `build_step`, moved on in place
        (the host copy of the sequence lengths, which the reference attention reads, alongside)."""
        ids, positions, step = self.build_step(batch)
        seq_cpu, tokens = list(step.seq_lens_cpu), first
        for j in range(max(lives)):
            if j:
                self._advance(j, live, positions, step.seq_lens, list(step.slot_mappings), list(step.block_tables))
                seq_cpu = [length + (life > j) for length, life in zip(seq_cpu, lives)]
                step = dataclasses.replace(step, seq_lens_cpu=tuple(seq_cpu))
            ids.copy_(tokens)
            hidden, _ = self._forward(ids, positions, step)
            tokens = pick(j, self.model.compute_logits(hidden[step.logits_indices]))
        return "eager"

    def _advance(self, j: int, live: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor,
                 slots: list[torch.Tensor], tables: list[torch.Tensor]) -> None:
        """Move the one-token queries of [n] rows to forward j: a row still live (live > j) goes
        one position on and writes its K/V at the slot its block table gives that position; a row
        past its life stays where it is and writes to the sink."""
        bs, on = self.block_size, live > j
        pos += on
        seq += on.to(seq.dtype)
        for g, (slot, table) in enumerate(zip(slots, tables)):
            blocks = table.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).to(torch.int64)
            slot.copy_(torch.where(on, blocks * bs + pos % bs, self.kv.null_block(g) * bs))
