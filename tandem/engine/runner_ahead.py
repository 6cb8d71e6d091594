"""The model runner's speculative steps ahead (tandem/engine/spec_ahead.py): the inputs they read,
the hooks that run around the target's forward, and the runner's side (staging, the shift on the
device, the graphs, the eager fallback). A mixin of `ModelRunner`, whose static inputs and
graphs it shares; split from runner.py by responsibility."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.core import StepMetadata
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.static_inputs import host_to_device

logger = logging.getLogger("tandem")

# The sampled steps ahead are captured for batch buckets whose [bucket * q, V] float32 sampling
# intermediates stay within this (each; the graph pool keeps them).
SAMPLED_AHEAD_ROW_BYTES = 256 << 20
# A speculative step ahead's per-request inputs (execute_ahead): name -> (dtype, a padded row's
# value; "pick" pads with the hooks' zero_row). start, ks (K_i), slot (the DSpark ring slot),
# pick (the row of the predecessor's results); the sampler's temp, topk, topp, minp and greedy.
AHEAD_FIELDS: dict[str, tuple[torch.dtype, float]] = {
    "start": (torch.int64, 0), "ks": (torch.int64, 0), "slot": (torch.int64, 0), "pick": (torch.int64, 0),
    "temp": (torch.float32, 1.0), "topk": (torch.int64, 0), "topp": (torch.float32, 1.0),
    "minp": (torch.float32, 0.0), "greedy": (torch.int64, 1)}


@dataclass
class AheadInputs:
    """What `AheadHooks.before` gives the target's forward of a step ahead ([N] rows)."""

    shift: torch.Tensor  # what the predecessor accepted: the query moves this many positions on
    known: torch.Tensor  # the first query token (the predecessor's last)
    base: torch.Tensor  # the first query position
    drafts: torch.Tensor | None  # [N, depth] (None: no drafter this step)
    draft_probs: torch.Tensor | None = None  # [N, depth, V] the q they were drawn from (sampled steps)


class AheadHooks(Protocol):
    """What a speculative step ahead (tandem/engine/spec_ahead.py) runs around the target's forward,
    device ops only (a graph captures them). `meta` holds the AHEAD_FIELDS, [N] each."""

    zero_row: int  # the row of its results that holds a shift of 0 (padding picks it)
    sampled_ahead: bool  # whether sampled requests' steps go ahead (False once their capture failed)

    def depth(self, q: int) -> int:
        """The drafter's block depth for a step of q query tokens per request (0: no drafts)."""
        ...

    def before(self, meta: dict[str, torch.Tensor], depth: int, sampled: bool) -> AheadInputs: ...

    def after(self, q: int, logits: torch.Tensor, aux: torch.Tensor | None, inputs: AheadInputs,
              meta: dict[str, torch.Tensor], sampled: bool) -> None:
        """Accept on the padded rows (logits [N * q, V], aux alike) and keep the results."""
        ...


