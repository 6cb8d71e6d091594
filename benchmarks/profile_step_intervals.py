"""What each timed step of an engine holds: every interval `adaptive: auto` could learn a step's
cost from (`LLMEngine._time_step`: from the previous step's results to this step's), of no
speculation and of one speculative configuration, on the bench_auto workload at one concurrency,
with the host seconds spent inside it by the engine's parts (the runner's forwards, waiting for a
step's tokens, post-processing, scheduling, sampling, the speculative stage's calls). Intervals are
grouped by kind (plain, drafting, prompt) and batch size, so that a kind of step that costs more
under speculation than without it shows where.

    python benchmarks/profile_step_intervals.py --device cuda --concurrency 16 --rounds 2 --out intervals.json
    python benchmarks/profile_step_intervals.py --spec '{"method": "dspark", "num_speculative_tokens": 7, "adaptive": "auto"}'

Every interval is recorded, held steps included (the engine itself times one in HELD_STEPS_TIMED
of those). The wrappers cost a microsecond or two per call, alike for both configurations.

Beside the intervals, per run: what the speculative stage did (`Tally`: how often plan_ahead let a
step go ahead, how often an all-zero hold repeated in O(1), auto's choices and searches, the prompt
tokens fed to a draft model and its proposals) and the garbage collector's collections and time
(`GcClock`): what a speculative engine that drafts nothing may still pay per step.
`--spec-skip-prompts` adds a third engine whose draft model is fed no prompt (auto's `drafts_now`
always False): the A/B of that feeding.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_auto import run_level, workload  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.builtin import demo_model_dir  # noqa: E402
from tandem.engine import ahead_steps, inflight  # noqa: E402
from tandem.engine import engine as engine_module  # noqa: E402
from tandem.engine import runner as runner_module  # noqa: E402
from tandem.engine import sampler as sampler_module  # noqa: E402
from tandem.engine import scheduler as scheduler_module  # noqa: E402
from tandem.spec import auto as auto_module  # noqa: E402
from tandem.spec import controller, draft_model  # noqa: E402

DRAFT_MODEL_AUTO = {"method": "draft_model", "num_speculative_tokens": 7, "adaptive": "auto"}
# (class, its methods) timed inside each interval
PARTS = [(runner_module.ModelRunner, ("execute", "execute_chain")), (inflight.InFlightStep, ("results",)),
         (engine_module.LLMEngine, ("_postprocess", "_count_spec_step", "_update_gauges", "_launch", "_observe")),
         (ahead_steps.AheadSteps, ("_plain_ahead", "_spec_step_ahead")),
         (controller.SpecDecoder, ("plan_ahead", "choose_ahead", "propose", "observe_step")),
         (scheduler_module.Scheduler, ("schedule", "schedule_ahead", "update_after_step", "commit")),
         (sampler_module.Sampler, ("sample",))]
KEEP_EVENTS = 500  # calls kept between intervals (an interval spans a few dozen)
# (class, method, label, whether its result is tallied too) counted per run by `Tally`
TALLIED = [(controller.SpecDecoder, "plan_ahead", True), (controller.SpecDecoder, "repeat_zero", True),
           (auto_module.AutoK, "choose", False), (auto_module.AutoK, "drafts_now", True),
           (draft_model.DraftModelProposer, "propose", False)]


class Tally:
    """Counts calls of the speculative stage's decisions (class-wide), with their results where
    `TALLIED` says, and the prompt tokens a draft model is fed (`observe`), and auto's searches."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        for cls, name, results in TALLIED:
            self._wrap(cls, name, f"{cls.__name__}.{name}", results)
        counts, search = self.counts, auto_module.choose_ks

        def counted_search(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts["choose_ks"] += 1
            return search(*args, **kwargs)

        auto_module.choose_ks = counted_search
        observe = draft_model.DraftModelProposer.observe

        def fed(proposer, batch, kept, aux):  # noqa: ANN001, ANN202 - the proposer's own
            counts["draft model prompt tokens fed"] += sum(s.num_tokens for s in batch if not s.draft and s.num_tokens > 1)
            return observe(proposer, batch, kept, aux)

        draft_model.DraftModelProposer.observe = fed

    def _wrap(self, cls: type, name: str, label: str, results: bool) -> None:
        f, counts = getattr(cls, name), self.counts

        @functools.wraps(f)
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = f(*args, **kwargs)
            counts[f"{label}={out}" if results else label] += 1
            return out

        setattr(cls, name, counted)

    def take(self) -> dict[str, int]:
        """The counts since the last take (the wrappers keep counting into the same Counter)."""
        out = dict(sorted(self.counts.items()))
        self.counts.clear()
        return out


class GcClock:
    """The garbage collector's collections by generation and their seconds, since the last take."""

    def __init__(self) -> None:
        self.collections: collections.Counter = collections.Counter()
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[f"gen{info['generation']}"] += 1

    def take(self) -> dict[str, Any]:
        out = {"ms": round(1e3 * self.seconds, 2), **dict(sorted(self.collections.items()))}
        self.collections, self.seconds = collections.Counter(), 0.0
        return out


class IntervalClock:
    """Wraps the engine's parts and `_time_step` (class-wide: every engine in the process)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []  # (part, start, end), in order of ending
        self.intervals: list[tuple[int, str, float, collections.Counter]] = []  # (batch, kind, seconds, parts)
        for cls, names in PARTS:
            for name in names:
                self._wrap(cls, name, f"{cls.__name__}.{name}")
        clock, time_step = self, engine_module.LLMEngine._time_step

        @functools.wraps(time_step)
        def timed(engine, sched, since, drafted=None, prefilled=None):  # noqa: ANN001, ANN202 - the engine's own
            if since is not None:
                clock.record(sched, since, time.perf_counter())
            return time_step(engine, sched, since, drafted, prefilled)

        engine_module.LLMEngine._time_step = timed

    def _wrap(self, cls: type, name: str, label: str) -> None:
        f, events = getattr(cls, name), self.events

        @functools.wraps(f)
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                events.append((label, start, time.perf_counter()))

        setattr(cls, name, timed)

    def record(self, sched: Any, since: float, now: float) -> None:
        parts: collections.Counter = collections.Counter()
        for label, start, end in reversed(self.events):
            if end < since:
                break
            parts[label] += min(end, now) - max(start, since)
        ks = [len(s.draft) for s in sched.scheduled]
        prompt = sched.has_prompt_work
        self.intervals.append((len(ks), "prompt" if prompt else "drafting" if any(ks) else "plain", now - since, parts))
        del self.events[:-KEEP_EVENTS]

    def take(self) -> dict[str, dict]:
        """The intervals since the last call, by kind and batch: count, median / mean ms, and the
        mean ms of each part inside them."""
        groups: dict[str, list] = collections.defaultdict(list)
        for batch, kind, seconds, parts in self.intervals:
            groups[f"{kind} b{batch}"].append((seconds, parts))
        self.intervals, self.events[:] = [], []
        out = {}
        for key, xs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            parts = collections.Counter()
            for _, p in xs:
                parts.update(p)
            out[key] = {"n": len(xs), "ms_median": round(1e3 * statistics.median(s for s, _ in xs), 3),
                        "ms_mean": round(1e3 * statistics.mean(s for s, _ in xs), 3),
                        "parts_ms_mean": {k: round(1e3 * v / len(xs), 3) for k, v in parts.most_common(14)}}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spec", default=json.dumps(DRAFT_MODEL_AUTO), help="--speculative-config JSON to compare with none")
    ap.add_argument("--base", default=None, help="--speculative-config JSON of the engine compared with (default: none)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts-per-slot", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-rounds", type=int, default=0, help="untimed rounds first (auto learns meanwhile)")
    ap.add_argument("--spec-skip-prompts", action="store_true",
                    help="a third engine: the spec one whose draft model is fed no prompt (drafts_now always False)")
    ap.add_argument("--spec-first", action="store_true",
                    help="run the --spec engine before the one compared with in every round (an order A/B)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    clock, tally, gc_clock = IntervalClock(), Tally(), GcClock()
    prompts = workload(args.prompts_per_slot * args.concurrency)
    kw = {"device": args.device, "max_num_seqs": args.concurrency, "kv_cache_memory": "1GiB"}
    base = json.loads(args.base) if args.base else None
    llms = {"base" if base else "none": LLM(str(demo_model_dir()), speculative_config=base, **kw),
            "spec": LLM(str(demo_model_dir()), speculative_config=json.loads(args.spec), **kw)}
    if args.spec_skip_prompts:
        llms["spec, no prompts fed"] = LLM(str(demo_model_dir()), speculative_config=json.loads(args.spec), **kw)
        auto = llms["spec, no prompts fed"].engine.spec.auto
        if auto is None:
            raise SystemExit("--spec-skip-prompts needs an adaptive auto --spec")
        auto.drafts_now = lambda phase, batch: False  # this engine only (an instance attribute)
    if args.spec_first:
        llms = dict(reversed(llms.items()))
    for llm in llms.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=32, temperature=0.0))
    for _ in range(args.warmup_rounds):
        for llm in llms.values():
            run_level(llm, prompts, args.concurrency, args.max_tokens)
    report: dict[str, Any] = {"base": base, "spec": json.loads(args.spec), "concurrency": args.concurrency, "rounds": []}
    for r in range(args.rounds):
        row = {}
        for name, llm in llms.items():
            clock.take(), tally.take(), gc_clock.take()
            steps = llm.engine.num_async_steps
            tokens, seconds = run_level(llm, prompts, args.concurrency, args.max_tokens)
            row[name] = {"tok_s": round(tokens / seconds), "async_steps": llm.engine.num_async_steps - steps,
                         "calls": tally.take(), "gc": gc_clock.take(), "intervals": clock.take()}
            auto = llm.engine.spec.auto if llm.engine.spec is not None else None
            if auto is not None:
                row[name]["residual_ms"] = {f"{b}{'+draft' if d else ''}": round(1e3 * v, 3)
                                            for (b, d), v in sorted(auto.cost.residual.items())}
                # the tables' plain step at each bucket, to set the residuals against the intervals
                row[name]["table_plain_ms"] = {b: round(1e3 * auto.cost.modelled([0] * b), 3) for b in auto.cost.buckets}
                row[name]["catch_up_ms"] = round(1e3 * auto.catch_up, 3)
            top = next(iter(row[name]["intervals"].items()), None)
            print(f"round {r + 1} {name:<5} {row[name]['tok_s']:>7} tok/s; most intervals: {top[0] if top else '-'} "
                  f"{top[1]['ms_median'] if top else 0:.3f} ms (median of {top[1]['n'] if top else 0}); "
                  f"{row[name]['async_steps']} steps ahead; gc {row[name]['gc']}; {row[name]['calls']}", flush=True)
        report["rounds"].append(row)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
