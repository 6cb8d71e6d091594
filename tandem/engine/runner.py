"""Model runner: owns the device-side KV cache tensors and turns a scheduled batch into one forward
pass — replaying a captured CUDA graph when the step's shape has one, eagerly otherwise.

Graphs are keyed by (batch bucket, tokens per sequence): a uniform step of B requests with q query
tokens each (decode: q = 1; speculative verify: q = 1 + K) replays `graphs[(bucket, q)]` for the
smallest bucket >= B, padding the extra rows. Padded rows write their K/V into a reserved sink
block that no request owns, so they never disturb real state.

The runner returns the logits rows each request needs (`ScheduledRequest.num_logits`): one for a
decode or the end of a prefill, 1 + K for a request verifying K draft tokens, none for a prefill
chunk that does not reach the prompt's end — ragged, packed in batch order. A batch whose requests
verify different K (mixed query lengths, all sampling) replays the graph of its longest query: each
request's query is padded at its end to q tokens. A pad token writes its K/V into the sink block
and its logits row is dropped; the attention kernels place query row j at cache position
seq_len - q + j, so with seq_len padded by as much the real rows keep their positions and their
causal masks, and never see a pad.

A step with prefill work (prompt chunks, alone or beside decodes and verifies) replays a
prefill graph, keyed by total query tokens: `prefill_graphs[T]` for the smallest captured T >=
the step's tokens. Its requests' queries are packed as they come (ragged), the pads go at the end
of the last request's query (the same rule as above), and the graph's batch rows are all
max_num_seqs seats: a seat without a request has an empty query, and the attention kernel's
programs for it return at once. It computes the logits of the rows the step needs only (an input
it reads), into one buffer all prefill graphs share. Eager, such a step costs the host ~7-13 ms
on the demo model (one launch per kernel from Python); replayed, well under one.

A runner built with `aux_layers` (a drafter that reads the target's hidden states: DSpark) also
returns those layers' outputs for every real query token of the step, packed in batch order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core import GroupState, StepMetadata
from tandem.engine.runner_ahead import AHEAD_FIELDS, AheadHooks, AheadRunning
from tandem.engine.runner_chain import ChainRunning
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.static_inputs import StaticInputs, host_to_device
from tandem.kernels.moe_grouped import GroupedMoEExecutor
from tandem.kv.groups import entry_slots, token_slots
from tandem.kv.manager import KVCacheManager
from tandem.kv.tensors import LayerCache, allocate_layer_caches
from tandem.models.base import CausalLM

logger = logging.getLogger("tandem")
_PER_TOKEN = {"state_slots", "snapshot_slots"}  # StepMetadata state fields of [T] (the others: [B])


def allocate_kv_caches(model: CausalLM, kv: KVCacheManager, device: torch.device) -> list[tuple[LayerCache, ...]]:
    """Every layer's cache tensors (tandem/kv/tensors.py), sized by the manager's pools and bound
    to the model. Row `num_blocks` of each paged tensor is the padding sink of CUDA graphs; the
    block pool never hands it out."""
    caches = allocate_layer_caches(kv, len(model.kv_cache_specs()), device)
    model.bind_kv_caches(caches)
    return caches


def _has_prefill(batch: list[ScheduledRequest]) -> bool:
    """Whether a step holds prefill work (a request with more query tokens than logits rows)."""
    return any(s.num_tokens > s.num_logits for s in batch)


def _graphable(batch: list[ScheduledRequest]) -> bool:
    """A step a graph can run: every request reaches its last known token (its logits are the
    last num_logits of its query rows). A short query with fewer logits rows than tokens (a
    drafter catching up two tokens, a prompt's last 2-token chunk) replays the graph of its length;
    a chunk that samples nothing runs eagerly."""
    return all(s.samples for s in batch)


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int, warm_up: bool = False) -> float:
    """The mean seconds of fn() over `repeats` calls, the device synchronised around them (after
    one untimed call with `warm_up`: an eager forward's first run pays for allocation)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device=None: None)
    if warm_up:
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def prefill_buckets(max_tokens: int, min_tokens: int = 8) -> tuple[int, ...]:
    """Query lengths of the prefill graphs: powers of two from `min_tokens` up to `max_tokens`, and
    `max_tokens` itself (none when it is below `min_tokens`)."""
    sizes = {1 << i for i in range(max_tokens.bit_length()) if min_tokens <= 1 << i <= max_tokens}
    return tuple(sorted(sizes | ({max_tokens} if max_tokens >= min_tokens else set())))


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs} | set(range(16, max_num_seqs + 1, 16))
    return tuple(sorted(sizes | {max_num_seqs}))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket * q, V] float32, the graph's output (a prefill graph's: the shared rows)
    aux: torch.Tensor | None  # [bucket * q, F]: the aux layers' outputs, with aux_layers


