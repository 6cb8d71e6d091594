"""The engine's speculative-decoding stage: per request, the draft depth K (the policy) and the
draft (the proposer), and the phase each request is in.

`SpecDecoder.propose(requests)` is called once per step, before scheduling, for the running
requests whose prompt is computed; it returns the drafts the scheduler is to verify. The K policy:
`adaptive: off` gives every request Kmax, `phase` gives `phase_k[phase]` from the request's
`PhaseTracker` (`choose_k`), `auto` asks the goodput controller (`tandem.spec.auto.AutoK`, built
by `start_auto` from step costs measured at start-up), which also cuts a drafted block where the
drafter's calibrated confidence falls. Either way K is cut to what the request may still
generate, so no draft reaches past max_tokens or the context.

After the step, `observe` tells the proposer what was kept and the controller what each draft
got; `observe_step` gives the controller the step's measured time.

With async scheduling a step the policy drafts nothing for is a plain decode step and goes ahead
of the step in flight like any other (`tandem/engine/inflight.py`): `plan_ahead` makes the
policy's choice for it before the tokens in flight land. So under `auto`, K = 0 is what a plain
step costs with its host work overlapped, and the controller learns that cost online like any
other (`StepCost.plain_overlaps`). With DSpark, verify steps go ahead too
(tandem/engine/spec_ahead.py): `choose_ahead` picks their K one step behind (the room leaves space
for the step in flight), `commit_ahead` records it, and `observe_ahead` tells the controller what
each draft got when the step lands, with what the draft was chosen on (`pending_choices`).

Phase trackers are fed the tokens a request kept, lazily: each call catches a tracker up with the
request's output tokens since the last call. Draft tokens are never part of a request's tokens
(they live in the step's `ScheduledRequest`), so rejected drafts never reach a tracker or an
n-gram index.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from tandem.config import SpecConfig
from tandem.core import Request
from tandem.engine.runner import ModelRunner, batch_buckets
from tandem.engine.scheduler import SchedulerOutput
from tandem.models.base import CausalLM
from tandem.spec.auto import AutoK, StepPrediction
from tandem.spec.goodput import StepCost
from tandem.spec.ngram import NgramProposer
from tandem.spec.proposer import Draft, Proposer
from tandem.spec.phase import CONTENT, Phase, PhaseMarkers, PhaseTracker
from tandem.tokenizer import Tokenizer

logger = logging.getLogger("tandem")

K_LOG_INTERVAL_S = 1.0  # rate limit of the INFO line on a request's K change
# Without graphs (eager steps) start-up measures batches up to this size; larger ones are
# extrapolated, then learned from real steps (an eager forward of a large batch is slow to time).
EAGER_MEASURE_MAX_BATCH = 8


def drafter_dir(config: SpecConfig, target_dir: str, default: str) -> Path:
    """The drafter's directory: the config's `model`, else `<target>/<default>` (the shipped demo
    model holds its drafters in `draft/` and `dspark/`). ValueError naming the key when absent."""
    if config.model is not None:
        path = Path(config.model).expanduser()
        if not path.is_dir():
            raise ValueError(f"--speculative-config: model: no such directory {path} (the {config.method} drafter)")
        return path
    path = Path(target_dir) / default
    if not path.is_dir():
        raise ValueError(f"--speculative-config: model is required for method {config.method!r}: the target has no "
                         f"{default}/ directory ({path}); give the drafter's directory")
    return path


def _config_vocab(path: Path) -> int:
    try:
        cfg = json.loads((path / "config.json").read_text())
        return int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--speculative-config: model: {path / 'config.json'} has no readable vocab_size ({e})") from None


class _Tracked:
    """A request's phase tracker and how many of its output tokens it has seen."""

    def __init__(self, tracker: PhaseTracker) -> None:
        self.tracker = tracker
        self.seen = 0
        self.k: int | None = None  # the K chosen last, for the log line when it changes


