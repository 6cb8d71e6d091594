"""Replayed: the K policies facing a large target's step costs with the demo pair's acceptance.

The demo pair's per-verify traces (`bench_auto.py --traces`: at every step of a fixed-Kmax DSpark
run, the request's output position, phase, and how many of the Kmax drafts the target accepted)
are replayed as a simulation: requests advance through their traces, a step at depth K accepts
as many drafts as the recorded runs of accepted drafts allow from its position, at most K
(`Trace.run_at`: a step that lands inside a recorded run has its rest; a run that ended in a
rejection stops at the rejected token; one accepted whole continues into the next), and takes
the time of the step
costs measured on a random-weight target of the Qwen3-30B-A3B shape (the engine's own start-up
measurement: `ModelRunner.measure`, graph replays per (batch bucket, q = 1 + K), short context)
plus the demo DSpark drafter's measured times. GPU time only: no host work is simulated. Every
policy runs on the same traces and the same tables: no speculation, fixed K = 1..Kmax, `phase`,
and `auto` (the real controller, `tandem.spec.auto.AutoK`, fed each simulated verify and step,
cutting drafts by the recorded DSpark confidence where a cut can pay; `auto-noconf` without;
`auto-ahead` as the engine's steps ahead call it, `SpecDecoder.choose_ahead`: a hold repeated or
joined where one stands, else `choose`, held ks cut to the rooms, no confidence cuts, its `choose`
calls counted; here each step lands before the next is chosen, so a request's room does not
swing with the depth in flight as it does in the engine);
and a ceiling no policy can pass, `oracle`: each step's batch depth chosen knowing how many
drafts each request will have accepted. `stop@T` (`--stop`) is a drafter that stops on its own
confidence: every request drafts the block and keeps drafts while the product of the recorded
confidences up to them (the head's estimate that all of them are accepted) is at least T; the
block forward is charged at depth 1 or more whatever is kept, the stop itself at nothing (a
device-side early exit, which the engine does not have: this is the most such a drafter can gain).

    python benchmarks/bench_auto_replay.py --traces traces.json --device cuda --out replay.json
    python benchmarks/bench_auto_replay.py --traces traces.json --device cpu --shape tiny   # a smoke run

Results are labelled "replayed": acceptance is the demo pair's, costs are the large target's.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_auto import PHASE_K  # noqa: E402
from bench_gpu import SHAPES, build_engine, free_device_memory, model_dir  # noqa: E402

from tandem import LLM  # noqa: E402
from tandem.builtin import demo_model_dir  # noqa: E402
from tandem.engine.runner import batch_buckets  # noqa: E402
from tandem.spec.auto import AutoK  # noqa: E402
from tandem.spec.goodput import StepCost  # noqa: E402



class Trace:
    """One request's verifies, by output position."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = sorted(rows, key=lambda r: r["pos"])
        self.positions = [r["pos"] for r in self.rows]
        last = self.rows[-1]
        self.length = last["pos"] + 1 + last["accepted"]

    def at(self, pos: int) -> dict:
        """The verify recorded at the largest position <= pos (the text there)."""
        return self.rows[max(bisect.bisect_right(self.positions, pos) - 1, 0)]

    def confidence(self, pos: int, depth: int) -> list[float] | None:
        """The drafter's recorded confidence for the `depth` tokens after `pos`: each token's from
        the latest recorded verify that drafted it (its prefix is the target's up to there), None
        when one was never drafted."""
        out = []
        for x in range(pos + 1, pos + depth + 1):
            i = bisect.bisect_left(self.positions, x) - 1  # the latest verify starting before x
            row = self.rows[i] if i >= 0 else None
            conf = row.get("confidence") if row is not None else None
            if not conf or x - row["pos"] > len(conf):
                return None
            out.append(conf[x - row["pos"] - 1])
        return out

    def run_at(self, pos: int, cap: int) -> int:
        """How many drafts from `pos` on the recorded verifies say would be accepted (at most
        cap): a step starting j tokens into a recorded run has its rest; a run that ended in a
        rejection stops there (the rejected token is hard), one accepted whole continues through
        the target's bonus token into the next recorded verify."""
        row = self.at(pos)
        left = max(row["accepted"] - (pos - row["pos"]), 0)
        if row["accepted"] < row["drafted"] or left >= cap:
            return min(left, cap)
        after = row["pos"] + row["accepted"] + 1  # the next verify starts after the bonus token
        if after >= self.length or after == pos:
            return min(left, cap)
        return min(left + 1 + self.run_at(after, cap - left - 1), cap)


