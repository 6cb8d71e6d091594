"""DSpark proposer: drafts a whole block per request in one drafter forward from the target's
hidden states (`tandem.spec.dspark.DSparkDrafter`).

The target's runner is built with the drafter's `aux_layers` and returns, every step, those
layers' outputs for each query token. `observe` keeps, per request, a window of the last W rows
of the tokens the target kept (prefill chunks, the last token of a decode, the last token and the
accepted drafts of a verify; rejected drafts' rows are dropped). A window is usable for a request
when it ends at the request's last computed position and reaches back W positions (or to position
0: the drafter was trained with the window clamped there). A request whose window is not usable
(a prefix-cache hit left fewer than W positions computed; the engine asks the KV manager to
leave W) drafts nothing that step.

The windows live in one device ring, [slots, W, F]: a request holds a slot, position p's row at
p mod W. A step's rows for every request are written with one scatter, and `propose` gathers the
windows it drafts from with one gather, whatever the batch: per-request tensor work would cost
host time every step, which a step at K = 0 going ahead at the device's pace notices.

On CUDA, `capture` records the drafter's block forward per batch bucket, greedy and sampling
(Gumbel noise drawn outside the graph from each request's generator), and `propose` replays it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.core import Request
from tandem.engine.runner import batch_buckets, seconds_per_call
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.static_inputs import host_to_device
from tandem.spec.dspark import DSparkDrafter
from tandem.spec.proposer import Draft

logger = logging.getLogger("tandem")


@dataclass
class _Window:
    """A request's window in the ring: positions next_pos - real .. next_pos - 1 are real rows, at
    ring[slot, p mod W]."""

    slot: int
    next_pos: int  # the first position whose features are not in the window
    real: int  # positions in the window that were observed (the others, before them, are not)

    def usable_at(self, last_computed: int, w: int) -> bool:
        return self.next_pos == last_computed and (self.real >= w or self.next_pos == self.real)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [bucket, kmax]
    probs: torch.Tensor | None  # [bucket, kmax, V] (sampling graphs)
    confidence: torch.Tensor  # [bucket, kmax]


class DSparkProposer:
    def __init__(self, drafter: DSparkDrafter, kmax: int, device: torch.device,
                 generator_for: Callable[[Request], torch.Generator],
                 count_forward: Callable[[str], None] = lambda mode: None, depths: tuple[int, ...] = ()) -> None:
        if not 1 <= kmax <= drafter.cfg.block_size:
            raise ValueError(f"--speculative-config: num_speculative_tokens {kmax} is more than the DSpark drafter's "
                             f"block_size {drafter.cfg.block_size} (it drafts at most that many tokens per forward)")
        self.drafter = drafter
        self.kmax = kmax
        self.device = device
        self.generator_for = generator_for
        self.count_forward = count_forward
        self.aux_layers = drafter.cfg.target_layers
        self.window = drafter.cfg.window
        self._windows: dict[str, _Window] = {}
        self._ring: torch.Tensor | None = None  # [slots, W, F], grown by doubling (until captured)
        self._ring_fixed = False  # captured graphs read the ring by address: it no longer grows
        self._free: list[int] = []  # slots no request holds
        # Block depths drafted (one graph each): the K values the policy uses; a batch drafts the
        # smallest depth covering its largest K (drafts are prefix-consistent).
        self.depths = tuple(sorted(set(depths) | {kmax}))
        self._graphs: dict[tuple[int, int, bool], _DraftGraph] = {}
        self._gumbel: torch.Tensor | None = None  # [rows, kmax, V] sampled drafts' noise (capture, draft_noise)
        self._buckets: tuple[int, ...] = ()

    # -- the proposer interface ---------------------------------------------------------------
    def observe(self, batch: Sequence[ScheduledRequest], kept: Sequence[int], aux: torch.Tensor | None) -> None:
        if aux is None:
            raise RuntimeError("the DSpark proposer needs the target runner's aux-layer outputs (aux_layers)")
        w = self.window
        places: list[int] = []  # rows of the ring seen as [slots * W, F]: slot * W + position % W
        rows: list[int] = []  # their rows of `aux`
        at = 0
        for s, n in zip(batch, kept):
            rid = s.request.request_id
            win = self._windows.get(rid)
            if win is None:
                win = self._windows[rid] = _Window(self._take_slot(aux), s.start, 0)
            elif win.next_pos != s.start:  # recomputed from another position
                win.next_pos, win.real = s.start, 0
            first = max(0, n - w)  # rows older than the last W of this step are overwritten anyway
            places.extend(win.slot * w + (s.start + j) % w for j in range(first, n))
            rows.extend(range(at + first, at + n))
            win.next_pos, win.real = s.start + n, min(win.real + n, w)
            at += s.num_tokens
        if rows:
            assert self._ring is not None
            index = host_to_device([places, rows], torch.int64, aux.device)  # queued behind the forward
            new = aux.index_select(0, index[1]).to(self._ring.dtype)
            self._ring.view(-1, aux.shape[1]).index_copy_(0, index[0], new)

    def _take_slot(self, aux: torch.Tensor) -> int:
        """A free slot of the ring, which doubles (copying what it holds) when none is left (not
        once graphs read it: `capture` sizes it for max_num_seqs windows)."""
        if not self._free and self._ring_fixed:
            raise RuntimeError(f"the DSpark ring holds {self._ring.shape[0] - 1} windows (max_num_seqs) and every "
                               "one is in use")
        if not self._free:
            old = 0 if self._ring is None else self._ring.shape[0]
            grown = torch.zeros(max(8, 2 * old), self.window, aux.shape[1], dtype=aux.dtype, device=aux.device)
            if self._ring is not None:
                grown[:old] = self._ring
            self._ring = grown
            # Slot 0 is never handed out: a step ahead writes the rows it rejects there.
            self._free = list(range(grown.shape[0] - 1, max(old, 1) - 1, -1))
        return self._free.pop()

    def _gather(self, wins: Sequence[_Window], out: torch.Tensor | None = None) -> torch.Tensor:
        """The windows [N, W, F] in position order (into `out` when given); a window of fewer than
        W positions from position 0 is padded with position 0's row at the front."""
        assert self._ring is not None
        w = self.window
        index = [win.slot * w + max(0, win.next_pos - w + j) % w for win in wins for j in range(w)]
        index_t = host_to_device(index, torch.int64, self._ring.device)
        feats = self._ring.view(-1, self._ring.shape[2]).index_select(0, index_t).view(len(wins), w, -1)
        return feats if out is None else out.copy_(feats)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        if len(requests) != len(ks):
            raise ValueError(f"propose needs one k per request, got {len(ks)} for {len(requests)} requests")
        drafts = [Draft([]) for _ in requests]
        idx = [i for i, (r, k) in enumerate(zip(requests, ks))
               if k > 0 and (w := self._windows.get(r.request_id)) is not None
               and w.usable_at(r.num_computed_tokens, self.window)]
        if not idx:
            return drafts
        reqs = [requests[i] for i in idx]
        windows = [self._windows[r.request_id] for r in reqs]
        known = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in reqs]
        sampled = [not r.params.greedy for r in reqs]
        depth = next(d for d in self.depths if d >= max(ks[i] for i in idx))
        tokens, probs, conf = self._draft(windows, known, reqs, sampled, depth)
        tokens_h = tokens.tolist()  # the one host sync
        for j, i in enumerate(idx):
            k = ks[i]
            q = probs[j, :k] if probs is not None and sampled[j] else None
            drafts[i] = Draft(tokens_h[j][:k], q, conf[j, :k])
        return drafts

    # -- drafting ahead (tandem/engine/spec_ahead.py): on the device, the host a step behind -----
    def ready_ahead(self, req: Request) -> bool:
        """Whether the request's window is in the ring up to its computed tokens, so that it can
        draft from the device's positions on (`draft_from_ring`) for as long as it goes ahead."""
        win = self._windows.get(req.request_id)
        return win is not None and win.usable_at(req.num_computed_tokens, self.window)

    def ring_slots(self, reqs: Sequence[Request]) -> list[int]:
        return [self._windows[r.request_id].slot for r in reqs]

    def draft_from_ring(self, slots: torch.Tensor, base: torch.Tensor, known: torch.Tensor, depth: int,
                        inv_temp: torch.Tensor | None = None, gumbel: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [N, depth] and, when sampling, the q each was drawn from [N, depth, V]; device ops
        only (a step ahead's graph captures them). Request i drafts after token known[i] at
        position base[i] from the window of positions base[i] - W .. base[i] - 1 in ring slot
        slots[i] (all [N] device tensors; a window from position 0 is padded as `_gather` pads
        it). inv_temp [N] and gumbel [N, depth, V] as for `DSparkDrafter.draft_block` (zero noise
        and 1: greedy); None: every row greedy."""
        assert self._ring is not None
        n, w = len(slots), self.window
        span = torch.arange(w, device=base.device)
        index = slots[:, None] * w + (base[:, None] - w + span).clamp_min(0) % w  # [N, W]
        feats = self._ring.view(-1, self._ring.shape[2]).index_select(0, index.view(-1)).view(n, w, -1)
        tokens, probs, _ = self.drafter.draft_block(feats, known, depth, inv_temp, gumbel)
        return tokens, probs

    def draft_noise(self, rows: int, depth: int) -> torch.Tensor:
        """The Gumbel noise buffer [rows, depth, V] sampled drafts read (the sampling graphs' own
        input when captured, else one of its own)."""
        if self._gumbel is None or self._gumbel.shape[0] < rows:
            self._gumbel = torch.zeros(rows, self.kmax, self.drafter.cfg.vocab_size, device=self.device)
        return self._gumbel[:rows, :depth]

    def observe_ahead(self, slots: torch.Tensor, base: torch.Tensor, accepted: torch.Tensor, aux: torch.Tensor,
                      q: int) -> None:
        """On the device: the rows a step ahead kept go into the ring. aux [N * q, F] holds request
        i's q query rows from position base[i] on; the first 1 + accepted[i] are kept, the others
        go to slot 0, which no request holds (q <= W: no two kept rows share a place)."""
        assert self._ring is not None
        n, w = len(slots), self.window
        span = torch.arange(q, device=base.device)
        places = slots[:, None] * w + (base[:, None] + span) % w  # [N, q]
        places = torch.where(span <= accepted[:, None], places, span.expand(n, q) % w)
        self._ring.view(-1, aux.shape[1]).index_copy_(0, places.view(-1), aux[: n * q].to(self._ring.dtype))

    def land_ahead(self, request_id: str, start: int, kept: int) -> None:
        """The host's record of a window a step ahead extended (`observe_ahead`) by `kept` rows from `start`."""
        win = self._windows.get(request_id)
        if win is None:
            return
        if win.next_pos != start:  # cannot happen while the steps go ahead in order; stay safe
            win.real = 0
        win.next_pos, win.real = start + kept, min(win.real + kept, self.window)

    def remove(self, request_id: str) -> None:
        win = self._windows.pop(request_id, None)
        if win is not None:
            self._free.append(win.slot)

    def __len__(self) -> int:
        return len(self._windows)

    # -- drafting -----------------------------------------------------------------------------
    def _noise(self, reqs: Sequence[Request], sampled: Sequence[bool], inv_temp: torch.Tensor,
               gumbel: torch.Tensor) -> None:
        """Fill inv_temp [N] and Gumbel noise gumbel [N, depth, V] (the graph's inputs, or fresh
        tensors): each sampled request's noise drawn from its own generator (seeded requests stay
        reproducible); greedy rows get 1 and 0."""
        temps = []
        for j, req in enumerate(reqs):
            if sampled[j]:
                # -log(Exp(1)) is a standard Gumbel draw.
                gumbel[j].exponential_(generator=self.generator_for(req)).log_().neg_()
            else:
                gumbel[j].zero_()
            temps.append(req.params.temperature if sampled[j] else 1.0)
        inv_temp.copy_(1.0 / torch.tensor(temps), non_blocking=True)

    def _draft(self, windows: list[_Window], known: list[int], reqs: Sequence[Request],
               sampled: Sequence[bool], depth: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        n, any_sampled = len(windows), any(sampled)
        bucket = next((b for b in self._buckets if b >= n), None)
        graph = self._graphs.get((bucket, depth, any_sampled)) if bucket is not None else None
        self.count_forward("cuda_graph" if graph is not None else "eager")
        if graph is None:
            feats, known_t = self._gather(windows), host_to_device(known, torch.int64, self.device)
            if not any_sampled:
                return self.drafter.draft_block(feats, known_t, depth)
            inv_temp = torch.empty(n, device=self.device)
            gumbel = torch.empty(n, depth, self.drafter.cfg.vocab_size, device=self.device)
            self._noise(reqs, sampled, inv_temp, gumbel)
            return self.drafter.draft_block(feats, known_t, depth, inv_temp, gumbel)
        self._gather(windows, out=self._feats[:n])  # into the graph's input
        self._known[:n].copy_(host_to_device(known, torch.int64, self.device))
        if any_sampled:  # drawn straight into the graph's inputs
            self._noise(reqs, sampled, self._inv_temp[:n], self._gumbel[:n, :depth])
        graph.graph.replay()
        return graph.tokens[:n], graph.probs[:n] if graph.probs is not None else None, graph.confidence[:n]

    @torch.inference_mode()
    def measure(self, buckets: Sequence[int], depths: Sequence[int], repeats: int = 5) -> dict[tuple[int, int], float]:
        """Seconds of one greedy block forward per (batch, depth): the captured graph's replay, or
        an eager forward on zero features (for the K controller's cost model)."""
        cfg, times = self.drafter.cfg, {}
        dtype = self.drafter.fc.weight.dtype
        for b in buckets:
            for depth in depths:
                graph = self._graphs.get((b, depth, False))
                if graph is not None:
                    times[(b, depth)] = seconds_per_call(graph.graph.replay, self.device, repeats)
                    continue
                feats = torch.zeros(b, cfg.window, cfg.feature_size, dtype=dtype, device=self.device)
                known = torch.zeros(b, dtype=torch.long, device=self.device)

                def run() -> None:
                    self.drafter.draft_block(feats, known, depth)

                times[(b, depth)] = seconds_per_call(run, self.device, repeats, warm_up=True)
        return times

    def capture(self, max_num_seqs: int, max_model_len: int, prefill: tuple[int, ...] = ()) -> None:
        """Capture the drafter's block forward for every batch bucket, depth, greedy and sampling
        (its shapes do not depend on max_model_len: it reads W positions; `prefill` is not used:
        the block drafter runs no forward over a prompt)."""
        self._buckets = batch_buckets(max_num_seqs)
        cfg, dev, top = self.drafter.cfg, self.device, self._buckets[-1]
        dtype = self.drafter.fc.weight.dtype
        if self._ring is None:  # every window a batch can hold, and slot 0 (see observe_ahead)
            self._ring = torch.zeros(max_num_seqs + 1, self.window, cfg.feature_size, dtype=dtype, device=dev)
            self._free = list(range(max_num_seqs, 0, -1))
        self._ring_fixed = True
        self._feats = torch.zeros(top, cfg.window, cfg.feature_size, dtype=dtype, device=dev)
        self._known = torch.zeros(top, dtype=torch.long, device=dev)
        self._inv_temp = torch.ones(top, device=dev)
        self._gumbel = torch.zeros(top, self.kmax, cfg.vocab_size, device=dev)
        shapes = [(b, d, s) for s in (False, True) for d in reversed(self.depths) for b in reversed(self._buckets)]
        logger.info("Capturing CUDA graphs (drafter): %d shapes, DSpark blocks of %s drafts x batch buckets %s, "
                    "greedy and sampling", len(shapes), list(self.depths), list(self._buckets))
        pool, start = torch.cuda.graph_pool_handle(), time.perf_counter()
        with torch.inference_mode():
            for i, (b, depth, sampling) in enumerate(shapes):
                args = (self._feats[:b], self._known[:b], depth) + (
                    (self._inv_temp[:b], self._gumbel[:b, :depth]) if sampling else ())
                for _ in range(2):  # warm up outside the graph
                    self.drafter.draft_block(*args)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    tokens, probs, conf = self.drafter.draft_block(*args)
                self._graphs[(b, depth, sampling)] = _DraftGraph(graph, tokens, probs, conf)
                logger.info("Capturing CUDA graphs (drafter): %d/%d (batch %d, %d drafts, %s)", i + 1, len(shapes),
                            b, depth, "sampling" if sampling else "greedy")
        torch.cuda.synchronize(dev)
        logger.info("Captured %d DSpark drafter graphs in %.1f s", len(shapes), time.perf_counter() - start)
