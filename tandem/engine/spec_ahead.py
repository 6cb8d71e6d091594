"""Speculative steps that go ahead: draft, verify and accept on the device, the host one step behind.

A synchronous speculative step waits for the host twice: the drafts must reach the host before
the verify is staged, and the accepted counts before the next draft. On a small target those
waits and the host work between them are most of a step (the demo pair: ~0.45 ms of device
work in a ~1 ms step). A step ahead is launched while its predecessor is still in flight and
needs nothing from it on the host; everything that depends on what the predecessor accepted is
computed on the device, queued behind it:

1. each request's query starts where the predecessor's kept tokens end: the host stages the
   step as if nothing was accepted and the device shifts positions, lengths and slots by the
   accepted count (`ModelRunner.execute_ahead`);
2. DSpark drafts a block from the window of hidden states ending there, after the token the
   predecessor added (its correction or bonus token), read on the device
   (`DSparkProposer.draft_ahead`);
3. the verify graph replays, and acceptance runs on the device: greedy (`accept_on_device`), or
   rejection sampling when a request samples (`accept_sampled_on_device`, with noise drawn from
   each request's generator before the launch);
4. the kept rows' hidden states go into the ring (`DSparkProposer.observe_ahead`);
5. the accepted counts, the tokens and the drafts are copied to pinned host memory.

Then the host lands the predecessor (`SpecAhead.land`): tokens appended and checked for stops
exactly as a synchronous step appends them, the computed counts advanced, the KV blocks trimmed
to what is kept plus what the step in flight may still write, the controller told what each
draft got. A request that the landed tokens stop has a wasted row in the step in flight, dropped
when that step lands.

KV: a step ahead allocates slots for the largest outcome of the step before it (every draft
accepted) plus its own query; what the outcome leaves unused is given back at landing.

What goes ahead (`SpecAhead.eligible`): a batch of decoding requests only (no prefill, nobody
waiting to be admitted), each greedy or sampling without penalties, min_tokens left or logprobs
(its target distribution is then the filtered softmax of its rows), without a grammar, with its
DSpark window in the ring, and with room for the step in flight's largest outcome before its
max_tokens or the context ends. Anything else lands the
step in flight and runs the synchronous step. The proposer must draft on the device (DSpark);
the model's KV groups must be plain paged attention (`unsupported` says why not, once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.core import Request, RequestStatus
from tandem.engine.inflight import InFlightStep
from tandem.engine.runner import ModelRunner
from tandem.engine.runner_ahead import AheadInputs
from tandem.engine.sampler import filter_logits_batch
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.engine.static_inputs import host_to_device
from tandem.kv.manager import KVCacheManager
from tandem.spec.controller import SpecDecoder
from tandem.spec.verify import VerifyResult, is_plain_greedy, is_plain_sampled


def accept_on_device(logits: torch.Tensor, drafts: torch.Tensor | None, ks: torch.Tensor, q: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of N requests at once, on the device. logits [N * q, V]: request i's
    q rows (its 1 + ks[i] query tokens, then pads); drafts [N, >= q - 1] (None when q = 1).
    Returns (accepted [N] int64, tokens [N, q] int64): request i keeps drafts[i, :accepted[i]]
    followed by tokens[i, accepted[i]], the target's argmax there (the correction, or the bonus
    token after every draft); tokens[i, :accepted[i]] are those drafts. The same rule as
    `accept_greedy`, on the same rows."""
    n = ks.shape[0]
    target = logits.view(n, q, -1).argmax(dim=-1)  # [N, q]
    if q == 1:
        return torch.zeros(n, dtype=torch.int64, device=logits.device), target
    assert drafts is not None
    proposed = drafts[:, : q - 1]
    live = torch.arange(q - 1, device=logits.device) < ks[:, None]  # [N, q - 1]: real drafts
    accepted = ((proposed == target[:, :-1]) & live).long().cumprod(dim=1).sum(dim=1)  # [N]
    tokens = torch.cat([proposed, target[:, -1:]], dim=1)
    tokens.scatter_(1, accepted[:, None], target.gather(1, accepted[:, None]))
    return accepted, tokens