class AheadRunning:
    """`ModelRunner`'s steps ahead (see the module docstring)."""

    def can_run_ahead(self, n: int, q: int, sampled: bool) -> bool:
        """Whether a step ahead of n requests and q query tokens each has its graph (or runs
        eagerly by design: no graphs at all)."""
        if not self.graphs:
            return True
        bucket = next((b for b in self.buckets if b >= n), None)
        return (bucket, q, sampled) in self.ahead_graphs

    @torch.inference_mode()
    def execute_ahead(self, batch: list[ScheduledRequest], meta: dict[str, list], hooks: AheadHooks,
                      sampled: bool = False) -> str:
        """A verify step planned before its predecessor's tokens reached the host; returns how it
        ran (`ForwardOutput.mode`). Request i runs `batch[i].num_tokens` = 1 + K_i query tokens;
        `batch[i].start` assumes the predecessor accepted nothing (`batch[i].draft` holds
        placeholders). `meta` holds each request's AHEAD_FIELDS; `sampled`: some request samples
        (rejection sampling; else greedy acceptance only).

        Around the target's forward, `hooks.before` gives each request's shift (what the
        predecessor accepted), its first token and its drafts, and `hooks.after` accepts on the
        padded rows ([N * q] logits and aux, q = max num_tokens) and keeps the results. With a
        captured graph (`capture(..., ahead=...)`) all of it is one replay and nothing reads the
        host: the inputs are staged as if the shift were 0 and shifted on the device
        (`_shift_inputs`). Without one (eager, the CPU) the shift and the drafts are read to the
        host and the exact batch runs as `execute` runs it."""
        n, q = len(batch), max(s.num_tokens for s in batch)
        bucket = next((b for b in self.buckets if b >= n), None)
        graph = self.ahead_graphs.get((bucket, q, sampled)) if bucket is not None else None
        if graph is None:
            if self.graphs:
                self._warn_fallback(batch)
            return self._execute_ahead_eagerly(batch, q, meta, hooks, sampled)
        pads = {f: hooks.zero_row if f == "pick" else pad for f, (_, pad) in AHEAD_FIELDS.items()}
        extra = {f"ahead/{f}": meta[f] + [pads[f]] * (bucket - n) for f in AHEAD_FIELDS}
        self._stage_inputs(batch, bucket, q, extra)
        if self._live_rows is not None:
            self._live_rows.fill_(n * q)
        graph.replay()
        return "cuda_graph"

    def _ahead_body(self, b: int, q: int, hooks: AheadHooks, meta: dict[str, torch.Tensor], step: StepMetadata,
                    sampled: bool) -> None:
        """A step ahead on the static inputs (what its graph captures): shift, fill, forward, keep."""
        inputs = hooks.before(meta, hooks.depth(q), sampled)
        self._shift_inputs(inputs.shift, b, q)
        ids = self._ids[: b * q].view(b, q)
        ids[:, 0].copy_(inputs.known)
        if q > 1:
            assert inputs.drafts is not None
            ids[:, 1:].copy_(inputs.drafts[:, : q - 1])  # a pad row gets a draft token too: its K/V go to the sink
        hidden, aux = self._forward(self._ids[: b * q], self._pos[: b * q], step)
        hooks.after(q, self.model.compute_logits(hidden), aux, inputs, meta, sampled)

    def _capture_ahead_sampled(self, shapes: list[tuple[int, int]], pool: tuple[int, int], hooks: AheadHooks,
                               max_q: int) -> int:
        """The sampled variants of the steps ahead (rejection sampling in the graph); how many were
        captured. Only batch buckets whose sampling intermediates ([bucket * q, V] float32, a few
        of them held by the graph pool) stay within SAMPLED_AHEAD_ROW_BYTES each: a larger sampled
        batch verifies synchronously. When one fails to capture, sampled requests verify
        synchronously (said once, loudly): the greedy steps ahead keep theirs."""
        vocab = int(self.model.hf_config["vocab_size"])
        shapes = [(b, q) for b, q in shapes if b * max_q * vocab * 4 <= SAMPLED_AHEAD_ROW_BYTES]
        logger.info("Capturing CUDA graphs (verify ahead, sampling): %d shapes, batch buckets up to %s", len(shapes),
                    max((b for b, _ in shapes), default=0))
        try:
            for b, q in shapes:
                self.ahead_graphs[(b, q, True)] = self._capture_ahead(b, q, pool, hooks, True)
        except Exception as e:  # noqa: BLE001 - the greedy graphs stand; sampled requests run synchronously
            for key in [k for k in self.ahead_graphs if k[2]]:
                del self.ahead_graphs[key]
            hooks.sampled_ahead = False
            logger.warning("Sampled requests' speculative steps run synchronously: capturing them failed (%s)", e)
            return 0
        return len(shapes)

    def _capture_ahead(self, b: int, q: int, pool: tuple[int, int], hooks: AheadHooks, sampled: bool
                       ) -> torch.cuda.CUDAGraph:
        self._fill_static_pattern(b, q)
        step = self._static_step(b, q)
        meta = {f: self._static.device[f"ahead/{f}"][:b] for f in AHEAD_FIELDS}  # all padding: ring slot 0
        for _ in range(2):  # warm up outside the graph (writes only the sinks, slot 0 and the results)
            self._ahead_body(b, q, hooks, meta, step, sampled)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._ahead_body(b, q, hooks, meta, step, sampled)
        return graph

    def _shift_inputs(self, shift: torch.Tensor, n: int, q: int) -> None:
        """Move the staged queries of the first n requests (q rows each) `shift[i]` positions on:
        positions and sequence lengths add it, and each real row's slot is looked up again in the
        request's block table (allocated for the largest shift). Pad rows keep the sink."""
        rows, bs = n * q, self.block_size
        pos = self._pos[:rows]
        pos += shift[:, None].expand(n, q).reshape(-1)
        self._seq[:n] += shift.to(self._seq.dtype)
        for g, slots in enumerate(self._slots):
            real = slots[:rows] != self.kv.null_block(g) * bs
            blocks = self._tables[g][:n].gather(1, (pos // bs).view(n, q)).view(-1)
            slots[:rows] = torch.where(real, blocks.to(torch.int64) * bs + pos % bs, slots[:rows])

    def _execute_ahead_eagerly(self, batch: list[ScheduledRequest], q: int, meta: dict[str, list],
                               hooks: AheadHooks, sampled: bool) -> str:
        """`execute_ahead` without a graph: the hooks run on tensors of their own, the shift and
        the drafts are read to the host (a device sync) and the exact batch is run by `execute`,
        its ragged rows scattered into the padded layout."""
        n = len(batch)
        dev = {f: host_to_device(meta[f], dtype, self.device) for f, (dtype, _) in AHEAD_FIELDS.items()}
        inputs = hooks.before(dev, hooks.depth(q), sampled)
        moved = inputs.shift.tolist()
        proposed = inputs.drafts.tolist() if inputs.drafts is not None else [[]] * n
        exact = [ScheduledRequest(s.request, s.start + m, s.num_tokens, True, tuple(d[: len(s.draft)]), input_row=i)
                 for i, (s, m, d) in enumerate(zip(batch, moved, proposed))]
        out = self.execute(exact, pending=inputs.known)
        index = host_to_device([i * q + j for i, s in enumerate(exact) for j in range(s.num_tokens)], torch.int64,
                               self.device)
        logits = out.logits.new_zeros(n * q, out.logits.shape[1]).index_copy_(0, index, out.logits)
        aux = None if out.aux is None else out.aux.new_zeros(n * q, out.aux.shape[1]).index_copy_(0, index, out.aux)
        hooks.after(q, logits, aux, inputs, dev, sampled)
        return out.mode
