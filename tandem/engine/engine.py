"""LLMEngine: add requests, step, abort. One step is propose -> schedule -> run -> sample (or
verify drafts) -> tell the proposer what was kept -> postprocess.

A request that fails inside a step ends alone, with finish_reason "error", and the engine goes on
serving the others; only a failure the engine cannot recover from (a device error, steps failing
one after another) raises EngineFatalError out of `step`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import torch

from tandem.config import EngineConfig
from tandem.core import ErrorKind, ParamError, Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs
from tandem.engine import startup
from tandem.engine.ahead_steps import AheadSteps
from tandem.engine.errors import MAX_FAILED_STEPS, EngineFatalError, brief, raise_if_fatal
from tandem.engine.inflight import InFlightStep, can_go_ahead
from tandem.engine.metrics import EngineMetrics, StatsWindow
from tandem.engine.output import RequestState, take_token
from tandem.engine.runner import ForwardOutput, ModelRunner, allocate_kv_caches
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.engine.spec_ahead import SpecAhead, SpecAheadStep
from tandem.engine.step_sampling import sample_step
from tandem.engine.structured import StructuredOutputs
from tandem.engine.validation import check_prompt
from tandem.kv.manager import KVCacheManager
from tandem.models.base import CausalLM
from tandem.models.loader import inspect_checkpoint, load_checkpoint
from tandem.spec.controller import SpecDecoder
from tandem.spec.proposer import Draft
from tandem.spec.verify import VerifyResult
from tandem.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("tandem")

GiB = 1024**3
HELD_STEPS_TIMED = 8  # one step in this many refines the step-cost model, once its kind is known (`_time_step`)
MAX_HELD_UNCOUNTED = 64  # a held K choice's repeats are counted at least this often (`_count_spec_step`)


class LLMEngine(AheadSteps):
    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        """Load the checkpoint at config.model.model. `model`, if given, is used instead of the
        checkpoint's weights (benchmarks on random weights); the directory still supplies
        config.json and the tokenizer."""
        self.config = config
        mc = config.model
        self.device = torch.device(mc.device)
        self.tokenizer = Tokenizer.from_dir(mc.model).with_generation_config(mc.generation_config)
        defaults = self.tokenizer.generation_defaults
        logger.info("Sampling defaults for fields a request leaves out: %s (--generation-config %s)",
                    ", ".join(f"{k} {v}" for k, v in defaults.items()) or "Tandem's own", mc.generation_config)
        self.model_name = mc.served_model_name or Path(mc.model).resolve().name
        planned = None  # the step's token budget the memory plan is for (a model given: not planned here)
        if model is None:
            info = inspect_checkpoint(mc.model)  # validates every file before memory is touched
            sink, planned = startup.plan_placement(config, self.device, info)  # where the routed experts go
            model = load_checkpoint(mc.model, mc.dtype, self.device, sink=sink, info=info)[0]
        self.model = model
        self.runner_config = startup.fit_to_model(config.runner, config.runner.resolve(self.device.type, mc.dtype),
                                                  model)
        startup.set_cpu_threads(self.model, self.device, config.runner, self.runner_config)
        startup.install_kernels(self.model, self.runner_config, self.device)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.vocab_size = int(self.model.hf_config["vocab_size"])
        self.max_model_len = mc.max_model_len or self.model.max_position_embeddings
        tokens = startup.batched_tokens(config, model, planned, self.max_model_len)  # auto resolved from here on
        config = self.config = replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=tokens))
        if mc.max_model_len and mc.max_model_len > self.model.max_position_embeddings:
            logger.warning(
                "--max-model-len %d exceeds the model's max_position_embeddings %d; outputs past it "
                "are not what the model was trained for", mc.max_model_len, self.model.max_position_embeddings,
            )
        self.sampler = Sampler(self.device, mc.seed)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size)
        self._hot_online = getattr(getattr(self.model, "cpu_experts", None), "online", None)  # --hot-experts online
        self.spec = self._load_spec() if config.spec.enabled else None
        groups = startup.cache_groups(self.model, config.cache.kv_cache_dtype)
        block_size = config.cache.block_size
        budget = startup.kv_cache_budget(config, self.model, self.device, self.max_model_len)
        num_blocks = startup.plan_kv_blocks(config, groups, budget, self.max_model_len,
                                            self.spec.kv_bytes_per_block(block_size) if self.spec else 0)
        min_compute = self.spec.min_prefill_compute if self.spec else 1
        self.kv = KVCacheManager(groups, num_blocks, block_size, config.cache.enable_prefix_caching, min_compute,
                                 num_state_slots=config.scheduler.max_num_seqs)
        self.kv_caches = allocate_kv_caches(self.model, self.kv, self.device)
        if self.spec is not None:
            self.spec.allocate(self.kv.pools[0].num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.model, self.kv, self.device, self.spec.aux_layers if self.spec else ())
        self._spec_ahead = self._speculative_steps_ahead()
        self._capture_graphs()
        self._in_flight: InFlightStep | SpecAheadStep | None = None  # async scheduling: launched, not landed
        self._ahead_failure: tuple[Exception, list[Request]] | None = None  # a step ahead's launch raised
        self.num_async_steps = 0  # steps left in flight at launch
        self.async_scheduling = config.scheduler.async_scheduling  # resolved and logged by its setter
        # Whether the host waits for a step's tokens asleep (blocking-sync events) rather than
        # spinning on a core, CUDA's default. With routed experts in RAM a step takes ~40 ms (the V4
        # shape) and the expert kernel's threads want every core but one, which the spinning wait
        # takes; off until an A/B shows it pays (`bench_offload.py --host-wait spin,asleep`). A
        # benchmark may switch it between steps.
        self.waits_asleep = False
        if self.spec is not None and config.spec.adaptive == "auto":
            self.spec.start_auto(self.runner, config.scheduler.max_num_seqs, plain_overlaps=self.async_scheduling)
        self.metrics = EngineMetrics(self.model_name)
        self.states: dict[str, RequestState] = {}
        self._window = StatsWindow(time.monotonic())
        self._prefix_reported = (0, 0)  # prefix-cache counters already pushed to Prometheus
        self._failed_steps = 0  # steps in a row that failed as a whole (see _fail_step)
        # When the last step's results were ready, while requests remain (None after the engine
        # ran dry): adaptive auto times each step from there, so a step's time is what it adds to
        # the wall clock, whether its host work overlapped the device's (async) or not.
        self._results_at: float | None = None
        # A K choice repeated unchanged (auto holding an all-zero one: the same counts object step
        # after step) is counted once per run of repeats (`_count_spec_step`): those are host-bound
        # steps, where a dozen metric updates a step show. `_k_repeats` steps wait to be counted.
        self._k_seen: Mapping[tuple[str, int], int] | None = None
        self._k_repeats = 0
        self._untimed = 0  # steps since the last one auto's cost model was given (`_time_step`)
        startup.log_ready(self, num_blocks, block_size)

    # -- start-up planning ------------------------------------------------------------------
    def _load_spec(self) -> SpecDecoder:
        """The speculative-decoding stage, its drafter loaded and checked against the target (before
        the KV cache is planned: a draft model's own cache shares the budget)."""
        sc, mc = self.config.spec, self.config.model
        startup.check_spec_fits_the_model(self.model, sc)
        spec = SpecDecoder.create(sc, self.tokenizer, self.max_model_len, self.model, mc.model, self.device,
                                  self.config.scheduler.max_num_batched_tokens, self.sampler.generator_for)
        draft_model = getattr(spec.proposer, "model", None)
        if draft_model is not None:  # a draft model runs Tandem's layers: it gets the target's kernels
            startup.install_kernels(draft_model, self.runner_config, self.device, log=False)
        if sc.method == "ngram":
            detail = f"n-gram {sc.prompt_lookup_min}..{sc.prompt_lookup_max}"
        else:
            detail = f"drafter {spec.drafter_path}"
        phase_k = f", phase_k {dict(sc.phase_k)}" if sc.adaptive == "phase" else ""
        logger.info("Speculative decoding: %s, num_speculative_tokens %d (%s), adaptive %s%s", sc.method,
                    sc.num_speculative_tokens, detail, sc.adaptive, phase_k)
        return spec

    def _speculative_steps_ahead(self) -> SpecAhead | None:
        """Speculative steps that go ahead (tandem/engine/spec_ahead.py), when the proposer and the
        model allow them; why not is logged once."""
        if self.spec is None:
            return None
        why = SpecAhead.unsupported(self.spec, self.kv)
        if why is not None:
            logger.info("Speculative steps run synchronously (%s); only steps that draft nothing go ahead", why)
            return None
        return SpecAhead(self.runner, self.kv, self.scheduler, self.spec, self.config.scheduler.max_num_seqs,
                         self.sampler.generator_for, self.runner_config.prefill_graph_max_tokens)

    @property
    def async_scheduling(self) -> bool:
        """Whether plain decode steps go ahead of their predecessors' tokens (tandem/engine/inflight.py).
        A benchmark may switch it between steps (a step in flight still lands)."""
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, asked: bool | None) -> None:
        """--async-scheduling, by default on for CUDA; never with online hot experts (their swaps
        land between steps). With speculation the steps that draft nothing go ahead, and DSpark's
        verify steps (`_spec_step_ahead`)."""
        self._async = self._async_scheduling_allowed(asked)
        if self.spec is not None and self.spec.auto is not None:
            self.spec.auto.cost.plain_overlaps = self._async

    def _async_scheduling_allowed(self, asked: bool | None) -> bool:
        on = self.device.type == "cuda" if asked is None else asked
        if on and self._hot_online is not None:
            (logger.warning if asked else logger.info)(
                "Async scheduling off: --hot-experts online needs each step's tokens first")
            return False
        if self.spec is None:
            what = "plain decode steps"
        elif self._spec_ahead is not None:
            what = "decode and speculative steps"
        else:
            what = "steps that draft nothing"
        logger.info("Async scheduling: %s",
                    f"on ({what} launch before the last one's tokens are back)" if on else "off")
        return on

    def _capture_graphs(self) -> None:
        rc = self.runner_config
        if rc.enforce_eager:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off (--enforce-eager): every step runs eagerly")
            return
        blockers = startup.graph_blockers(self.model, rc)
        if blockers:
            logger.warning("CUDA graphs off: %s cannot be captured; decode runs eagerly (slow)", " and ".join(blockers))
            return
        families = {"decode": (1,)}
        if self.config.spec.max_k:  # verify of 1..Kmax drafts
            families["verify"] = tuple(range(2, self.config.spec.max_k + 2))
        max_num_seqs = self.config.scheduler.max_num_seqs
        prefill = startup.prefill_graph_lens(self)
        if self.spec is not None:  # first: a step ahead's graphs read the drafter's ring
            self.spec.capture(max_num_seqs, self.max_model_len, prefill)
        ahead = self._spec_ahead if self.config.scheduler.async_scheduling is not False else None
        self.runner.capture(max_num_seqs, families, self.max_model_len, ahead, prefill)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Check a request against the model: prompt and stop token ids within the vocabulary,
        prompt plus max_tokens within the context length (SamplingParams checked its own fields
        when it was built). Returns the resolved max_tokens; raises ParamError naming the field.
        Reads only immutable limits, so any thread may call it."""
        return check_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        """A validated request (`validate`), ready for `add`. Any thread may call it."""
        max_tokens = self.validate(prompt_token_ids, params)
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        return Request(request_id, list(map(int, prompt_token_ids)), params, eos_token_ids=eos, max_tokens=max_tokens)

    def add(self, req: Request) -> None:
        """Queue a request made by `new_request`. ParamError when its prompt can never fit in the
        KV cache; ValueError when its id is in use."""
        if req.request_id in self.states:
            raise ValueError(f"request id {req.request_id} is already in use")
        if req.params.grammar is not None:
            self.structured.add(req)  # ParamError when it does not compile
        try:
            self.scheduler.add(req)
        except ValueError as e:
            self.structured.remove(req.request_id)
            raise ParamError(str(e), "messages") from e
        self.states[req.request_id] = RequestState(IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens))
        self._update_gauges()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Validate and queue a request (AsyncEngine does the two halves on different threads)."""
        self.add(self.new_request(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its blocks; returns its final output (finish_reason "abort"),
        or None if it was not (or no longer) in the engine."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        self._update_gauges()  # an idle engine runs no step that would
        return RequestOutput(request_id, [], "", True, "abort", num_prompt_tokens=req.num_prompt_tokens,
                             num_cached_tokens=req.num_cached_prompt_tokens, num_output_tokens=req.num_output_tokens)

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Propose drafts -> schedule -> run the model -> sample or verify -> let the proposer catch
        up (`SpecDecoder.observe`: a drafter's KV or hidden-state window) -> postprocess. Returns
        a delta for every request that got tokens (several when it verified a draft) or finished.

        With async scheduling a step whose requests sample plainly is left in flight once
        launched (`_launch`); the next call launches the step after it before landing its tokens
        (`_step_ahead`), so each call returns the previous launch's deltas. A DSpark verify step of
        decodes goes ahead the same way (`_spec_step_ahead`, tandem/engine/spec_ahead.py).

        A failure ends only the requests it can be blamed on, each with finish_reason "error" and
        error_kind "internal", and the engine goes on: a failure to schedule or to run the model
        ends every request of the step (`_fail_step`), a failure to sample only the rows that
        fail alone (`sample_step`), a failure to postprocess only its request. Raises
        EngineFatalError when the engine cannot go on."""
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        if self._in_flight is not None:
            outputs = self._step_ahead()
            if self._in_flight is not None:  # the next step went ahead
                self._update_gauges()
                return outputs
        elif self._spec_step_ahead(None):  # a speculative step ahead from a synchronous start
            self._update_gauges()
            return outputs
        elif self._ahead_failure is not None:
            return self._ahead_failed()
        try:
            # With steps ahead, a step that runs a new prompt drafts nothing: it goes ahead (`_launch`)
            # and the next step ahead follows it, instead of two waits on the device (plain_for_prompt).
            plain = self._spec_ahead is not None and self.async_scheduling and self._spec_ahead.plain_for_prompt()
            drafts = self.spec.propose(self.scheduler.running) if self.spec and not plain else {}
            if self.spec is not None and not plain:
                self._count_spec_step()
                if len(self.structured):
                    drafts = self.structured.cut_drafts(drafts)
            sched = self.scheduler.schedule({rid: d.tokens for rid, d in drafts.items()})
        except Exception as e:  # noqa: BLE001 - the queues were mid-update: no request is above suspicion
            return outputs + self._fail_step("scheduling", e, list(self.scheduler.requests.values()))
        outputs += [self._reject(r) for r in sched.rejected]
        if not sched.is_empty:
            try:
                forward = self.runner.execute(sched.scheduled)
            except Exception as e:  # noqa: BLE001 - one forward pass for all: nothing singles a request out
                return outputs + self._fail_step("running the model", e, [s.request for s in sched.scheduled])
            self._ran(forward.mode)
            if self.async_scheduling and can_go_ahead(sched):
                failed = self._observe(sched, {}, forward)  # a plain step: it keeps every query token
                if failed is not None:
                    return outputs + failed
                if self._launch(sched, forward):
                    self._update_gauges()
                    return outputs
                outputs += self._finish_step(sched, forward, drafts, started, observed=True)
            else:
                outputs += self._finish_step(sched, forward, drafts, started)
        self._update_gauges()
        return outputs

    def _ran(self, mode: str) -> None:
        """A forward pass ran (`ForwardOutput.mode`: how)."""
        self._failed_steps = 0
        self.metrics.child(self.metrics.model_steps, model_name=self.model_name, mode=mode).inc()

    def _finish_step(self, sched: SchedulerOutput, forward: ForwardOutput, drafts: Mapping[str, Draft],
                     started: float, observed: bool = False) -> list[RequestOutput]:
        """The synchronous rest of a step whose forward pass ran: sample or verify, advance the
        scheduler, let the proposer catch up (unless `observed`: a plain step it caught up on
        already), postprocess."""
        masks = self.structured.fill(sched.scheduled) if len(self.structured) else None  # while the GPU runs
        results = sample_step(self.sampler, forward.logits, sched.scheduled, drafts, masks)
        accepted = {s.request.request_id: r.num_accepted for s, r in results if isinstance(r, VerifyResult)}
        self.scheduler.update_after_step(sched, accepted)  # rejected drafts' slots go back here
        if not observed:
            failed = self._observe(sched, accepted, forward)
            if failed is not None:
                return failed
        outputs = self._postprocess(sched, results)
        self._time_step(sched, started if self._results_at is None else self._results_at)
        if self._hot_online is not None:  # between steps: swaps whose copies are done, and re-ranking
            self._hot_online.after_step()
        return outputs

    def _observe(self, sched: SchedulerOutput, accepted: Mapping[str, int], forward: ForwardOutput
                 ) -> list[RequestOutput] | None:
        """The proposer catches up on the step (`SpecDecoder.observe`; `accepted`: each verifying
        request's accepted drafts). A step without drafts is observed before it is launched ahead:
        what it keeps is known without its tokens (every query token), and DSpark copies its rows
        of the target's hidden states before the next forward overwrites them. None when it
        caught up, or there is no proposer; else the step's requests end with an error (their
        outputs)."""
        if self.spec is None:
            return None
        try:
            self.spec.observe(sched, accepted, forward.aux)
        except Exception as e:  # noqa: BLE001 - the drafter's state is unknown: its requests end
            return self._fail_step("updating the drafter", e, [s.request for s in sched.scheduled])
        return None

    def _time_step(self, sched: SchedulerOutput, since: float | None, drafted: Sequence[int] | None = None,
                   prefilled: bool | None = None) -> None:
        """adaptive auto: the step's measured time (from `since`: the previous step's results,
        `_results_at`, or the call's start after the engine ran dry; None: not timed) refines the
        controller's cost model; predicted and measured go to the stats line and /metrics. Timing
        from the previous step's results counts what the engine does between steps too.
        `prefilled`: whether the drafter's prompt work is in the step's time (a step that went
        ahead carries it from its launch); None: whatever it ran since the last timed step."""
        now = time.perf_counter()
        self._results_at = now if self.has_unfinished else None
        if self._results_at is None:
            self._flush_k_counts()  # the engine ran dry: /metrics and the stats line see every step
        if since is None or self.spec is None or self.spec.auto is None:
            return
        self._untimed += 1
        if (self._untimed < HELD_STEPS_TIMED and not (self.spec.drafter_prefilled if prefilled is None else prefilled)
                and self.spec.step_kind_known(sched)):
            # One step in HELD_STEPS_TIMED refines the cost (the step-time EMA and the predicted /
            # measured metrics are averages: a sample keeps them), counted across K changes: timing
            # every step after one (as a step of a new choice was) times mostly the steps whose
            # time holds that choice's host work, with requests changing every few steps at 8-16.
            # A kind of step (batch bucket, drafting or not) seen too few times yet is timed always.
            return
        self._untimed = 0
        seconds = now - since
        prediction = self.spec.observe_step(sched, seconds, drafted, prefilled)
        if prediction is not None:
            self.metrics.count_step_time(prediction.predicted, seconds)
            self._window.count_step_time(prediction.predicted, seconds)

    def _postprocess(self, sched: SchedulerOutput, results: list[tuple[ScheduledRequest, VerifyResult | Exception]],
                     expected: Mapping[str, float | None] | None = None) -> list[RequestOutput]:
        """Append each request's new tokens and build its delta; a request whose sampling failed
        (and one whose postprocessing raises) ends with an error instead. `expected`: what auto
        expected of each draft, when it chose them before the current choice (a step ahead)."""
        now = time.monotonic()
        m = self.metrics
        prompt_tokens = sum(
            max(0, min(s.start + s.num_tokens, s.request.num_prompt_tokens) - s.start) for s in sched.scheduled
        )
        self._window.prompt_tokens += prompt_tokens
        m.label(m.prompt_tokens).inc(prompt_tokens)
        m.label(m.preemptions).inc(len(sched.preempted))
        outputs, drafted = [], False
        for s, result in results:
            req = s.request
            if req.status != RequestStatus.RUNNING:  # a row scheduled ahead of the token that stopped it
                continue
            if isinstance(result, Exception):
                outputs.append(self._fail_request(req, "sampling", result))
                continue
            try:
                if s.draft:
                    guess = (expected.get(req.request_id) if expected is not None
                             else self.spec.expected_accepted(req.request_id, len(s.draft)))
                    self.metrics.count_draft(self.spec.phase(req), len(s.draft), result.num_accepted, guess)
                    drafted = True
                outputs.append(self._append_tokens(req, result.tokens, result.logprobs, now))
            except Exception as e:  # noqa: BLE001 - e.g. the detokenizer: this request alone
                outputs.append(self._fail_request(req, "postprocessing", e))
        if drafted:  # the step's drafts, summed by phase: one update per counter
            self._window.add_drafts(m.flush_drafts())
        return outputs

    def _count_spec_step(self) -> None:
        """The K each request got this step, by phase, and the drafter's forwards (graph or eager).
        A held choice's repeats are counted when the run of them ends, at the stats line, when the
        engine runs dry, or every MAX_HELD_UNCOUNTED steps (`_flush_k_counts`)."""
        assert self.spec is not None
        counts = self.spec.k_counts
        if counts is self._k_seen and self._k_repeats < MAX_HELD_UNCOUNTED:
            self._k_repeats += 1
        else:
            self._flush_k_counts()
            self._k_seen = counts
            self._count_k(counts, 1)
        if not self.spec.drafter_forwards:  # (most steps at K = 0)
            return
        for mode, n in self.spec.take_drafter_forwards().items():
            if n:
                self.metrics.child(self.metrics.drafter_steps, model_name=self.model_name, mode=mode).inc(n)

    def _flush_k_counts(self) -> None:
        """Count the repeats of the held K choice that `_count_spec_step` deferred."""
        if self._k_repeats and self._k_seen is not None:
            self._count_k(self._k_seen, self._k_repeats)
        self._k_repeats = 0

    def _count_k(self, counts: Mapping[tuple[str, int], int], steps: int) -> None:
        for (phase, k), n in counts.items():
            self.metrics.count_k(phase, k, n * steps)
            self._window.count_k(phase, k, n * steps)

    def _append_tokens(self, req: Request, tokens: list[int], lps: list[TokenLogprobs] | None,
                       now: float) -> RequestOutput:
        state = self.states[req.request_id]
        out = self._emit(req, state, tokens, lps)
        self._window.generation_tokens += len(out.new_token_ids)
        m = self.metrics
        m.label(m.generation_tokens).inc(len(out.new_token_ids))
        if state.first_token_time is None:
            state.first_token_time = now
            m.label(m.ttft).observe(now - req.arrival_time)
        else:
            m.label(m.itl).observe(now - (state.last_token_time or now))
        state.last_token_time = now
        return out

    def _emit(self, req: Request, state: RequestState, tokens: list[int], lps: list[TokenLogprobs] | None
              ) -> RequestOutput:
        """Append the step's new tokens and build the request's delta (the one owner of output
        post-processing: detokenizing, stop conditions, finishing).

        The tokens are taken one at a time, exactly as steps of one token each would take them
        (`_emit_token`), so EOS, a stop token, a stop string or a length limit falling inside an
        accepted draft ends the request at the same token and the same character as without
        speculation; the tokens after that one are dropped."""
        new_ids: list[int] = []
        text, finish, stop_reason = "", None, None
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            new_ids.append(token)
            if lps is not None:
                state.pending_logprobs.append(lps[i])
            piece, finish, stop_reason = self._emit_token(req, state, token)
            text += piece
            if finish is not None:
                break
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=finish is not None,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=state.pending_logprobs if req.params.logprobs is not None else None,
        )
        state.pending_logprobs = []
        if finish is not None:
            req.stop_reason = stop_reason
            self._finish(req, finish)
        return out

    def _emit_token(self, req: Request, state: RequestState, token: int) -> tuple[str, str | None, int | str | None]:
        """Detokenize one appended token and apply the stop conditions (`take_token`); the grammar
        of a constrained request consumes it first."""
        grammar_done = self.structured.accept(req, token)
        return take_token(req, state, token, grammar_done, self.tokenizer.eos_token_ids, self.max_model_len)

    def _finish(self, req: Request, reason: str) -> None:
        self.states.pop(req.request_id, None)
        self.scheduler.finish(req, reason)
        self.sampler.release(req.request_id)
        self.structured.remove(req.request_id)
        if self.spec is not None:
            self.spec.remove(req.request_id)
        m = self.metrics
        m.label(m.e2e).observe(time.monotonic() - req.arrival_time)
        m.success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def _reject(self, req: Request) -> RequestOutput:
        message = (
            f"request {req.request_id} needs {self.kv.blocks_needed(req.num_tokens + 1)} KV blocks but the "
            f"cache has {self.kv.num_blocks}; raise --kv-cache-memory or shorten the request"
        )
        logger.error(message)
        return self._end_with_error(req, message, "invalid")

    # -- failures -----------------------------------------------------------------------------
    def _fail_step(self, stage: str, error: Exception, reqs: list[Request]) -> list[RequestOutput]:
        """End every request of a step that failed as a whole (nothing pins the failure on one of
        them). Raises EngineFatalError instead when the engine cannot go on: after a device error
        or when MAX_FAILED_STEPS steps in a row failed."""
        raise_if_fatal(stage, error)
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineFatalError(
                f"{self._failed_steps} steps in a row failed, the last while {stage}: {brief(error)}"
            ) from error
        logger.error("A step failed while %s; ending its %d requests with an error: %s", stage, len(reqs),
                     ", ".join(r.request_id for r in reqs), exc_info=error)
        # The step's K/V may be missing or half written; its blocks are not in the prefix cache:
        # blocks are registered only after a forward pass ran (KVCacheManager.commit).
        message = f"internal error while {stage}: {brief(error)}"
        outputs = [self._end_with_error(r, message) for r in reqs]
        self._update_gauges()
        return outputs

    def _fail_request(self, req: Request, stage: str, error: Exception) -> RequestOutput:
        """End one request that failed while `stage`; the log gets the traceback."""
        logger.error("Request %s failed while %s; ending it with an error", req.request_id, stage, exc_info=error)
        return self._end_with_error(req, f"internal error while {stage}: {brief(error)}")

    def _end_with_error(self, req: Request, message: str, kind: ErrorKind = "internal") -> RequestOutput:
        """Finish a request with finish_reason "error" (freeing its blocks) and build its last delta."""
        self._finish(req, "error")
        return RequestOutput(req.request_id, [], "", True, "error", num_prompt_tokens=req.num_prompt_tokens,
                             num_cached_tokens=req.num_cached_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             error=message, error_kind=kind)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.label(m.running).set(len(self.scheduler.running))
        m.label(m.waiting).set(len(self.scheduler.waiting))
        m.label(m.kv_usage).set(self.kv.usage)
        q, h = self.kv.prefix_queries, self.kv.prefix_hits
        if q != self._prefix_reported[0]:
            m.label(m.prefix_queries).inc(q - self._prefix_reported[0])
            m.label(m.prefix_hits).inc(h - self._prefix_reported[1])
            self._prefix_reported = (q, h)

    def stats_line(self) -> str:
        """The periodic stats line over the window since the last one; starts a new window."""
        self._flush_k_counts()
        q, h = self.kv.prefix_queries, self.kv.prefix_hits
        line = self._window.line(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage, q, h)
        self._window = StatsWindow(time.monotonic(), q, h)
        sink = getattr(self.model, "cpu_experts", None)  # experts in RAM: hot-expert hits, streaming
        return line + (sink.stats_line_part(self.metrics, self.model_name) if sink is not None else "")