def accept_sampled_on_device(logits: torch.Tensor, drafts: torch.Tensor | None, draft_probs: torch.Tensor | None,
                             ks: torch.Tensor, q: int, sampling: dict[str, torch.Tensor], uniform: torch.Tensor,
                             gumbel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_on_device` for a batch with sampled requests: rejection sampling (tandem/spec/verify.py
    states the rule) on the device, with the noise drawn beforehand from each request's generator.

    logits [N * q, V]; drafts [N, >= q - 1] and draft_probs [N, >= q - 1, V] (the q each draft was
    drawn from) or None when q = 1; sampling: [N] tensors temp, topk, topp, minp (the target's p
    is the sampler's: filtered, then softmax) and greedy (1: the row's p is one-hot at its argmax
    and its drafts deterministic, so it accepts and corrects exactly as `accept_greedy`);
    uniform [N, >= q - 1] U(0, 1) draws for the acceptance tests; gumbel [N, V] standard Gumbel
    noise (0 for greedy rows) for the one token drawn from norm(max(0, p - q)) at the first
    rejection, or from p after the last draft (the Gumbel-max trick: argmax(log f + g) is a draw
    from f). Returns (accepted [N], tokens [N, q]) as `accept_on_device` does."""
    n, vocab = ks.shape[0], logits.shape[1]
    rows = logits.view(n * q, vocab)
    rep = {k: v[:, None].expand(n, q).reshape(-1) for k, v in sampling.items()}  # per row of logits
    p = torch.softmax(filter_logits_batch(rows, rep["temp"], rep["topk"], rep["topp"], rep["minp"]), dim=-1)
    greedy = sampling["greedy"].bool()
    # One-hot by scatter (no host check of the indices: the graph captures it).
    onehot = torch.zeros_like(p).scatter_(1, rows.argmax(dim=-1, keepdim=True), 1.0)
    p = torch.where(rep["greedy"].bool()[:, None], onehot, p).view(n, q, vocab)
    if q == 1:
        final = p[:, 0]
        accepted = torch.zeros(n, dtype=torch.int64, device=logits.device)
        return accepted, (final.log() + gumbel).argmax(dim=-1)[:, None]
    assert drafts is not None and draft_probs is not None
    x = drafts[:, : q - 1]  # [N, q - 1]
    # q of each draft: the drafter's distribution, one-hot at the draft for a greedy row.
    at_draft = torch.zeros(n, q - 1, vocab, dtype=p.dtype, device=p.device).scatter_(2, x[..., None], 1.0)
    q_draft = torch.where(greedy[:, None, None], at_draft, draft_probs[:, : q - 1].to(p.dtype))  # [N, q - 1, V]
    p_x = p[:, : q - 1].gather(2, x[..., None])[..., 0]
    q_x = q_draft.gather(2, x[..., None])[..., 0]
    live = torch.arange(q - 1, device=logits.device) < ks[:, None]
    accept = (uniform[:, : q - 1] * q_x < p_x) & (q_x > 0) & live
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [N]
    residual = (p[:, : q - 1] - q_draft).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass, p[:, : q - 1])  # p == q: rounding's rejection
    at = accepted.clamp(max=q - 2)[:, None, None].expand(n, 1, vocab)
    from_residual = residual.gather(1, at)[:, 0]
    bonus = p.gather(1, ks[:, None, None].expand(n, 1, vocab))[:, 0]  # after all K_i drafts
    final = torch.where((accepted == ks)[:, None], bonus, from_residual)  # [N, V]
    token = (final.log() + gumbel).argmax(dim=-1)
    tokens = torch.cat([x, token[:, None]], dim=1)
    tokens.scatter_(1, accepted[:, None], token[:, None])
    return accepted, tokens


@dataclass
class SpecAheadStep:
    """A speculative step launched ahead (see the module docstring); its results on their way to
    the host. `starts` are exact once the step before it has landed (`SpecAhead.land` shifts them)."""

    requests: list[Request]
    starts: list[int]  # each request's first query position
    ks: list[int]  # drafts verified per request
    pendings: list[object | None]  # what auto chose each K on (SpecDecoder.pending_choices)
    host: torch.Tensor  # [N, columns] the results' rows (SpecAhead's layout), pinned on CUDA
    copied: torch.cuda.Event | None
    chained: bool  # launched ahead of another step in flight
    index: dict[str, int] = field(init=False)  # request id -> row

    def __post_init__(self) -> None:
        self.index = {r.request_id: i for i, r in enumerate(self.requests)}


class SpecAhead:
    """Launches and lands speculative steps ahead for one engine (its runner, KV manager,
    scheduler and speculative stage). It keeps the last step's results on the device, one row per
    request (`results`: accepted count, last token, the tokens, the drafts), which the next step
    reads (`before`) and overwrites (`after`): with graphs, the whole step is one replay
    (`ModelRunner.execute_ahead`)."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler, spec: SpecDecoder,
                 max_num_seqs: int, generator_for: Callable[[Request], torch.Generator],
                 prompt_tokens: int = 0) -> None:
        self.runner, self.kv, self.scheduler, self.spec = runner, kv, scheduler, spec
        self.proposer = spec.proposer
        self.max_num_seqs = max_num_seqs
        self.device = runner.device
        self.generator_for = generator_for  # a sampled request's noise comes from its generator
        kmax = spec.config.num_speculative_tokens
        self.max_q = 1 + kmax
        # Row r: [accepted, last token, tokens (max_q), drafts (kmax)]; row max_num_seqs stays 0.
        self.results = torch.zeros(max_num_seqs + 1, 2 + self.max_q + kmax, dtype=torch.int64, device=self.device)
        self.zero_row = max_num_seqs
        self._tokens_at, self._drafts_at = 2, 2 + self.max_q
        # Sampled steps' noise, drawn before each launch (the graph reads these rows): the
        # acceptance tests' uniforms and the Gumbel noise of the one token drawn at the end.
        vocab = self.proposer.drafter.cfg.vocab_size
        self.uniform = torch.zeros(max_num_seqs + 1, max(kmax, 1), device=self.device)
        self.final_gumbel = torch.zeros(max_num_seqs + 1, vocab, device=self.device)
        self.sampled_ahead = True  # False when the sampled graphs failed to capture (ModelRunner says why)
        # --prefill-graph-max-tokens: the most tokens of a prompt step that drafts nothing to go ahead
        # when the runner has no graphs (eager); with graphs, the largest prefill graph (plain_for_prompt).
        self.prompt_tokens = prompt_tokens

    @staticmethod
    def unsupported(spec: SpecDecoder, kv: KVCacheManager) -> str | None:
        """Why speculative steps cannot go ahead with this proposer and model, or None."""
        if not spec.can_draft_ahead:
            return f"the {spec.config.method} proposer drafts on the host"
        kinds = {g.spec.kind for g in kv.groups}
        if kinds != {"full"}:
            return f"the model's KV cache has {sorted(kinds - {'full'})} groups (positions move on the host)"
        window = getattr(spec.proposer, "window", 0)
        if spec.config.num_speculative_tokens + 1 > window:
            return f"num_speculative_tokens + 1 exceeds the DSpark window {window}"
        return None

    # -- around the target's forward (ModelRunner.execute_ahead; a graph captures these) -----------
    def depth(self, q: int) -> int:
        return next(d for d in self.proposer.depths if d >= q - 1) if q > 1 else 0  # a captured block depth

    def before(self, meta: dict[str, torch.Tensor], depth: int, sampled: bool) -> AheadInputs:
        """Each request's shift and first token from the predecessor's row `pick`, its first
        position, and DSpark's drafts from the ring window ending there (sampled at each row's
        temperature with the noise `launch` drew, when `sampled`)."""
        prev = self.results.index_select(0, meta["pick"])
        shift, known = prev[:, 0], prev[:, 1]
        base = meta["start"] + shift
        if not depth:
            return AheadInputs(shift, known, base, None)
        if not sampled:
            return AheadInputs(shift, known, base, self.proposer.draft_from_ring(meta["slot"], base, known, depth)[0])
        n = meta["slot"].shape[0]
        drafts, probs = self.proposer.draft_from_ring(meta["slot"], base, known, depth, 1.0 / meta["temp"],
                                                      self.proposer.draft_noise(n, depth))
        return AheadInputs(shift, known, base, drafts, probs)

    def after(self, q: int, logits: torch.Tensor, aux: torch.Tensor | None, inputs: AheadInputs,
              meta: dict[str, torch.Tensor], sampled: bool) -> None:
        """Accept (greedy, or by rejection sampling), keep the kept rows' hidden states in the
        ring, write the results' rows."""
        if aux is None:
            raise RuntimeError("a DSpark step ahead needs the target runner's aux-layer outputs")
        ks, n = meta["ks"], meta["ks"].shape[0]
        if sampled:
            sampling = {f: meta[f] for f in ("temp", "topk", "topp", "minp", "greedy")}
            accepted, tokens = accept_sampled_on_device(logits, inputs.drafts, inputs.draft_probs, ks, q, sampling,
                                                        self.uniform[:n], self.final_gumbel[:n])
        else:
            accepted, tokens = accept_on_device(logits, inputs.drafts, ks, q)
        self.proposer.observe_ahead(meta["slot"], inputs.base, accepted, aux, q)
        out = self.results
        out[:n, 0].copy_(accepted)
        out[:n, 1].copy_(tokens.gather(1, accepted[:, None]).view(-1))
        out[:n, self._tokens_at : self._tokens_at + q].copy_(tokens)
        if inputs.drafts is not None:
            out[:n, self._drafts_at : self._drafts_at + q - 1].copy_(inputs.drafts[:, : q - 1])

    def _draw_noise(self, reqs: list[Request], depth: int) -> None:
        """Each sampled request's noise for the step from its generator (seeded ones stay
        reproducible): Kmax uniforms, the final token's Gumbel row and the drafter's Gumbel
        rows; zeros for a greedy request (its acceptance and tokens are the argmax's)."""
        drafter = self.proposer.draft_noise(len(reqs), depth) if depth else None
        for i, req in enumerate(reqs):
            if req.params.greedy:
                self.final_gumbel[i].zero_()
                if drafter is not None:
                    drafter[i].zero_()
                continue
            gen = self.generator_for(req)
            self.uniform[i].uniform_(generator=gen)
            # -log(Exp(1)) is a standard Gumbel draw.
            self.final_gumbel[i].exponential_(generator=gen).log_().neg_()
            if drafter is not None:
                drafter[i].exponential_(generator=gen).log_().neg_()

    # -- planning ---------------------------------------------------------------------------------
    def eligible(self, prev: InFlightStep | SpecAheadStep | None) -> list[Request] | None:
        """The requests a step ahead of `prev` (None: no step in flight) would run: every running
        request, when each qualifies (module docstring); else None."""
        sched = self.scheduler
        running = sched.running
        if not running or (sched.waiting and len(running) < self.max_num_seqs):
            return None
        if isinstance(prev, SpecAheadStep):
            rows = prev.index
        elif isinstance(prev, InFlightStep):
            rows = prev.sampling_rows
        else:
            rows = None
        for req in running:
            if rows is not None and req.request_id not in rows:
                return None
            if rows is None and req.num_computed_tokens != req.num_tokens - 1:
                return None  # prefill work left
            plain = is_plain_greedy(req) or (self.sampled_ahead and is_plain_sampled(req))
            if req.params.grammar is not None or not plain or not self.proposer.ready_ahead(req):
                return None
            ahead = prev.ks[prev.index[req.request_id]] + 1 if isinstance(prev, SpecAheadStep) else int(rows is not None)
            if self.spec.room(req) < ahead:
                return None  # the step in flight may end it
        return list(running)

    def plain_for_prompt(self) -> bool:
        """Whether the next synchronous step should draft nothing, so that it goes ahead as a plain
        step (`can_go_ahead`) and the steps ahead resume right after it: it will run prompt work
        that a prefill graph holds (a running request's prompt chunk, or the first waiting
        request admitted: its chunk and one block per running request fit the free blocks), and
        no request has a grammar. With drafts, that step would verify synchronously: land the
        drafter's forward, then the verify, each a wait on the device (3-4 ms a step at 4 and 16
        requests on the H200, against 1 ms for the plain prefill step). A longer step keeps its
        drafts (more than the largest prefill graph holds; eager, `prompt_tokens`): its own
        forward outweighs the waits."""
        sched, graphs = self.scheduler, self.runner.prefill_graphs
        cap = max(graphs, default=0) if self.runner.graphs else self.prompt_tokens
        running = sched.running
        head = sched.waiting[0] if sched.waiting else None
        if not cap or any(r.params.grammar is not None for r in (running if head is None else [*running, head])):
            return False
        budget = sched.config.batched_tokens
        pending = sum(r.num_tokens - r.num_computed_tokens for r in running)  # decodes 1; prompts their rest
        if any(r.num_computed_tokens < r.num_tokens - 1 for r in running):
            return min(pending, budget) <= cap
        if head is None or len(running) >= self.max_num_seqs:
            return False
        chunk = min(head.num_tokens - head.num_computed_tokens, budget - pending)
        return (chunk > 0 and pending + chunk <= cap
                and self.kv.blocks_needed(chunk) + len(running) <= self.kv.num_free_blocks)

    def in_flight_drafts(self, reqs: list[Request], prev: InFlightStep | SpecAheadStep | None) -> list[int]:
        """Drafts the step in flight verifies for each request (0 for a plain step or none)."""
        if not isinstance(prev, SpecAheadStep):
            return [0] * len(reqs)
        return [prev.ks[prev.index[r.request_id]] for r in reqs]

    # -- launch -----------------------------------------------------------------------------------
    def launch(self, reqs: list[Request], ks: list[int], prev: InFlightStep | SpecAheadStep | None,
               pendings: list[object | None], asleep: bool = False) -> tuple[SpecAheadStep, str] | None:
        """Queue a step ahead of `prev` (see the module docstring); returns it and how it ran
        (`ForwardOutput.mode`). None, launching nothing, when a request's slots do not fit (the
        synchronous step then preempts). `asleep`: its landing waits for its tokens asleep
        (`LLMEngine.waits_asleep`)."""
        params = [r.params for r in reqs]
        sampled = not all(p.greedy for p in params)
        if not self.runner.can_run_ahead(len(reqs), 1 + max(ks), sampled):
            return None  # a sampled batch beyond the captured buckets: the synchronous step
        behind = self.in_flight_drafts(reqs, prev)
        # The first query position as if `prev` accepted nothing: a step ahead's requests did not
        # advance at its launch (they advance when it lands); a plain step's did.
        starts = [r.num_computed_tokens + (1 if isinstance(prev, SpecAheadStep) else 0) for r in reqs]
        for i, (req, start, b, k) in enumerate(zip(reqs, starts, behind, ks)):
            # Through position start + b + k: the step in flight's largest outcome, then this query.
            if not self.kv.allocate_slots(req, start + b + k + 1 - req.num_computed_tokens):
                for done, d in zip(reqs[:i], behind):  # give back what this launch took: the in flight step's stays
                    self.kv.trim(done, done.num_computed_tokens + (d + 1 if isinstance(prev, SpecAheadStep) else 0))
                return None
        n = len(reqs)
        if isinstance(prev, SpecAheadStep):
            picks = [prev.index[r.request_id] for r in reqs]
        else:  # the results' rows start from the plain step's sampled tokens, or the host's last tokens
            if isinstance(prev, InFlightStep):
                picks = [prev.sampling_rows[r.request_id] for r in reqs]
                last = prev.tokens
            else:
                picks = list(range(n))
                last = host_to_device([r.all_token_ids[-1] for r in reqs], torch.int64, self.device)
            self.results[: len(last), 0].zero_()
            self.results[: len(last), 1].copy_(last)
        meta = {"start": starts, "ks": list(ks), "slot": self.proposer.ring_slots(reqs), "pick": picks,
                "temp": [1.0 if p.greedy else p.temperature for p in params], "topk": [p.top_k for p in params],
                "topp": [p.top_p for p in params], "minp": [p.min_p for p in params],
                "greedy": [int(p.greedy) for p in params]}
        if sampled:
            self._draw_noise(reqs, self.depth(1 + max(ks)))
        batch = [ScheduledRequest(r, s, 1 + k, True, (0,) * k, input_row=i)
                 for i, (r, s, k) in enumerate(zip(reqs, starts, ks))]
        mode = self.runner.execute_ahead(batch, meta, self, sampled)
        if any(ks):  # the drafter's block forward ran inside the step (`before`: its graph, or eagerly)
            self.proposer.count_forward("cuda_graph" if mode == "cuda_graph" else "eager")
        rows = self.results[:n]
        host, copied = rows, None
        if self.device.type == "cuda":
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            copied = torch.cuda.Event(blocking=asleep)
            copied.record()
        else:
            host = rows.clone()
        step = SpecAheadStep(list(reqs), starts, list(ks), pendings, host, copied, chained=prev is not None)
        return step, mode

    # -- landing ----------------------------------------------------------------------------------
    def land(self, step: SpecAheadStep, succ: SpecAheadStep | None
             ) -> tuple[SchedulerOutput, list[tuple[ScheduledRequest, VerifyResult]], dict[str, float | None]]:
        """The step's results on the host: its batch as it ran (exact starts, the drafts), each
        request's tokens, and what auto expected of each draft. Advances the requests still
        running, trims their blocks to what they keep plus what `succ` (the step launched after
        it, in flight) may still write, and moves `succ`'s starts by what this step accepted."""
        if step.copied is not None:
            step.copied.synchronize()
        rows = step.host.tolist()
        sched, results, expected = SchedulerOutput(), [], {}
        for i, req in enumerate(step.requests):
            k, n, start = step.ks[i], rows[i][0], step.starts[i]
            s = ScheduledRequest(req, start, 1 + k, True, tuple(rows[i][self._drafts_at : self._drafts_at + k]))
            sched.scheduled.append(s)
            results.append((s, VerifyResult(rows[i][self._tokens_at : self._tokens_at + n + 1], n)))
            j = succ.index.get(req.request_id) if succ is not None else None
            if j is not None:
                succ.starts[j] += n
            if req.status != RequestStatus.RUNNING:
                continue  # stopped by the step before, or aborted: its row was wasted
            assert req.num_computed_tokens == start, "steps ahead land in order"
            req.num_computed_tokens = start + 1 + n
            reserve = 1 + succ.ks[j] if j is not None else 0  # the query of the step in flight
            self.kv.trim(req, req.num_computed_tokens + reserve)
            expected[req.request_id] = self.spec.observe_ahead(req, start, k, n, step.pendings[i])
        return sched, results, expected