class SpecDecoder:
    """The speculative-decoding stage of one engine: K policy, proposer and phase tracking.

    Build it with `SpecDecoder.create`, which loads the drafter (checking it against the target)
    before the engine plans its memory; then the engine sizes the drafter's KV cache
    (`kv_bytes_per_block`, `allocate`), builds its runner with `aux_layers`, and captures graphs
    (`capture`)."""

    def __init__(self, config: SpecConfig, tokenizer: Tokenizer, max_model_len: int, proposer: Proposer,
                 drafter_path: Path | None = None) -> None:
        self.config = config
        self.drafter_path = drafter_path  # draft_model / dspark: the directory the drafter came from
        self.max_model_len = max_model_len
        self.proposer = proposer
        # A proposer whose `observe` feeds only prompt chunks (a draft model): a step of decodes
        # alone skips `observe` altogether.
        self._prompts_only = bool(getattr(proposer, "observes_prompt_chunks_only", False))
        self.markers = PhaseMarkers.from_tokenizer(tokenizer)
        self._tracked: dict[str, _Tracked] = {}
        self._last_k_log = -K_LOG_INTERVAL_S  # monotonic time of the last INFO line on a K change
        self._unlogged_k_changes = 0
        self.drafter_forwards: dict[str, int] = {}  # by mode, since the last take_drafter_forwards
        self.chosen_k: list[tuple[Phase, int]] = []  # (phase, K) of each request the last propose saw
        self.k_counts: Counter[tuple[Phase, int]] = Counter()  # chosen_k counted
        # (ids, phases, ks) of the last choice recorded: the same again keeps chosen_k and k_counts,
        # the very objects, which the engine takes for a held choice (counted once per run of them)
        self._recorded: tuple[list[str], list[Phase], list[int]] = ([], [], [])
        self.auto: AutoK | None = None  # adaptive auto: built by start_auto
        # (ids, ks): the depth each request was drafted at by the last propose or step ahead
        self._drafted: tuple[list[str], list[int]] = ([], [])
        # plan_ahead's choice when it drafted for some request: the next propose takes it (made
        # once per step, so a probe the controller chose is not chosen again, or lost)
        self._planned: dict[str, int] | None = None
        # The scheduler's `running_changes` when plan_ahead last found an all-zero hold for the
        # whole running batch: while it is unchanged, `repeat_zero` repeats the hold without a look
        # at the batch.
        self._zero_run: int | None = None
        self._drafter_prefilled = False  # the drafter ran prompt work since the last observe_step

    @classmethod
    def create(cls, config: SpecConfig, tokenizer: Tokenizer, max_model_len: int, target: CausalLM,
               target_dir: str, device: torch.device, max_batched_tokens: int,
               generator_for: Callable[[Request], torch.Generator]) -> SpecDecoder:
        """Load the configured proposer. Raises ValueError with one line naming the key for a
        drafter that is missing or does not fit the target."""
        spec: SpecDecoder | None = None

        def count(mode: str) -> None:
            assert spec is not None
            spec.drafter_forwards[mode] = spec.drafter_forwards.get(mode, 0) + 1
            spec._drafter_prefilled |= mode in ("prefill", "prefill_graph")

        proposer: Proposer
        path: Path | None = None
        if config.method == "ngram":
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "draft_model":
            from tandem.models.loader import load_checkpoint
            from tandem.spec.draft_model import DraftModelProposer

            path = drafter_dir(config, target_dir, "draft")
            draft_vocab = _config_vocab(path)
            DraftModelProposer.check_tokenizer(path, tokenizer, int(target.hf_config["vocab_size"]), draft_vocab)
            model = load_checkpoint(path, target.dtype, device)[0]
            if model.max_position_embeddings < max_model_len:
                logger.warning("the draft model's max_position_embeddings %d is below --max-model-len %d: it drafts "
                               "past what it was trained for", model.max_position_embeddings, max_model_len)
            proposer = DraftModelProposer(model, device, max_batched_tokens, generator_for, count)
        elif config.method == "dspark":
            from tandem.spec.dspark import DSparkDrafter, DSparkFormatError
            from tandem.spec.dspark_proposer import DSparkProposer

            path = drafter_dir(config, target_dir, "dspark")
            try:
                drafter = DSparkDrafter.from_dir(path, target.dtype, device)
            except DSparkFormatError as e:
                raise ValueError(f"--speculative-config: model: {e}") from None
            hf = target.hf_config
            try:
                drafter.check_target(int(hf["num_hidden_layers"]), int(hf["hidden_size"]), int(hf["vocab_size"]))
            except ValueError as e:
                raise ValueError(f"--speculative-config: model: {e}") from None
            drafter.bind_target(dict(target.named_parameters()), float(hf.get("rms_norm_eps", 1e-6)))
            proposer = DSparkProposer(drafter, config.num_speculative_tokens, device, generator_for, count,
                                      depths=config.draft_depths())
        else:
            raise ValueError(f"speculative method {config.method!r} is not wired into the engine")
        spec = cls(config, tokenizer, max_model_len, proposer, path)
        return spec

    def take_drafter_forwards(self) -> dict[str, int]:
        """Drafter forwards by mode (cuda_graph / eager / prefill) since the last call."""
        counts, self.drafter_forwards = self.drafter_forwards, {}
        return counts

    # -- what the engine plans around the proposer ----------------------------------------------
    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the proposer reads (DSpark), else ()."""
        return tuple(getattr(self.proposer, "aux_layers", ()))

    @property
    def min_prefill_compute(self) -> int:
        """Prompt tokens a prefix-cache hit must leave to compute: DSpark's window of hidden states."""
        return int(getattr(self.proposer, "window", 1))

    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes the proposer needs per block of the target's (a draft model's own cache)."""
        fn = getattr(self.proposer, "kv_bytes_per_block", None)
        return fn(block_size) if fn else 0

    def allocate(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if hasattr(self.proposer, "allocate"):
            self.proposer.allocate(num_blocks, block_size, enable_prefix_caching)

    def capture(self, max_num_seqs: int, max_model_len: int, prefill: tuple[int, ...] = ()) -> None:
        """CUDA graphs of the drafter's shapes (the n-gram proposer has none); `prefill`: the
        token totals of the target's prefill graphs (a draft model captures its own at them)."""
        if hasattr(self.proposer, "capture"):
            self.proposer.capture(max_num_seqs, max_model_len, prefill)

    def phase(self, req: Request) -> Phase:
        """The request's phase after the tokens it kept up to the last `propose`."""
        tracked = self._tracked.get(req.request_id)
        return tracked.tracker.phase if tracked else CONTENT

    def start_auto(self, runner: ModelRunner, max_num_seqs: int, plain_overlaps: bool = False) -> None:
        """adaptive auto: measure the target's steps per (batch bucket, q = 1 + K) and the drafter's
        per (bucket, depth) — graph replays when captured, else eager forwards — log the table,
        and build the controller. Call after graphs are captured. `plain_overlaps`: steps without
        drafts run with async scheduling (their host work overlaps the device's)."""
        depths = self.config.draft_depths()
        padded = bool(runner.graphs)
        buckets = runner.buckets if padded else batch_buckets(max_num_seqs)
        timed = buckets if padded else tuple(b for b in buckets if b <= EAGER_MEASURE_MAX_BATCH)
        start = time.perf_counter()
        verify = runner.measure([(b, 1 + k) for b in timed for k in (0, *depths)])
        measure_draft = getattr(self.proposer, "measure", None)
        draft = measure_draft(timed, depths) if measure_draft is not None else {}
        cost = StepCost(verify, draft, padded=padded, buckets=buckets, extra=_cpu_expert_cost(runner.model),
                        plain_overlaps=plain_overlaps)
        how = "graph replays" if padded else f"eager forwards up to batch {timed[-1]}, larger extrapolated"
        logger.info("adaptive auto: step costs measured in %.1f s (%s; ms, refined online from real steps):\n%s",
                    time.perf_counter() - start, how, cost.table())
        self.auto = AutoK(self.config.num_speculative_tokens, depths, cost)

    def choose_k(self, req: Request) -> int:
        """The draft depth of the `off` / `phase` policy for the request's next step, cut so that
        the draft and the token after it stay within max_tokens and the context length."""
        return max(0, min(self.config.k_for(self._track(req).tracker.phase), self.room(req)))

    def room(self, req: Request) -> int:
        """Draft tokens the request may still take: the draft and the token after it must fit."""
        return max(0, min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1)

    def propose(self, requests: Sequence[Request]) -> dict[str, Draft]:
        """Drafts for requests past their prefill (request id -> 1..K tokens); a request with K = 0
        or nothing proposed gets none and decodes one token as without speculation."""
        reqs = [r for r in requests if r.num_computed_tokens == r.num_tokens - 1]
        tracked = [self._track(r) for r in reqs]
        phases = [t.tracker.phase for t in tracked]
        ids = [r.request_id for r in reqs]
        rooms = [self.room(r) for r in reqs]
        planned, self._planned = self._planned, None
        if planned is not None and all(rid in planned for rid in ids):
            ks = [min(planned[rid], room) for rid, room in zip(ids, rooms)]
        else:
            ks = self._choose(ids, reqs, phases, rooms)
        drafts = self.proposer.propose(reqs, ks) if any(ks) else [Draft([]) for _ in reqs]
        self._drafted = (ids, list(ks))
        if self.auto is not None:
            drafts = self._refine(ids, drafts)
        cut = self.auto is not None  # auto's confidence cut is its choice
        self._record_k(tracked, ids, phases,
                       [min(k, len(d.tokens)) if cut and d.confidence is not None else k for k, d in zip(ks, drafts)])
        return {rid: d for rid, d in zip(ids, drafts) if d.tokens}

    def plan_ahead(self, requests: Sequence[Request], running_changes: int | None = None) -> bool:
        """Async scheduling: whether the step after the one in flight may be planned before its
        tokens land, i.e. whether the policy drafts nothing for any of `requests` (each about to
        decode its token in flight). The choice is made now, from the tokens landed so far: a
        phase switch the token in flight makes is seen one step late (K only changes speed, never
        the tokens), and each request's room counts that token. When the policy drafts for some
        request, the choice is kept for a speculative step ahead (`take_planned`) or, when none
        can go, for the next `propose`, which runs once the tokens have landed.

        `running_changes`: the scheduler's count of changes to its running set, when `requests`
        are all of it; an all-zero hold of auto's for them then repeats through `repeat_zero`."""
        chosen = self.choose_ahead(requests, [0] * len(requests))
        ks = self.held_ks(requests) if chosen is None else chosen
        self._zero_run = None
        if any(ks):
            self._planned = {r.request_id: k for r, k in zip(requests, ks)}
            return False
        if chosen is not None:
            self.commit_ahead(requests, ks)
        if running_changes is not None and self.auto is not None and self.auto.holds_zero([r.request_id for r in requests]):
            self._zero_run = running_changes
        return True

    def repeat_zero(self, running_changes: int) -> bool:
        """`plan_ahead` for a batch auto holds at K = 0, in O(1): True when the scheduler's running
        set is the one plan_ahead last found held (`running_changes` unchanged) and the hold has a
        step left, which it takes (`AutoK.repeat_zero`). At 1-4 requests on the demo pair a step
        of the host loop takes ~0.3 ms on the H100 box, and looking at the batch, repeating the
        hold and recording its ks cost that step several percent against no speculation."""
        if self._zero_run != running_changes:
            return False
        assert self.auto is not None
        if self.auto.repeat_zero():
            return True
        self._zero_run = None
        return False

    def choose_ahead(self, requests: Sequence[Request], in_flight: Sequence[int]) -> list[int] | None:
        """The policy's K for each request's step after the one in flight, which verifies
        in_flight[i] drafts of request i (so may add up to in_flight[i] + 1 tokens: its room
        counts them). Not recorded until `commit_ahead`. None: auto holds its last choice for
        these requests (`held_ks`, already recorded)."""
        ids = [r.request_id for r in requests]
        if self.auto is not None and (held := self.auto.repeat(ids) or self._join_hold(ids, requests)) is not None:
            if any(held):  # a batch's hold: each K within its request's room, as any choice is
                held = self.auto.within(held, [self._room_ahead(r, k) for r, k in zip(requests, in_flight)])
            if self._drafted == (ids, held):
                return None  # the last choice again: _drafted and chosen_k stand (phases tracked after)
            return held  # recorded anew: the last record was a synchronous draft's, cut by confidence
        tracked = [self._track(r) for r in requests]
        phases = [t.tracker.phase for t in tracked]
        rooms = [self._room_ahead(r, k) for r, k in zip(requests, in_flight)]
        return self._choose(ids, requests, phases, rooms)

    def _room_ahead(self, req: Request, in_flight: int) -> int:
        """The request's room for the step after the one in flight, which may add up to
        in_flight + 1 of its tokens."""
        return max(0, self.room(req) - 1 - in_flight)

    def _join_hold(self, ids: list[str], requests: Sequence[Request]) -> list[int] | None:
        """auto: the held ks for a batch of the requests a hold stands for and new ones that
        may join it: an all-zero hold, when the new ones' phases would not draft either
        (`AutoK.join_zero_hold`); a padded batch's hold at the deepest depth, when the batch's
        phases still weigh in for it (`AutoK.join_batch_hold`). None: choose."""
        assert self.auto is not None
        zero = self.auto.zero_held()
        holding = zero if zero is not None else self.auto.deepest_held()
        if holding is None or len(ids) <= len(holding):
            return None
        members = set(holding)
        new = [r for r in requests if r.request_id not in members]
        new_ids = [r.request_id for r in new]
        if zero is not None:
            phases = [self._track(r).tracker.phase for r in new]
            return [0] * len(ids) if self.auto.join_zero_hold(ids, new_ids, phases) else None
        # every request's phase: a held one may have switched (commit_ahead tracks them all next)
        phases = [self._track(r).tracker.phase for r in requests]
        return self.auto.join_batch_hold(ids, new_ids, phases)

    def held_ks(self, requests: Sequence[Request]) -> list[int]:
        """The ks of the last recorded choice for these requests: what a held one repeats."""
        return self._drafted_for([r.request_id for r in requests])

    def _drafted_for(self, ids: list[str]) -> list[int]:
        """The depth each of these requests was last drafted at (0: not drafted)."""
        drafted_ids, ks = self._drafted
        if drafted_ids == ids:  # the same batch (most steps)
            return list(ks)
        by_id = dict(zip(drafted_ids, ks))
        return [by_id.get(rid, 0) for rid in ids]

    def commit_ahead(self, requests: Sequence[Request], ks: Sequence[int]) -> None:
        """Record the K `choose_ahead` gave (or `take_planned` handed back) for a step launched ahead."""
        tracked = [self._track(r) for r in requests]
        ids = [r.request_id for r in requests]
        self._drafted = (ids, list(ks))
        self._record_k(tracked, ids, [t.tracker.phase for t in tracked], ks)

    def take_planned(self, requests: Sequence[Request]) -> list[int] | None:
        """The drafting choice `plan_ahead` kept, for a speculative step ahead of these requests
        (None when it was made for others); taken, so the next `propose` chooses afresh."""
        planned, self._planned = self._planned, None
        if planned is None or any(r.request_id not in planned for r in requests):
            return None
        return [planned[r.request_id] for r in requests]

    @property
    def can_draft_ahead(self) -> bool:
        """Whether the proposer drafts on the device from the device's positions (DSpark)."""
        return hasattr(self.proposer, "draft_from_ring")

    def pending_choices(self, requests: Sequence[Request]) -> list[object | None]:
        """auto: what each request's K was chosen on (None under the other policies), kept by a
        step ahead for `observe_ahead` (the next choice replaces it before the step lands)."""
        return [None if self.auto is None else self.auto.pending(r.request_id) for r in requests]

    def observe_ahead(self, req: Request, start: int, num_draft: int, num_accepted: int,
                      pending: object | None) -> float | None:
        """A step ahead landed for the request: its window moves on (the device kept it), and
        auto learns what the draft got. Returns the accepted tokens auto expected (None: not auto)."""
        self.proposer.land_ahead(req.request_id, start, 1 + num_accepted)
        if self.auto is None or num_draft == 0:
            return None
        return self.auto.observe(req.request_id, num_draft, num_accepted, pending)

    def _choose(self, ids: Sequence[str], reqs: Sequence[Request], phases: Sequence[Phase],
                rooms: Sequence[int]) -> list[int]:
        """The policy's K per request (auto's controller, or the off / phase rule), within `rooms`."""
        if self.auto is not None:
            return self.auto.choose(ids, phases, rooms)
        return [max(0, min(self.config.k_for(phase), room)) for phase, room in zip(phases, rooms)]

    def _record_k(self, tracked: Sequence[_Tracked], ids: Sequence[str], phases: Sequence[Phase],
                  ks: Sequence[int]) -> None:
        """The step's K per request: `chosen_k` for the metrics, and the log line when it changed.
        The choice of the step before, again (the same requests, phases and ks: DSpark at its
        deepest depth, most steps), keeps the same objects."""
        recorded = (list(ids), list(phases), list(ks))
        if recorded == self._recorded:
            return
        self._recorded = recorded
        self.chosen_k = []
        for tr, rid, phase, k in zip(tracked, ids, phases, ks):
            if k != tr.k and tr.k is not None:
                self._log_k_change(rid, tr.k, k, phase)
            tr.k = k
            self.chosen_k.append((phase, k))
        self.k_counts = Counter(self.chosen_k)

    def _refine(self, ids: Sequence[str], drafts: Sequence[Draft]) -> list[Draft]:
        """auto: cut drafts that carry the drafter's confidence where it says the rest does not pay
        (all confidences read in one device-to-host copy), when a cut can pay at all
        (`AutoK.cut_can_pay`)."""
        assert self.auto is not None
        with_conf = [i for i, d in enumerate(drafts) if d.confidence is not None and d.tokens]
        lengths = [len(d.tokens) for d in drafts]
        if not with_conf or not self.auto.cut_can_pay(lengths):
            return list(drafts)
        flat = torch.cat([drafts[i].confidence[: lengths[i]] for i in with_conf]).tolist()
        confidences: list[list[float] | None] = [None] * len(drafts)
        at = 0
        for i in with_conf:
            confidences[i], at = flat[at : at + lengths[i]], at + lengths[i]
        cuts = self.auto.refine(ids, lengths, confidences)
        return [d.cut(k) if k < n else d for d, k, n in zip(drafts, cuts, lengths)]

    def expected_accepted(self, request_id: str, num_draft: int) -> float | None:
        """auto: the accepted tokens the controller expected of the request's draft (cut to
        num_draft); None under the other policies."""
        return None if self.auto is None else self.auto.expected(request_id, num_draft)

    def observe(self, sched: SchedulerOutput, accepted: Mapping[str, int], aux: torch.Tensor | None) -> None:
        """After the step's verification: tell the proposer what each request kept (its query
        tokens less the rejected drafts), and forget the requests preempted this step."""
        batch = sched.scheduled
        if self._prompts_only and not sched.preempted and all(s.num_tokens == 1 for s in batch):
            return  # decodes only: nothing to feed, nothing verified (a K = 0 step, most steps of one)
        kept = [s.num_tokens - len(s.draft) + min(accepted.get(s.request.request_id, 0), len(s.draft))
                for s in batch]
        if (self.auto is not None and getattr(self.proposer, "prefill_is_optional", False)
                and any(s.num_tokens > 1 and not s.draft for s in batch)):
            # A drafter that catches up by itself (a draft model) skips the prompt of a request
            # the controller would not draft for now: prefilling it alongside the target is
            # time spent for nothing if the request never drafts.
            keep = [i for i, s in enumerate(batch)
                    if s.draft or s.num_tokens == 1 or self._drafts_now(s.request, len(batch))]
            if len(keep) < len(batch):
                batch, kept = [batch[i] for i in keep], [kept[i] for i in keep]
        self.proposer.observe(batch, kept, aux)
        if self.auto is not None and accepted:  # (a step without drafts verified none)
            for s in sched.scheduled:
                if s.draft:
                    self.auto.observe(s.request.request_id, len(s.draft), accepted.get(s.request.request_id, 0))
        for req in sched.preempted:
            self.remove(req.request_id)

    def _drafts_now(self, req: Request, batch: int) -> bool:
        """auto: whether the controller would draft for this request in its phase now."""
        assert self.auto is not None
        return self.auto.drafts_now(self._track(req).tracker.phase, batch)

    @property
    def drafter_prefilled(self) -> bool:
        """Whether the drafter ran prompt work since the last `observe_step`: that call must come
        (it tells a draft model's catch-up from a plain step)."""
        return self._drafter_prefilled

    def take_drafter_prefilled(self) -> bool:
        """Whether the drafter ran prompt work since the last `observe_step` or call of this one
        (the flag is cleared): for a step launched ahead, whose landing waits for that work."""
        prefilled, self._drafter_prefilled = self._drafter_prefilled, False
        return prefilled

    def step_kind_known(self, sched: SchedulerOutput) -> bool:
        """auto: whether steps like this one (its batch bucket, drafting or not) refined the cost
        model often enough (`StepCost.known`) that the engine may time only a sample of them."""
        assert self.auto is not None
        batch = sched.scheduled
        return self.auto.cost.known(len(batch), any(s.draft for s in batch))

    def observe_step(self, sched: SchedulerOutput, seconds: float, drafted: Sequence[int] | None = None,
                     prefilled: bool | None = None) -> StepPrediction | None:
        """auto: a step took `seconds` (propose to postprocess). A step of decodes and verifies
        refines the cost model and returns its prediction; one with the target's prompt work
        returns None (every engine pays for it).

        `prefilled`: whether the step's time holds the drafter's own prompt work (a draft model
        catching up on a prompt, or on tokens it skipped while K was 0); a step that went ahead
        carries it from its launch; None: whether the drafter ran any since the last call. Such a
        step is what resuming costs (`AutoK.observe_catch_up`). When it drafted, it also refines
        the drafting cost: catch-ups are part of what drafting costs a draft model, and at 16
        requests (a new request every few steps, requests going in and out of K = 0) they are
        many. When it did not, its time is no plain step's cost (learned as one, it made K = 0
        look dear)."""
        if prefilled is None:
            prefilled = self.take_drafter_prefilled()
        if self.auto is None or not sched.scheduled:
            return None
        if sched.has_prompt_work:
            return None
        ks = [len(s.draft) for s in sched.scheduled]
        if drafted is None:  # `drafted`: the depths a step ahead drafted at (chosen before the last choice)
            drafted = self._drafted_for([s.request.request_id for s in sched.scheduled])
        if prefilled:
            self.auto.observe_catch_up(ks, drafted, seconds)
            if not any(ks):
                return None
        return self.auto.observe_step(ks, drafted, seconds)

    def _log_k_change(self, request_id: str, old: int, new: int, phase: Phase) -> None:
        """An INFO line when a request's K changes, at most one per K_LOG_INTERVAL_S (the next line
        says how many changes went unlogged meanwhile); every change at DEBUG."""
        now = time.monotonic()
        if now - self._last_k_log < K_LOG_INTERVAL_S:
            self._unlogged_k_changes += 1
            logger.debug("request %s: K %d -> %d (phase=%s)", request_id, old, new, phase)
            return
        more = f" (+{self._unlogged_k_changes} more K changes since the last line)" if self._unlogged_k_changes else ""
        logger.info("request %s: K %d -> %d (phase=%s)%s", request_id, old, new, phase, more)
        self._last_k_log, self._unlogged_k_changes = now, 0

    def remove(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self._tracked.pop(request_id, None)
        self.proposer.remove(request_id)
        if self.auto is not None:
            self.auto.remove(request_id)

    def _track(self, req: Request) -> _Tracked:
        tracked = self._tracked.get(req.request_id)
        if tracked is None:
            tracked = self._tracked[req.request_id] = _Tracked(PhaseTracker(self.markers, req.prompt_token_ids))
        out = req.output_token_ids
        if tracked.seen < len(out):
            tracked.tracker.update(out[tracked.seen :])
            tracked.seen = len(out)
        return tracked


def _cpu_expert_cost(model: object) -> Callable[[Sequence[int]], float] | None:
    """With routed experts in RAM: the extra seconds of the experts a step's real tokens route to
    (tandem/offload/placement.py `cpu_expert_step_cost`), at this machine's measured RAM read
    bandwidth. None when every expert is on the device."""
    sink = getattr(model, "cpu_experts", None)
    if sink is None or not sink.placement.offloaded:
        return None
    from tandem.offload import cpu_experts
    from tandem.offload.placement import cpu_expert_step_cost

    bandwidth = cpu_experts.measure_read_bandwidth(256 << 20)
    logger.info("adaptive auto: experts in RAM on %d layers; a step's extra distinct experts cost %.1f GB/s reads",
                len(sink.placement.cpu_layers), bandwidth / 1e9)
    return cpu_expert_step_cost(sink.placement, bandwidth)
