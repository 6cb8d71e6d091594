"""The K policies on the demo pair, in one process, on a phase-alternating agentic mix: no
speculation, fixed K = 1..4 (`adaptive: off`), `phase`, and `auto`, for DSpark and the draft model,
at several concurrencies, with interleaved repetitions (every configuration runs once per round,
rounds repeat, each in a rotated order, after `--warmup-rounds` untimed ones; the median over
rounds of each round's ratio to that round's no-speculation run is reported, so drift between
configurations is shared).

The workload is the demo corpus (the prompts the demo model answers): families cycled so that
reasoning-heavy turns (arithmetic, sort, count: long `<think>`), JSON, code and tool calls
alternate, and each tool example also gives its second turn (after the tool's result). At
concurrency c, c requests are kept in flight (a finished one is replaced at once), greedy.

Per configuration: output tok/s, acceptance by phase, the K distribution by phase, and for `auto`
the predicted vs measured step time; `--traces OUT` also records, from a fixed-Kmax DSpark run at
concurrency 1, every verify's (request, output position, phase, drafted, accepted, the drafter's
confidence per draft token): the traces
`bench_auto_replay.py` replays against a large target's step costs.

    python benchmarks/bench_auto.py --device cuda --rounds 3 --concurrency 1,4,16 --out auto.json --traces traces.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.builtin import demo_model_dir  # noqa: E402
from tandem.demo import text  # noqa: E402
from tandem.demo.corpus import EVAL_SEED, make_example  # noqa: E402

ORDER = ("arithmetic", "json", "tool", "sort", "python", "count", "tool", "units")
PHASES = ("reasoning", "content", "tool_call")
PHASE_K = {"reasoning": 1, "content": 2, "tool_call": 3}  # the seed's rule, extended to tool calls


def workload(n: int) -> list[list[int]]:
    """n prompts cycling ORDER; a tool example adds its second assistant turn."""
    tok = text.load_tokenizer(demo_model_dir() / "tokenizer.json")
    out: list[list[int]] = []
    i = 0
    while len(out) < n:
        family = ORDER[i % len(ORDER)]
        ex = make_example(EVAL_SEED, 100 + i, family)
        turns = [j for j, m in enumerate(ex.messages) if m["role"] == "assistant"]
        for upto in turns[:2]:
            out.append(tok.encode(text.render_prompt(ex, upto), add_special_tokens=False).ids)
        i += 1
    return out[:n]


def configs(methods: list[str], kmax: int, fitted: list[dict[str, int]] = ()) -> dict[str, dict | None]:
    """Every configuration by name; each of `fitted` adds "<method> phase-fit", "phase-fit2", ..:
    `phase` with that phase_k (chosen for the demo pair's own acceptance, not the seed's model's)."""
    out: dict[str, dict | None] = {"none": None}
    for m in methods:
        for k in range(1, kmax + 1):
            out[f"{m} K={k}"] = {"method": m, "num_speculative_tokens": k}
        out[f"{m} phase"] = {"method": m, "num_speculative_tokens": kmax, "adaptive": "phase", "phase_k": PHASE_K}
        for i, phase_k in enumerate(fitted):
            out[f"{m} phase-fit{i + 1 if i else ''}"] = {"method": m, "num_speculative_tokens": kmax,
                                                         "adaptive": "phase", "phase_k": phase_k}
        out[f"{m} auto"] = {"method": m, "num_speculative_tokens": kmax, "adaptive": "auto"}
    return out


def counters(llm: LLM) -> dict[tuple, float]:
    """Every spec / timing counter sample, keyed by (name, sorted labels)."""
    snap: dict[tuple, float] = {}
    for metric in llm.engine.metrics.registry.collect():
        for s in metric.samples:
            if s.name.startswith("tandem:spec_decode") and s.name.endswith("_total"):
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
                snap[key] = snap.get(key, 0.0) + s.value
    return snap


class StageClock:
    """Seconds spent in the engine's speculative stage (propose, observe, the step timing, and for
    speculative steps ahead the K choice, the landing's observe and the graph inputs' staging),
    by wrapping those methods of one engine: the host work a K policy adds per step. Nested
    stages count in both (plan_ahead includes its choose_ahead)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds: dict[str, float] = {}
        eng = llm.engine
        if eng.spec is None:
            return
        for owner, name in ((eng.spec, "propose"), (eng.spec, "plan_ahead"), (eng.spec, "observe"), (eng, "_time_step"),
                            (eng, "_count_spec_step"), (eng.spec, "choose_ahead"),
                            (eng.spec, "observe_ahead"), (eng.runner, "_stage_inputs")):
            self._wrap(owner, name)

    def _wrap(self, owner: object, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


class StepClock:
    """Wall seconds and counts of one engine's steps by how their forward ran ("prefill" /
    "prefill_graph": a step with prefill work, eager or replayed, "cuda_graph" / "eager": decodes
    and verifies, "none": no forward), by
    wrapping `step` and the runner's `execute`: where the time a K policy does not model goes."""

    def __init__(self, llm: LLM) -> None:
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        eng = llm.engine
        execute, execute_ahead, step = eng.runner.execute, eng.runner.execute_ahead, eng.step
        mode = ["none"]

        def traced_execute(batch, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - execute's own
            out = execute(batch, *args, **kwargs)
            mode[0] = out.mode
            return out

        def traced_ahead(batch, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a speculative step ahead
            mode[0] = execute_ahead(batch, *args, **kwargs) + " ahead"
            return mode[0][: -len(" ahead")]

        def timed_step():  # noqa: ANN202
            mode[0] = "none"
            start = time.perf_counter()
            try:
                return step()
            finally:
                self.seconds[mode[0]] = self.seconds.get(mode[0], 0.0) + time.perf_counter() - start
                self.steps[mode[0]] = self.steps.get(mode[0], 0) + 1

        eng.runner.execute, eng.runner.execute_ahead, eng.step = traced_execute, traced_ahead, timed_step

    def take(self, total_seconds: float) -> dict[str, Any]:
        """Per kind: steps and seconds; "between steps": the rest of `total_seconds`."""
        out = {k: {"steps": self.steps[k], "s": round(v, 4)} for k, v in self.seconds.items()}
        out["between steps"] = {"s": round(total_seconds - sum(self.seconds.values()), 4)}
        self.seconds, self.steps = {}, {}
        return out


def run_level(llm: LLM, prompts: list[list[int]], conc: int, max_tokens: int) -> tuple[int, float]:
    """Keep `conc` requests in flight until every prompt is done; (output tokens, seconds)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    queue, live, tokens = list(enumerate(prompts)), set(), 0
    start = time.perf_counter()
    while queue or live:
        while queue and len(live) < conc:
            i, ids = queue.pop(0)
            rid = f"b{i}-{time.monotonic_ns()}"
            eng.add_request(rid, ids, params)
            live.add(rid)
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                live.discard(out.request_id)
    return tokens, time.perf_counter() - start


def summarize(delta: dict[tuple, float]) -> dict[str, Any]:
    def get(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in delta.items() if n == f"tandem:spec_decode_{name}_total"
                   and all(dict(ls).get(k) == x for k, x in labels.items()))

    out: dict[str, Any] = {}
    for phase in PHASES:
        drafts = get("num_drafts", phase=phase)
        if drafts:
            out[phase] = {"drafts": drafts, "accept_len": 1 + get("num_accepted_tokens", phase=phase) / drafts,
                          "k": {k: get("k", phase=phase, k=str(k)) for k in range(0, 9)
                                if get("k", phase=phase, k=str(k))},
                          # drafts accepted at each position, of all the phase's drafts (what a
                          # phase_k is fitted from: the phase's a_1, a_1 a_2, ..)
                          "accepted_at": [round(get("num_accepted_tokens_per_pos", phase=phase, position=str(p)) / drafts, 4)
                                          for p in range(8)
                                          if get("num_accepted_tokens_per_pos", phase=phase, position=str(p))]}
            if get("predicted_accepted_tokens", phase=phase):  # auto only
                out[phase]["predicted_accept_len"] = 1 + get("predicted_accepted_tokens", phase=phase) / drafts
    steps = get("timed_steps")
    if steps:
        out["step_ms"] = {"predicted": 1e3 * get("step_predicted_seconds") / steps,
                          "measured": 1e3 * get("step_measured_seconds") / steps, "steps": steps}
    return out


def record_traces(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each verify's (request, output position, phase, drafted, accepted) at concurrency 1."""
    spec, rows = llm.engine.spec, []
    observe, propose = spec.observe, spec.propose
    confidence: dict[str, list[float]] = {}

    def proposing(requests):  # noqa: ANN001, ANN202 - the drafter's confidence per draft token
        drafts = propose(requests)
        for rid, d in drafts.items():
            if d.confidence is not None:
                confidence[rid] = [round(c, 4) for c in d.confidence.tolist()]
        return drafts

    def traced(sched, accepted, aux):  # noqa: ANN001, ANN202
        for s in sched.scheduled:
            if s.draft:
                rid = s.request.request_id
                rows.append({"request": rid, "pos": s.request.num_output_tokens, "phase": spec.phase(s.request),
                             "drafted": len(s.draft), "accepted": accepted.get(rid, 0),
                             "confidence": confidence.pop(rid, None)})
        return observe(sched, accepted, aux)

    spec.observe, spec.propose = traced, proposing
    try:
        for i, ids in enumerate(prompts):
            llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        spec.observe, spec.propose = observe, propose
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default="dspark,draft_model")
    ap.add_argument("--kmax", type=int, default=4)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompts-per-slot", type=int, default=0, metavar="N",
                    help="each concurrency level runs max(--prompts, N x concurrency) prompts: rounds long enough "
                         "to time at high concurrency (96 prompts at 16 took 0.45 s a round on the H200 box, whose "
                         "rounds then spread by +-20%%)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--phase-k-fit", default=None, metavar="JSON",
                    help='also run `phase` with these phase_k (";" between them), e.g. \'{"reasoning": 4, "content": 3}\' '
                         '("<method> phase-fit", "phase-fit2", ..)')
    ap.add_argument("--only", default=None, help="comma-separated configuration names to run (default all)")
    ap.add_argument("--stage-clock", action="store_true",
                    help="time the speculative stage's host work per configuration (propose, observe, counters)")
    ap.add_argument("--step-clock", action="store_true",
                    help="wall time per step kind (prefill, graph, eager) and between steps, per configuration")
    ap.add_argument("--eager-prefill-too", action="store_true",
                    help="also run each configuration with prefill graphs off (--prefill-graph-max-tokens 0)")
    ap.add_argument("--aa", action="store_true",
                    help="also a second engine with no speculation, 'none (A/A)': its ratio to none is the run's noise "
                         "(on the H100 boxes the host's pace flipped between ~0.69 and ~1.1 ms a step between runs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--traces", default=None, help="also record DSpark K=kmax verify traces here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = workload(max(args.prompts, args.prompts_per_slot * max(levels)))

    def level_prompts(c: int) -> list[list[int]]:  # the same first prompts at every level
        return prompts[: max(args.prompts, args.prompts_per_slot * c)]

    table = configs(args.methods.split(","), args.kmax, [json.loads(f) for f in args.phase_k_fit.split(";")] if args.phase_k_fit else [])
    if args.only:
        table = {k: v for k, v in table.items() if k in args.only.split(",")}
    if args.aa:
        table["none (A/A)"] = None
    variants = [(name, spec, None) for name, spec in table.items()]
    if args.eager_prefill_too:
        variants += [(f"{name}, eager prefill", spec, 0) for name, spec in table.items()]
    table = {name: spec for name, spec, _ in variants}
    llms, clocks, step_clocks = {}, {}, {}
    for name, spec, prefill_cap in variants:
        t = time.perf_counter()
        cap = {} if prefill_cap is None else {"prefill_graph_max_tokens": prefill_cap}
        llms[name] = LLM(str(demo_model_dir()), device=args.device, max_num_seqs=max(levels), kv_cache_memory="1GiB",
                         speculative_config=spec, **cap)
        llms[name].generate(prompts[:2], SamplingParams(max_tokens=32, temperature=0.0))  # warm-up
        clocks[name] = StageClock(llms[name]) if args.stage_clock else None
        step_clocks[name] = StepClock(llms[name]) if args.step_clock else None
        print(f"built {name} in {time.perf_counter() - t:.1f} s", flush=True)
    results: dict[str, dict[int, list[float]]] = {n: {c: [] for c in levels} for n in table}
    details: dict[str, dict[int, dict]] = {n: {} for n in table}
    names = list(llms)
    for r in range(args.warmup_rounds):
        # Untimed: on the device machine the first round of every run came out 2-3x slower
        # than the rest (a cold host). It also lets auto learn, as a serving engine would have.
        for c in levels:
            for name in names:
                _, seconds = run_level(llms[name], level_prompts(c), c, args.max_tokens)
                if clocks[name] is not None:
                    clocks[name].take()
                if step_clocks[name] is not None:
                    step_clocks[name].take(seconds)
        print(f"warm-up round {r + 1} done", flush=True)
    for r in range(args.rounds):
        for c in levels:
            # A different order each round: a configuration is not always the one after another.
            for name in names[r % len(names):] + names[: r % len(names)]:
                llm = llms[name]
                before, ahead = counters(llm), llm.engine.num_async_steps
                tokens, seconds = run_level(llm, level_prompts(c), c, args.max_tokens)
                after, ahead = counters(llm), llm.engine.num_async_steps - ahead
                results[name][c].append(tokens / seconds)
                stage = clocks[name].take() if clocks[name] is not None else {}
                steps = step_clocks[name].take(seconds) if step_clocks[name] is not None else {}
                if r == args.rounds - 1:
                    details[name][c] = summarize({k: v - before.get(k, 0.0) for k, v in after.items()})
                    details[name][c]["async_steps"] = ahead  # steps that went ahead (no drafts)
                    if stage:  # ms of host work in the speculative stage, per timed step
                        details[name][c]["stage_s"] = {k: round(v, 4) for k, v in stage.items()}
                    if steps:
                        details[name][c]["wall_by_step_kind"] = steps
                    auto = llm.engine.spec.auto if llm.engine.spec is not None else None
                    if auto is not None:  # what the cost model learned on top of its tables, by (bucket, drafter ran)
                        details[name][c]["residual_ms"] = {f"{b}{'+draft' if d else ''}": round(1e3 * v, 4)
                                                           for (b, d), v in sorted(auto.cost.residual.items())}
                print(f"round {r + 1} conc {c:>2} {name:<28} {tokens / seconds:8.1f} tok/s ({tokens} tokens)", flush=True)
    report = {"rounds": args.rounds, "prompts": {c: len(level_prompts(c)) for c in levels}, "max_tokens": args.max_tokens,
              "device": args.device, "results": {}}
    print(f"\nmedian tok/s over {args.rounds} rounds (median of each round's ratio to no speculation in that round)")
    print(f"{'config':<28}" + "".join(f"{'conc ' + str(c):>18}" for c in levels))
    for name in table:
        row = f"{name:<28}"
        report["results"][name] = {}
        for c in levels:
            med = statistics.median(results[name][c])
            base = results["none"][c] if "none" in results else results[name][c]
            ratio = statistics.median(x / b for x, b in zip(results[name][c], base))
            row += f"{med:10.1f} ({ratio:4.2f}x)"
            report["results"][name][c] = {"tok_s": results[name][c], "median": med, "vs_none": ratio,
                                          **details[name].get(c, {})}
        print(row)
    for name, llm in llms.items():  # what auto measured and learned: replayable as a cost model
        auto = llm.engine.spec.auto if llm.engine.spec is not None else None
        if auto is not None:
            cost = auto.cost
            report.setdefault("auto_cost", {})[name] = {
                "verify": {f"{b},{q}": t for (b, q), t in cost.verify.items()},
                "draft": {f"{b},{d}": t for (b, d), t in cost.draft.items()},
                "residual": {f"{b},{q}": cost.learned([q - 1] * b) for b, q in cost.verify}}  # per (bucket, q)
            print(f"{name}: step costs (ms, measured at start-up, refined by real steps)\n{cost.table()}")
    for name in table:
        for c in levels:
            d = details[name].get(c, {})
            if d:
                print(f"{name} conc {c}: " + json.dumps(d))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.traces:
        k = args.kmax
        # Synchronous steps: the traces are read from each propose and observe (the drafts and
        # acceptance are those of the steps ahead).
        llm = LLM(str(demo_model_dir()), device=args.device, max_num_seqs=1, kv_cache_memory="1GiB",
                  speculative_config={"method": "dspark", "num_speculative_tokens": k}, async_scheduling=False)
        rows = record_traces(llm, prompts, args.max_tokens)
        Path(args.traces).write_text(json.dumps({"method": "dspark", "kmax": k, "rows": rows}))
        print(f"recorded {len(rows)} verifies of {len(prompts)} requests to {args.traces}")


if __name__ == "__main__":
    main()