def _table(saved: dict[str, float], scale: float = 1.0) -> dict[tuple[int, int], float]:
    """A table written to JSON with "a,b" keys (this script's --out, bench_auto's auto_cost) back
    to {(a, b): value x scale}."""
    return {tuple(map(int, k.split(","))): v * scale for k, v in saved.items()}


def measure_tables(args: argparse.Namespace, kmax: int, max_seqs: int) -> tuple[dict, dict]:
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    buckets = batch_buckets(max_seqs)
    with model_dir(shape) as path:
        t = time.perf_counter()
        engine = build_engine(shape, path, max_seqs, 2048, args.kv_gib, enforce_eager=args.device != "cuda",
                              device=args.device, max_k=kmax)
        print(f"target built in {time.perf_counter() - t:.1f} s", flush=True)
        verify = engine.runner.measure([(b, 1 + k) for b in buckets for k in range(kmax + 1)], repeats=20)
        del engine
        free_device_memory()
    demo = LLM(str(demo_model_dir()), device=args.device, max_num_seqs=max_seqs, kv_cache_memory="1GiB",
               speculative_config={"method": "dspark", "num_speculative_tokens": kmax, "adaptive": "auto"})
    draft = demo.engine.spec.proposer.measure(buckets, list(range(1, kmax + 1)), repeats=20)
    return verify, draft


def simulate(traces: list[Trace], conc: int, policy: str, kmax: int, verify: dict, draft: dict,
             phase_k: dict[str, int] = PHASE_K) -> dict:
    """Run every trace through at `conc` in flight; tokens / simulated seconds (`phase_k`: the
    `phase` policy's depth per phase)."""
    cost = StepCost(dict(verify), dict(draft), buckets=tuple(sorted({b for b, _ in verify})))
    auto = AutoK(kmax, tuple(range(1, kmax + 1)), StepCost(dict(verify), dict(draft), buckets=cost.buckets))
    queue = list(range(len(traces)))
    live: dict[int, int] = {}  # trace index -> output position
    tokens, seconds, steps, ks_seen = 0, 0.0, 0, {}
    calls = {"choose": 0, "repeat": 0, "join": 0}
    while queue or live:
        while queue and len(live) < conc:
            live[queue.pop(0)] = 0
        ids = sorted(live)
        rows = [traces[i].at(live[i]) for i in ids]
        caps = [max(traces[i].length - live[i] - 1, 0) for i in ids]  # each request's room for drafts
        if policy == "none":
            ks = [0] * len(ids)
        elif policy == "phase":
            ks = [min(phase_k[r["phase"]], kmax, c) for r, c in zip(rows, caps)]
        elif policy == "oracle":  # the ceiling: each step's accepted drafts known in advance
            runs = [traces[i].run_at(live[i], kmax) for i in ids]

            def rate(d: int) -> float:
                ks_d = [min(d, c) for c in caps]
                return (len(ids) + sum(min(r, k) for r, k in zip(runs, ks_d))) / cost.seconds(ks_d)

            depth = max(range(kmax + 1), key=rate)
            ks = [min(depth, c) for c in caps]
        elif policy.startswith("stop@"):
            ks = [_confidence_stop(traces[i].confidence(live[i], min(kmax, c)), min(kmax, c), float(policy[5:]))
                  for i, c in zip(ids, caps)]
        elif policy == "auto-ahead":
            names = [str(i) for i in ids]
            drafted = _ahead(auto, names, [r["phase"] for r in rows], caps, calls)
            ks = drafted
        elif policy in ("auto", "auto-noconf"):
            names = [str(i) for i in ids]
            drafted = auto.choose(names, [r["phase"] for r in rows], caps)
            ks = drafted
            if policy == "auto" and auto.cut_can_pay(drafted):
                # The drafter's confidence for the tokens it would draft here (`Trace.confidence`).
                confs = [traces[i].confidence(live[i], d) if d else None for i, d in zip(ids, drafted)]
                ks = auto.refine(names, drafted, confs)
        else:
            ks = [min(int(policy), c) for c in caps]
        if policy.startswith("stop@"):  # the block forward runs for every request that has room
            block = max(max(ks), 1)
            drafted = [block if c else 0 for c in caps]
        t = cost.seconds(ks, drafted if policy.startswith(("auto", "stop@")) else None)
        for i, r, k in zip(ids, rows, ks):
            got = traces[i].run_at(live[i], k) if k else 0
            if policy.startswith("auto") and k:
                auto.observe(str(i), k, got)
            step_tokens = min(1 + got, traces[i].length - live[i])
            live[i] += step_tokens
            tokens += step_tokens
            ks_seen[k] = ks_seen.get(k, 0) + 1
            if live[i] >= traces[i].length:
                del live[i]
                auto.remove(str(i))
        if policy.startswith("auto"):
            auto.observe_step(ks, drafted, t)
        seconds += t
        steps += 1
    out = {"tok_s": tokens / seconds, "tokens": tokens, "steps": steps, "k": dict(sorted(ks_seen.items()))}
    return {**out, "calls": calls} if policy == "auto-ahead" else out