@dataclass(frozen=True)
class ForwardOutput:
    """One forward pass's results."""

    # [R, V] float32: each request's `num_logits` rows, in batch order. After a graph replay this may
    # be a view of the graph's output: valid until the runner's next forward.
    logits: torch.Tensor
    # How it ran: "cuda_graph"; "prefill_graph" (a step with a prefill chunk, replayed from a
    # prefill graph); "prefill" (a step with a prefill chunk, eager: more tokens or logits rows
    # than the prefill graphs take); "eager" (a decode or verify step that ran eagerly: graphs
    # are off, or none fits its shape).
    mode: str
    # [T, F] with aux_layers: the aux layers' outputs (concatenated) of every real query token, in
    # batch order (request i's `num_tokens` rows, draft tokens included); else None.
    aux: torch.Tensor | None = None

    @property
    def graphed(self) -> bool:
        return self.mode == "cuda_graph"


class ModelRunner(AheadRunning, ChainRunning):
    def __init__(self, model: CausalLM, kv: KVCacheManager, device: torch.device,
                 aux_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.aux_layers = aux_layers
        self.block_size = kv.block_size
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.ahead_graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, q, sampled): ahead
        self.prefill_graphs: dict[int, _Graph] = {}  # T: a step with prefill work of up to T tokens, ascending
        self._prefill_logits: torch.Tensor | None = None  # [rows, V] float32, written by every prefill graph
        self.buckets: tuple[int, ...] = ()
        self._warned: set[tuple[int, int]] = set()  # step shapes that fell back to eager
        # Routed experts in RAM (tandem/offload/cpu_executor.py): before a replay, the real rows of
        # the padded batch go into this device scalar, so the CPU kernel skips the pads' experts.
        offloaded = getattr(model, "cpu_experts", None)
        self._live_rows: torch.Tensor | None = offloaded.live_rows if offloaded is not None else None

    # -- inputs -------------------------------------------------------------------------------
    def build_step(self, batch: list[ScheduledRequest], pending: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """Pack the batch's tokens; returns input_ids [T], positions [T] and the step metadata.
        `pending`: the previous step's sampled tokens [S] on the device, which the decodes
        scheduled ahead (`ScheduledRequest.input_row`) read."""
        host = self._host_inputs(batch)
        input_ids, positions, query_start, seq_lens, logits_indices, slots, tables = host

        def dev(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return host_to_device(x, dtype, self.device)

        block_tables = []
        for g in range(len(tables)):
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
            block_size=self.block_size,
            max_query_len=max(s.num_tokens for s in batch),
            group_states=(states := self._group_states(batch)),
            prefix_unit=self.kv.unit,
            **self._state_tensors(batch, states, [list(range(s.start, s.start + s.num_tokens)) for s in batch], dev),
        )
        ids = dev(input_ids, torch.int64)
        self._fill_pending(ids, batch, query_start, pending)
        return ids, dev(positions, torch.int64), step

    def _fill_pending(self, ids: torch.Tensor, batch: list[ScheduledRequest], rows: list[int],
                      pending: torch.Tensor | None) -> None:
        """Write into `ids` the tokens of the decodes scheduled ahead: request i's query row
        `rows[i]` gets row `input_row` of the previous step's sampled tokens `pending` [S], a
        device-side copy queued after that step's sampling."""
        pairs = [(at, s.input_row) for at, s in zip(rows, batch) if s.input_row is not None]
        if not pairs:
            return
        if pending is None:
            raise ValueError("a decode scheduled ahead needs the previous step's sampled tokens")
        dst, src = (list(x) for x in zip(*pairs))
        n = len(dst)
        if dst == src == list(range(n)):  # the steady state: the same requests in the same order, q = 1
            ids[:n].copy_(pending[:n])
        else:
            index = host_to_device([dst, src], torch.int64, self.device)
            ids.index_copy_(0, index[0], pending.index_select(0, index[1]))

    def _state_tensors(self, batch: list[ScheduledRequest], states: tuple[GroupState | None, ...],
                       positions: list[list[int]], dev: Callable) -> dict[str, tuple[torch.Tensor | None, ...]]:
        """StepMetadata's device copies of the compressed groups' state (see _state_lists)."""
        return {name: tuple(None if v is None else dev(v, torch.int64) for v in values)
                for name, values in self._state_lists(batch, states, positions).items()}

    def _state_lists(self, batch: list[ScheduledRequest], states: tuple[GroupState | None, ...],
                     positions: list[list[int]]) -> dict[str, list[list[int] | None]]:
        """The compressed groups' state fields of StepMetadata as host lists, None for a group
        without state (`positions[i]`: request i's query positions, pads included; a pad position
        of -1 points at the sinks)."""
        fields: dict[str, list[list[int] | None]] = {
            "state_slots": [], "request_state_slots": [], "snapshot_slots": [], "restore_ids": []}
        unit, sink = self.kv.unit, self.kv.num_state_slots
        for state in states:
            if state is None:
                for values in fields.values():
                    values.append(None)
                continue
            per_token, snaps = [], []
            for r, pos in enumerate(positions):
                ids = state.snapshots[r]
                for p in pos:
                    per_token.append(state.slots[r] if p >= 0 else sink)
                    i = (p + 1) // unit - 1
                    closes = p >= 0 and (p + 1) % unit == 0 and i < len(ids)
                    snaps.append(ids[i] if closes else state.null_snapshot)
            fields["state_slots"].append(per_token)
            fields["request_state_slots"].append(list(state.slots))
            fields["snapshot_slots"].append(snaps)
            fields["restore_ids"].append(list(state.restore))
        return fields

    def _group_states(self, batch: list[ScheduledRequest]) -> tuple[GroupState | None, ...]:
        """The compressed groups' state slots and overlap snapshots of the step's requests."""
        kv, out = self.kv, []
        for g, group in enumerate(kv.groups):
            if not group.spec.has_state:
                out.append(None)
                continue
            rids = [s.request.request_id for s in batch]
            restore = [kv.snapshot_to_restore(r, g, s.start) for r, s in zip(rids, batch)]
            pool = kv.snapshot_pools[g]
            out.append(GroupState(
                slots=tuple(kv.state_slot(r, g) for r in rids),
                restore=tuple(-1 if x is None else x for x in restore),
                snapshots=tuple(tuple(kv.snapshot_ids(r, g)) for r in rids),
                null_snapshot=pool.num_blocks if pool is not None else 0,
            ))
        return tuple(out)

    def _host_inputs(self, batch: list[ScheduledRequest]):  # noqa: ANN202 - a tuple of host lists
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        n_groups = len(self.kv.groups)
        slots: list[list[int]] = [[] for _ in range(n_groups)]
        tables: list[list[list[int]]] = [[] for _ in range(n_groups)]
        kinds = [(g.spec.kind, g.spec.ratio) for g in self.kv.groups]
        for s in batch:
            req = s.request
            start, end = s.start, s.start + s.num_tokens
            if s.input_row is not None:  # its token is still on the device: `_fill_pending` writes it
                input_ids.append(0)
                input_ids.extend(s.draft)  # a speculative step ahead: placeholders the runner overwrites
            else:
                input_ids.extend(req.all_token_ids[start : end - len(s.draft)])  # the request's own tokens ...
                input_ids.extend(s.draft)  # ... then the draft to verify, if any
            positions.extend(range(start, end))
            for g, (kind, ratio) in enumerate(kinds):
                ids = self.kv.block_ids(req.request_id, g)
                tables[g].append(ids)
                if kind == "compressed":  # the entry a token's window closes, else -1
                    slots[g].extend(entry_slots(ids, bs, ratio, start, end))
                else:
                    slots[g].extend(token_slots(ids, bs, start, end))
            query_start.append(query_start[-1] + s.num_tokens)
            seq_lens.append(end)
            logits_indices.extend(range(query_start[-1] - s.num_logits, query_start[-1]))
        return input_ids, positions, query_start, seq_lens, logits_indices, slots, tables

    # -- execution ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest], pending: torch.Tensor | None = None) -> ForwardOutput:
        """Run one forward pass over the batch (a CUDA graph when its shape has one). `pending`:
        the previous step's sampled tokens [S], on the device, for the decodes scheduled ahead
        (async scheduling: `ScheduledRequest.input_row`)."""
        prefill = _has_prefill(batch)
        key = self._graph_key(batch)
        if key is not None:
            return self._replay(batch, key, pending)
        total = self._prefill_key(batch) if prefill else None
        if total is not None:
            return self._replay_prefill(batch, total, pending)
        if self.graphs and not prefill:
            self._warn_fallback(batch)
        input_ids, positions, step = self.build_step(batch, pending)
        hidden, aux = self._forward(input_ids, positions, step)  # [T, H], [T, F] | None
        logits = self.model.compute_logits(hidden[step.logits_indices])  # [R, V]
        return ForwardOutput(logits, "prefill" if prefill else "eager", aux)

    def _warn_fallback(self, batch: list[ScheduledRequest]) -> None:
        """A decode or verify step with no captured graph runs eagerly: say so, once per shape."""
        shape = (len(batch), max(s.num_tokens for s in batch))
        if shape not in self._warned:
            self._warned.add(shape)
            logger.warning("no CUDA graph for a step of %d requests with up to %d query tokens (captured: batch "
                           "buckets %s, query lengths %s); it runs eagerly (slow)", shape[0], shape[1],
                           list(self.buckets), sorted({q for _, q in self.graphs}))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.aux_layers:
            return self.model.forward_with_aux(input_ids, positions, step, self.aux_layers)
        return self.model(input_ids, positions, step), None

    def _graph_key(self, batch: list[ScheduledRequest]) -> tuple[int, int] | None:
        """The graph of a step whose requests all sample (see _graphable), padded to one q."""
        if not self.graphs or not _graphable(batch):
            return None
        q = max(s.num_tokens for s in batch)
        bucket = next((b for b in self.buckets if b >= len(batch)), None)
        if bucket is None or (bucket, q) not in self.graphs:
            return None
        return bucket, q

    def _prefill_key(self, batch: list[ScheduledRequest]) -> int | None:
        """The prefill graph of a step: the smallest captured T that holds its query tokens, if its
        logits rows fit the shared buffer and its block tables can take the pads' blocks. None:
        no such graph."""
        if not self.prefill_graphs:
            return None
        total = sum(s.num_tokens for s in batch)
        t = next((t for t in self.prefill_graphs if t >= total), None)  # ascending
        if t is None or sum(s.num_logits for s in batch) > self.prefill_graphs[t].logits.shape[0]:
            return None
        # `_stage_prefill` widens its block tables by the pads' blocks: they must fit the static ones.
        own = max(len(self.kv.block_ids(s.request.request_id, g)) for s in batch for g in range(len(self.kv.groups)))
        return t if own + max(1, -(-(t - total) // self.block_size)) <= self._tables[0].shape[1] else None

    def _replay_prefill(self, batch: list[ScheduledRequest], t: int, pending: torch.Tensor | None) -> ForwardOutput:
        """Replay prefill graph `t` for the batch (see the module docstring)."""
        num_logits, query_start = self._stage_prefill(batch, t)
        self._fill_pending(self._ids, batch, query_start[:-1], pending)
        entry = self.prefill_graphs[t]
        entry.graph.replay()
        aux = None if entry.aux is None else entry.aux[: query_start[-1]]
        return ForwardOutput(entry.logits[:num_logits], "prefill_graph", aux)

    def _stage_prefill(self, batch: list[ScheduledRequest], t: int) -> tuple[int, list[int]]:
        """Stage a prefill graph's inputs: the batch's queries packed, t minus their tokens pads at
        the end of the last one, empty queries for the seats without a request, the rows whose
        logits the step needs. Returns how many of those rows there are, and the requests' query
        starts (n + 1: the last is their tokens, pads not counted)."""
        static, host, n = self._static, self._static.host, len(batch)
        input_ids, positions, query_start, seq_lens, logits_rows, slots, tables = self._host_inputs(batch)
        seats, pad, bs = self._seq.shape[0], t - query_start[-1], self.block_size
        rows = self.prefill_graphs[t].logits.shape[0]
        static.wait()  # the last upload has read the host staging
        host["ids"][:t] = input_ids + [0] * pad
        host["pos"][:t] = positions + [positions[-1]] * pad  # a pad's position is never read back
        host["qsl"][: seats + 1] = query_start[:-1] + [t] * (seats + 1 - n)
        host["seq"][:seats] = seq_lens[:-1] + [seq_lens[-1] + pad] + [0] * (seats - n)
        host["logits_rows"][:rows] = logits_rows + [0] * (rows - len(logits_rows))
        corners = []
        for g, per_request in enumerate(tables):
            host[f"slots/{g}"][:t] = slots[g] + [self.kv.null_block(g) * bs] * pad
            # A seat without a request is never read (its query is empty): the requests' rows only.
            corners.append(self._stage_table(g, per_request, n, pad))
        static.upload(corners)
        return len(logits_rows), query_start

    # -- CUDA graphs ----------------------------------------------------------------------------
    def capture(self, max_num_seqs: int, families: dict[str, tuple[int, ...]], max_model_len: int,
                ahead: AheadHooks | None = None, prefill: tuple[int, ...] = ()) -> None:
        """Capture a graph for every (batch bucket, query length) of every family (a name for the
        log, e.g. "decode": (1,), "verify": (2, 3)). Logs each family's shapes and progress. With
        `ahead`, also the speculative steps ahead at every query length (`execute_ahead`); with
        `prefill`, a prefill graph at each of those token totals, unless the model's steps cannot
        take them (`_prefill_blockers`, logged)."""
        self.buckets = batch_buckets(max_num_seqs)
        max_q = max(q for lens in families.values() for q in lens)
        blockers = self._prefill_blockers() if prefill else []
        if blockers:
            logger.info("Prefill CUDA graphs off: %s; prompts prefill eagerly", " and ".join(blockers))
            prefill = ()
        self._tune_moe_small(max(self.buckets[-1] * max_q, max(prefill, default=0)))
        self._allocate_static(self.buckets[-1], max_q, -(-max_model_len // self.block_size) + 1,
                              ahead_rows=ahead.zero_row if ahead is not None else None,
                              min_tokens=max(prefill, default=0), logits_rows=min(max(prefill, default=0),
                                                                                   self.buckets[-1] * max_q))
        dev = self.device
        pool = torch.cuda.graph_pool_handle()
        start, total = time.perf_counter(), 0
        with torch.inference_mode():
            for family, query_lens in families.items():
                shapes = [(b, q) for q in query_lens for b in reversed(self.buckets)]  # largest first: pool reuse
                logger.info("Capturing CUDA graphs (%s): %d shapes, batch buckets %s x query lengths %s",
                            family, len(shapes), list(self.buckets), list(query_lens))
                for i, (b, q) in enumerate(shapes):
                    self.graphs[(b, q)] = self._capture_one(b, q, pool)
                    logger.info("Capturing CUDA graphs (%s): %d/%d (batch %d, query len %d)", family, i + 1,
                                len(shapes), b, q)
                total += len(shapes)
            if ahead is not None:
                query_lens = sorted({q for lens in families.values() for q in lens})
                shapes = [(b, q) for q in query_lens for b in reversed(self.buckets)]
                logger.info("Capturing CUDA graphs (verify ahead): %d shapes, batch buckets %s x query lengths %s",
                            len(shapes), list(self.buckets), query_lens)
                for i, (b, q) in enumerate(shapes):
                    self.ahead_graphs[(b, q, False)] = self._capture_ahead(b, q, pool, ahead, False)
                    logger.info("Capturing CUDA graphs (verify ahead): %d/%d (batch %d, query len %d)", i + 1,
                                len(shapes), b, q)
                total += len(shapes) + self._capture_ahead_sampled(shapes, pool, ahead, max(query_lens))
            if prefill:
                logger.info("Capturing CUDA graphs (prefill): %d shapes, up to %d requests x total query tokens %s",
                            len(prefill), self.buckets[-1], list(prefill))
                for i, t in enumerate(sorted(prefill, reverse=True)):  # largest first: pool reuse
                    self.prefill_graphs[t] = self._capture_prefill(t, pool)
                    logger.info("Capturing CUDA graphs (prefill): %d/%d (%d tokens)", i + 1, len(prefill), t)
                self.prefill_graphs = dict(sorted(self.prefill_graphs.items()))  # ascending: `_prefill_key`
                total += len(prefill)
        torch.cuda.synchronize(dev)
        logger.info("Captured %d CUDA graphs in %.1f s", total, time.perf_counter() - start)

    def _tune_moe_small(self, max_tokens: int) -> None:
        """Before capture: measure, per MoE layer shape on the GPU, up to which step size the
        small-batch expert kernels beat the grouped GEMMs, for the steps the graphs will hold
        (`tandem.kernels.moe_crossover`; logged). Layers with other executors keep theirs."""
        blocks = self.model.moe_blocks().values() if hasattr(self.model, "moe_blocks") else ()
        executors = [(b.executor, b.top_k) for b in blocks if isinstance(b.executor, GroupedMoEExecutor)]
        if executors:
            from tandem.kernels.moe_crossover import tune_small_batch

            tune_small_batch(executors, max_tokens)

    def _prefill_blockers(self) -> list[str]:
        """What keeps this runner's steps out of prefill graphs (empty: nothing): routed experts on
        the CPU (their kernel is sized by the padded batch) and KV groups other than full
        attention (their state per token takes no pads beyond a verify's)."""
        why = ["routed experts run on the CPU"] if self._live_rows is not None else []
        other = sorted({g.spec.kind for g in self.kv.groups} - {"full"})
        if other:
            why.append(f"KV cache groups of kind {', '.join(other)}")
        return why

    def _allocate_static(self, max_b: int, max_q: int, max_blocks: int, ahead_rows: int | None = None,
                         min_tokens: int = 0, logits_rows: int = 1) -> None:
        """The static inputs every graph reads (replay stages the step's values into their
        prefixes, see StaticInputs), also what `measure` runs eager forwards on; block tables and
        slots all point at the sink block. Token inputs hold max_b * max_q rows, or `min_tokens`
        (the longest prefill graph's) if more; `logits_rows`: the most rows a prefill graph
        computes logits for."""
        n_groups, tokens = len(self.kv.groups), max(max_b * max_q, min_tokens)
        sinks = [self.kv.null_block(g) for g in range(n_groups)]  # each group's sink row
        # Compressed groups' state (StepMetadata.state_slots ...), all at the sinks.
        stateful = [g.spec.has_state for g in self.kv.groups]
        null_snapshots = [pool.num_blocks if pool is not None else 0 for pool in self.kv.snapshot_pools]
        self._state_pads = {"state_slots": [self.kv.num_state_slots] * n_groups,
                            "request_state_slots": [self.kv.num_state_slots] * n_groups,
                            "snapshot_slots": null_snapshots, "restore_ids": [-1] * n_groups}
        regions = {"ids": (tokens, torch.int64, 0), "pos": (tokens, torch.int64, 0),
                   "qsl": (max_b + 1, torch.int32, 0), "seq": (max_b, torch.int32, 1),
                   "logits_rows": (max(1, logits_rows), torch.int64, 0)}  # the rows a prefill graph's logits are of
        regions |= {f"slots/{g}": (tokens, torch.int64, sink * self.block_size) for g, sink in enumerate(sinks)}
        for name, pads in self._state_pads.items():
            size = tokens if name in _PER_TOKEN else max_b
            regions |= {f"{name}/{g}": (size, torch.int64, pad) for g, pad in enumerate(pads) if stateful[g]}
        if ahead_rows is not None:  # a step ahead's per-request fields (execute_ahead); padding picks the zero row
            regions |= {f"ahead/{f}": (max_b, dtype, ahead_rows if f == "pick" else pad)
                        for f, (dtype, pad) in AHEAD_FIELDS.items()}
        self._static = StaticInputs(regions, [(max_b, max_blocks, sink) for sink in sinks], self.device)
        view = self._static.device
        self._ids, self._pos = view["ids"], view["pos"]  # [max_b * max_q] int64
        self._qsl, self._seq = view["qsl"], view["seq"]  # [max_b + 1], [max_b] int32
        self._logits_rows = view["logits_rows"]  # [logits_rows] int64
        self._tables = self._static.tables  # per group [max_b, max_blocks] int32
        self._slots = [view[f"slots/{g}"] for g in range(n_groups)]  # per group [max_b * max_q] int64
        self._state = {name: [view.get(f"{name}/{g}") for g in range(n_groups)] for name in self._state_pads}
        self._all_rows = torch.arange(tokens, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def measure(self, shapes: list[tuple[int, int]], repeats: int = 5) -> dict[tuple[int, int], float]:
        """Seconds of one forward (logits included) per (batch, query length) shape, on inputs
        that all point at the sink block: a captured graph's replay where there is one, else an
        eager forward (after one untimed run). What the K controller's cost model starts from."""
        if not shapes:
            return {}
        max_b, max_q = max(b for b, _ in shapes), max(q for _, q in shapes)
        if not self.graphs:
            self._allocate_static(max_b, max_q, 2)
        times = {}
        for b, q in shapes:
            self._fill_static_pattern(b, q)
            self._seq[:b].fill_(q)  # the query's own positions: causal attention over q tokens
            if (b, q) in self.graphs:
                if self._live_rows is not None:
                    self._live_rows.fill_(b * q)
                times[(b, q)] = seconds_per_call(self.graphs[(b, q)].graph.replay, self.device, repeats)
                continue
            step, ids, pos = self._static_step(b, q), self._ids[: b * q], self._pos[: b * q]

            def run() -> None:
                self.model.compute_logits(self._forward(ids, pos, step)[0])

            times[(b, q)] = seconds_per_call(run, self.device, repeats, warm_up=True)
        return times

    def _capture_one(self, b: int, q: int, pool: tuple[int, int]) -> _Graph:
        self._fill_static_pattern(b, q)
        step = self._static_step(b, q)
        ids, pos = self._ids[: b * q], self._pos[: b * q]
        for _ in range(2):  # warm up: Triton JIT and allocator, outside the graph
            self.model.compute_logits(self._forward(ids, pos, step)[0])
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden, aux = self._forward(ids, pos, step)
            logits = self.model.compute_logits(hidden)
        return _Graph(graph, logits, aux)

    def _capture_prefill(self, t: int, pool: tuple[int, int]) -> _Graph:
        """A step with prefill work of up to t query tokens over every seat (see the module
        docstring); logits of `_logits_rows`' first min(t, its size) rows, into `_prefill_logits`."""
        seats = self._seq.shape[0]
        self._qsl[: seats + 1].fill_(t)
        self._qsl[0] = 0  # the pattern: one request of t tokens, the other seats empty
        self._seq[:seats].fill_(0)
        self._seq[0] = t
        # The host copies of the lengths are not read by capturable backends: they vary per replay.
        step = self._prefill_step(t, seats, (0,) + (t,) * seats, (t,) + (0,) * (seats - 1))
        ids, pos, rows = self._ids[:t], self._pos[:t], step.logits_indices

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden, aux = self._forward(ids, pos, step)
            return self.model.compute_logits(hidden.index_select(0, rows)), aux

        for _ in range(2):  # warm up: Triton JIT and allocator, outside the graph
            logits, _ = forward()
        if self._prefill_logits is None:  # the largest graph comes first: its rows are the most
            self._prefill_logits = torch.empty_like(logits)
        out = self._prefill_logits[: rows.shape[0]]
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits, aux = forward()
            out.copy_(logits)
        return _Graph(graph, out, aux)

    def _prefill_step(self, t: int, seats: int, query_start_cpu: tuple[int, ...], seq_lens_cpu: tuple[int, ...]
                      ) -> StepMetadata:
        """The step a prefill graph of t tokens runs over its first `seats` seats, on the static
        inputs (`_stage_prefill` writes them); the host lengths as given."""
        return StepMetadata(
            request_ids=("<graph>",) * seats,
            query_start_loc=self._qsl[: seats + 1],
            seq_lens=self._seq[:seats],
            block_tables=tuple(self._tables),
            slot_mappings=tuple(s[:t] for s in self._slots),
            logits_indices=self._logits_rows[: min(t, self._logits_rows.shape[0])],
            query_start_loc_cpu=query_start_cpu,
            seq_lens_cpu=seq_lens_cpu,
            block_size=self.block_size,
            max_query_len=t,
            prefix_unit=self.kv.unit,
            **{name: (None,) * len(ts) for name, ts in self._state.items()},  # full groups only (prefill_graph_lens)
        )

    def _fill_static_pattern(self, b: int, q: int) -> None:
        self._qsl[: b + 1].copy_(torch.arange(0, (b + 1) * q, q, dtype=torch.int32))

    def _static_step(self, b: int, q: int) -> StepMetadata:
        return StepMetadata(
            request_ids=("<graph>",) * b,
            query_start_loc=self._qsl[: b + 1],
            seq_lens=self._seq[:b],
            block_tables=tuple(t[:b] for t in self._tables),
            slot_mappings=tuple(s[: b * q] for s in self._slots),
            logits_indices=self._all_rows[: b * q],
            query_start_loc_cpu=tuple(range(0, (b + 1) * q, q)),
            seq_lens_cpu=(q,) * b,  # not read by capturable backends; values vary per replay
            block_size=self.block_size,
            max_query_len=q,
            prefix_unit=self.kv.unit,
            **{name: tuple(None if t is None else t[: b * q if name in _PER_TOKEN else b] for t in ts)
               for name, ts in self._state.items()},
        )

    def _replay(self, batch: list[ScheduledRequest], key: tuple[int, int], pending: torch.Tensor | None = None
                ) -> ForwardOutput:
        bucket, q = key
        n = len(batch)
        self._stage_inputs(batch, bucket, q)
        self._fill_pending(self._ids, batch, list(range(0, n * q, q)), pending)
        if self._live_rows is not None:
            self._live_rows.fill_(n * q)
        entry = self.graphs[key]
        entry.graph.replay()
        if all(s.num_tokens == q == s.num_logits for s in batch):
            # Every row of the first n requests is real and wanted: views of the graph's outputs,
            # valid until the next replay (the engine reads them within the step).
            aux = None if entry.aux is None else entry.aux[: n * q]
            return ForwardOutput(entry.logits[: n * q], "cuda_graph", aux)
        # Request i needs the last num_logits of its real rows i*q .. i*q+num_tokens-1.
        rows = [i * q + s.num_tokens - s.num_logits + j for i, s in enumerate(batch) for j in range(s.num_logits)]
        logits = entry.logits[host_to_device(rows, torch.int64, self.device)]
        aux = None
        if entry.aux is not None:  # every real row
            real = [i * q + j for i, s in enumerate(batch) for j in range(s.num_tokens)]
            aux = entry.aux[host_to_device(real, torch.int64, self.device)]
        return ForwardOutput(logits, "cuda_graph", aux)

    def _stage_table(self, g: int, per_request: list[list[int]], rows: int, max_pad: int) -> tuple[int, int]:
        """Stage block table g's corner [:rows, :width] (each request's blocks, then the sink; rows
        past the requests all sink) and return (rows, width). A row is read up to ceil(padded
        seq_len / block_size) entries: `max_pad` pad tokens may reach that many positions past a
        request's own blocks (at least one block: a verify's pads, more for a prefill graph's or
        small blocks), into the sink."""
        sink = self.kv.null_block(g)
        width = max(len(ids) for ids in per_request) + max(1, -(-max_pad // self.block_size))
        packed: list[int] = []
        for ids in per_request:
            packed += ids + [sink] * (width - len(ids))
        packed += [sink] * ((rows - len(per_request)) * width)
        self._static.table_host(g, rows, width)[:] = packed
        return rows, width

    def _stage_inputs(self, batch: list[ScheduledRequest], bucket: int, q: int,
                      extra: dict[str, list[int]] | None = None) -> None:
        """Write every input graph (bucket, q) reads into the host staging, padded rows and pad
        tokens included (so what an earlier step, capture or `measure` left on the device is never
        read), and upload it: one copy of the flat inputs, one per block table. `extra`: more
        regions' values (a step ahead's), staged with them."""
        n, static = len(batch), self._static
        input_ids, positions, _, seq_lens, _, slots, tables = self._host_inputs(batch)
        sinks = [self.kv.null_block(g) for g in range(len(tables))]
        # Request i owns query rows i*q .. i*q+q-1: its tokens first, then pads up to q (see the
        # module docstring); padded batch rows (bucket - n of them) are all pads.
        ids, pos, slot_rows, real_pos = [], [], [[] for _ in tables], []
        at = 0
        for i, s in enumerate(batch):
            m, pad = s.num_tokens, q - s.num_tokens
            ids += input_ids[at : at + m] + [0] * pad
            pos += positions[at : at + m] + [seq_lens[i] - 1] * pad  # a pad's position is never read back
            real_pos.append(positions[at : at + m] + [-1] * pad)
            for g in range(len(tables)):
                slot_rows[g] += slots[g][at : at + m] + [sinks[g] * self.block_size] * pad
            at += m
        tokens, pad_tokens = bucket * q, (bucket - n) * q
        static.wait()  # the last upload has read the host staging
        host = static.host
        host["ids"][:tokens] = ids + [0] * pad_tokens
        host["pos"][:tokens] = pos + [0] * pad_tokens
        host["qsl"][: bucket + 1] = range(0, (bucket + 1) * q, q)
        host["seq"][:bucket] = [length + q - s.num_tokens for length, s in zip(seq_lens, batch)] + [q] * (bucket - n)
        corners, max_pad = [], max(q - s.num_tokens for s in batch)
        for g, rows in enumerate(tables):
            host[f"slots/{g}"][:tokens] = slot_rows[g] + [sinks[g] * self.block_size] * pad_tokens
            corners.append(self._stage_table(g, rows, bucket, max_pad))
        states = self._group_states(batch)
        if any(state is not None for state in states):
            for name, values in self._state_lists(batch, states, real_pos).items():
                end = tokens if name in _PER_TOKEN else bucket
                for g, (value, pad) in enumerate(zip(values, self._state_pads[name])):
                    if value is not None:  # the batch's pad rows: the sinks
                        host[f"{name}/{g}"][:end] = value + [pad] * (end - len(value))
        for name, values in (extra or {}).items():
            host[name][: len(values)] = values
        static.upload(corners)