def _confidence_stop(confidence: list[float] | None, cap: int, threshold: float) -> int:
    """Drafts kept: while the running product of the confidences stays at least `threshold`
    (all `cap` when none were recorded)."""
    if confidence is None:
        return cap
    reach = 1.0
    for depth, c in enumerate(confidence):
        reach *= c
        if reach < threshold:
            return depth
    return cap


def _ahead(auto: AutoK, ids: list[str], phases: list[str], rooms: list[int], calls: dict[str, int]) -> list[int]:
    """The ks `SpecDecoder.choose_ahead` gets from auto: the hold repeated, or joined by new
    requests, else a `choose`; a batch's held ks cut to the rooms."""
    held = auto.repeat(ids)
    if held is not None:
        calls["repeat"] += 1
    else:
        zero = auto.zero_held()
        holding = zero if zero is not None else auto.deepest_held()
        if holding is not None and len(ids) > len(holding):
            members = set(holding)
            new = [rid for rid in ids if rid not in members]
            if zero is not None:
                new_phases = [phase for rid, phase in zip(ids, phases) if rid not in members]
                held = [0] * len(ids) if auto.join_zero_hold(ids, new, new_phases) else None
            else:
                held = auto.join_batch_hold(ids, new, phases)
            calls["join"] += held is not None
    if held is None:
        calls["choose"] += 1
        return auto.choose(ids, phases, rooms)
    return auto.within(held, rooms) if any(held) else held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's depth")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=3, help="times the trace set is run through (default 3)")
    ap.add_argument("--cost-from", default=None, metavar="AUTO_JSON:CONFIG",
                    help="use the step costs a bench_auto.py auto configuration learned (e.g. auto.json:'dspark auto') "
                         "instead of measuring the large target")
    ap.add_argument("--tables", default=None, metavar="REPLAY_JSON",
                    help="use the step tables of a previous run's --out file instead of measuring")
    ap.add_argument("--phase-k", default=None, metavar="JSON",
                    help='`phase` with these phase_k instead of the seed\'s, e.g. \'{"reasoning": 7, "content": 5, "tool_call": 7}\'')
    ap.add_argument("--stop", default="0.05,0.1,0.2", metavar="T,...",
                    help="thresholds of the `stop@T` policies (a drafter stopping on its own confidence); '' for none")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    phase_k = {**PHASE_K, **json.loads(args.phase_k)} if args.phase_k else PHASE_K
    data = json.loads(Path(args.traces).read_text())
    kmax = int(data["kmax"])
    by_request: dict[str, list[dict]] = {}
    for row in data["rows"]:
        by_request.setdefault(row["request"], []).append(row)
    traces = [Trace(rows) for rows in by_request.values()] * args.repeat
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.tables:
        # The step tables a previous run measured (its --out file): the simulation, which is
        # deterministic, then runs anywhere, e.g. on a CPU machine after the GPU run.
        measured = json.loads(Path(args.tables).read_text())
        verify, draft = _table(measured["verify_ms"], 1e-3), _table(measured["draft_ms"], 1e-3)
    elif args.cost_from:
        # The step costs an auto run of bench_auto.py measured and learned (its host time
        # included): the live demo pair's own costs, for its ceiling.
        path, _, name = args.cost_from.partition(":")
        learned = json.loads(Path(path).read_text())["auto_cost"][name]
        verify, draft = _table(learned["verify"]), _table(learned["draft"])
        for key, extra in _table(learned["residual"]).items():
            verify[key] = verify.get(key, 0.0) + extra
    else:
        verify, draft = measure_tables(args, kmax, max(levels))
    print("measured step ms (batch: q=1..):")
    for b in sorted({b for b, _ in verify}):
        print(f"  {b:>3}: " + " ".join(f"{verify[(b, q)] * 1e3:7.3f}" for q in range(1, kmax + 2))
              + "   drafter d=1..: " + " ".join(f"{draft[(b, d)] * 1e3:6.3f}" for d in range(1, kmax + 1)))
    stops = [f"stop@{float(t):g}" for t in args.stop.split(",") if t.strip()]
    policies = ["none", *[str(k) for k in range(1, kmax + 1)], "phase", "auto-noconf", "auto", "auto-ahead", *stops,
                "oracle"]
    report = {"replayed": True, "shape": args.shape, "layers": args.layers, "kmax": kmax, "requests": len(traces),
              "phase_k": phase_k,
              "verify_ms": {f"{b},{q}": t * 1e3 for (b, q), t in verify.items()},
              "draft_ms": {f"{b},{d}": t * 1e3 for (b, d), t in draft.items()}, "results": {}}
    print(f"\nreplayed tok/s (simulated GPU time), {len(traces)} requests; ratio to no speculation")
    for c in levels:
        res = {p: simulate(traces, c, p, kmax, verify, draft, phase_k) for p in policies}
        base = res["none"]["tok_s"]
        best_fixed = max((str(k) for k in range(1, kmax + 1)), key=lambda k: res[k]["tok_s"])
        report["results"][c] = res
        line = "  ".join(f"{'K=' + p if p.isdigit() else p} {r['tok_s']:.0f} ({r['tok_s'] / base:.2f}x)"
                         for p, r in res.items())
        print(f"conc {c:>2}: {line}")
        top = res[best_fixed]["tok_s"]
        print(f"         best fixed K={best_fixed}; auto / best fixed = {res['auto']['tok_s'] / top:.3f},"
              f" auto / phase = {res['auto']['tok_s'] / res['phase']['tok_s']:.3f}, oracle / best fixed = "
              f"{res['oracle']['tok_s'] / top:.3f}; auto K counts {res['auto']['k']}")
        if stops:
            print("         " + ", ".join(f"{p} / best fixed = {res[p]['tok_s'] / top:.3f}" for p in stops))
        ahead = res["auto-ahead"]
        print(f"         auto-ahead / best fixed = {ahead['tok_s'] / top:.3f}; {ahead['steps']} steps, of which "
              f"choose {ahead['calls']['choose']}, repeat {ahead['calls']['repeat']}, join {ahead['calls']['join']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
