"""Host time of the speculative stage per step, with a proposer that costs nothing: what a K
policy's own bookkeeping adds to every step, `adaptive: off` against `auto`, at several batch
sizes. No model runs; requests advance by what a random verify accepted (each draft position
accepted with probability `--accept`, as the demo pair's DSpark does in reasoning). On a small GPU
step this host time is what separates policies that choose the same K (the device machine's Xeon
runs Python about three times slower than the CPU machine).

Three paths, each the calls the engine makes on it:
  sync   a synchronous verify step: `propose` (the K choice and the drafts), `observe`, `observe_step`;
  ahead  a speculative step ahead (DSpark with async scheduling): `choose_ahead`, `pending_choices`,
         `commit_ahead`, and when the step before lands, `observe_ahead` per request and `observe_step`;
  plain  a step that drafts nothing going ahead (auto at K = 0, the drafter 8x dearer than the
         table so that drafting does not pay): `plan_ahead`, the K counts, `observe`,
         `observe_step`; a probe out of K = 0 runs the sync path. Its baseline is `phase` with
         every phase_k 0, which drafts nothing either.
`--turnover P`: each step, with probability P, one request finishes and a new one takes its place
(the live workload's 83-token requests at 8-16 requests change the batch every few steps).
`--phase-mix`: every other request starts in reasoning (its prompt ends with `<think>`), the
others in content, so that a change of requests also changes the batch's mix of phases, as on
the live workload (without it every request is in content).
The cost table is the demo pair's, measured on the H100 box at Kmax 7 (BENCHMARKS.md, session 13):
a verify token costs ~1% of a 0.31 ms step at batch 1, ~5% at 16, and the drafter 0.11-0.32 ms.

    python benchmarks/bench_spec_host.py --batches 1,4,16 --steps 3000 --path ahead
    python benchmarks/bench_spec_host.py --batches 8,16 --path ahead --turnover 0.3
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.builtin import demo_model_dir  # noqa: E402
from tandem.config import SpecConfig  # noqa: E402
from tandem.core import Request, SamplingParams  # noqa: E402
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from tandem.spec.auto import AutoK  # noqa: E402
from tandem.spec.controller import SpecDecoder  # noqa: E402
from tandem.spec.goodput import StepCost  # noqa: E402
from tandem.spec.proposer import Draft  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402

KMAX = 7
BUCKETS = (1, 2, 4, 8, 16)
# ms: the target's step per (bucket, q = 1..8) and the drafter's per (bucket, depth 1..7), dspark
# auto's start-up table in call 18 of session 13 (H100 box, demo pair).
VERIFY_MS = {1: (0.310, 0.306, 0.313, 0.318, 0.316, 0.314, 0.314, 0.313),
             2: (0.313, 0.310, 0.315, 0.317, 0.307, 0.327, 0.324, 0.323),
             4: (0.311, 0.322, 0.323, 0.327, 0.331, 0.339, 0.340, 0.341),
             8: (0.312, 0.324, 0.333, 0.339, 0.350, 0.361, 0.369, 0.379),
             16: (0.322, 0.343, 0.359, 0.371, 0.399, 0.420, 0.446, 0.448)}
DRAFT_MS = {1: (0.111, 0.120, 0.134, 0.147, 0.160, 0.171, 0.184),
            2: (0.115, 0.129, 0.143, 0.157, 0.175, 0.191, 0.206),
            4: (0.121, 0.135, 0.152, 0.169, 0.189, 0.205, 0.221),
            8: (0.128, 0.148, 0.167, 0.190, 0.212, 0.233, 0.254),
            16: (0.139, 0.169, 0.201, 0.230, 0.261, 0.294, 0.321)}


def step_cost(draft_scale: float) -> StepCost:
    """The table as a padded cost; `draft_scale` multiplies the drafter's times (a draft model's
    K sequential forwards make drafting dearer than it pays: the `plain` path's K = 0 regime)."""
    verify = {(b, q + 1): t / 1e3 for b, row in VERIFY_MS.items() for q, t in enumerate(row)}
    draft = {(b, d + 1): draft_scale * t / 1e3 for b, row in DRAFT_MS.items() for d, t in enumerate(row)}
    return StepCost(verify, draft, buckets=BUCKETS, plain_overlaps=True)


class FreeProposer:
    """Drafts K copies of one token, with a confidence, at no cost."""

    def __init__(self) -> None:
        self.confidence = torch.full((KMAX,), 0.9)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        return [Draft([5] * k, None, self.confidence[:k]) for k in ks]

    def observe(self, batch, kept, aux) -> None:  # noqa: ANN001
        pass

    def land_ahead(self, request_id: str, start: int, kept: int) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass

    def __len__(self) -> int:
        return 0


class Run:
    """One policy's stage on `batch` endless greedy requests."""

    def __init__(self, adaptive: str, batch: int, tokenizer: Tokenizer, accept: float, draft_scale: float,
                 turnover: float = 0.0, phase_mix: bool = False) -> None:
        raw = {"method": "dspark", "num_speculative_tokens": KMAX, "adaptive": adaptive}
        if adaptive == "phase0":  # every phase at K = 0: the plain path's baseline (no request ever drafts)
            raw.update(adaptive="phase", phase_k={"reasoning": 0, "content": 0, "tool_call": 0})
        config = SpecConfig.parse(raw)
        self.spec = SpecDecoder(config, tokenizer, 10**7, FreeProposer())
        if adaptive == "auto":
            self.spec.auto = AutoK(KMAX, config.draft_depths(), step_cost(draft_scale))
        # every other request's prompt ends with <think> (reasoning) under --phase-mix
        self.think = tokenizer.fast.token_to_id("<think>") if phase_mix else None
        self.requests = [self.new_request(i) for i in range(batch)]
        self.served = batch
        self.rng = random.Random(0)
        self.accept = accept
        self.turnover = turnover
        self.change = False  # a step ahead landed alone: the batch changes now
        self.pending: tuple[list[int], list[object | None]] | None = None  # the step ahead in flight

    def new_request(self, i: int) -> Request:
        prompt = [1, 2, 3] if self.think is None or i % 2 else [1, 2, self.think]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=None, temperature=0.0))
        req.max_tokens = 10**7  # what the engine resolves max_tokens=None to (the context length)
        req.num_computed_tokens = 2
        return req

    def accepted(self, k: int) -> int:
        n = 0
        while n < k and self.rng.random() < self.accept:
            n += 1
        return n

    def seconds(self, ks: Sequence[int]) -> float:
        """A step's measured time, as the device would give it: the cost model's own table (so the
        learned residual stays near 0 and the controller's choice follows the table)."""
        auto = self.spec.auto
        return auto.cost.modelled(ks) if auto is not None else 1e-3

    def advance(self, kept: dict[str, int]) -> None:
        for req in self.requests:
            req.output_token_ids.extend([7] * (1 + kept[req.request_id]))
            req.num_computed_tokens = req.num_tokens - 1
        change, self.change = self.change, False
        if change or (self.turnover and self.pending is None and self.rng.random() < self.turnover):
            # One request finishes (once no step ahead is in flight for it) and a new one, past
            # its prompt, takes its place, where the engine's batch keeps it: at the end.
            gone = self.requests.pop(self.rng.randrange(len(self.requests)))
            self.spec.remove(gone.request_id)
            self.requests.append(self.new_request(self.served))
            self.served += 1

    def sync_step(self) -> dict[str, int]:
        spec = self.spec
        drafts = spec.propose(self.requests)
        sched = SchedulerOutput([ScheduledRequest.of(r, 1, tuple(drafts[r.request_id].tokens)
                                                     if r.request_id in drafts else ()) for r in self.requests])
        kept = {s.request.request_id: self.accepted(len(s.draft)) for s in sched.scheduled}
        spec.observe(sched, kept, None)
        spec.observe_step(sched, self.seconds([len(s.draft) for s in sched.scheduled]))
        return kept

    def ahead_step(self) -> dict[str, int]:
        if self.turnover and self.pending is not None and self.rng.random() < self.turnover:
            self.change = True
            return self.land()  # the step in flight lands alone, and the batch changes
        spec, reqs = self.spec, self.requests
        in_flight = self.pending[0] if self.pending is not None else [0] * len(reqs)
        ks = spec.choose_ahead(reqs, in_flight)
        held = ks is None
        ks = spec.held_ks(reqs) if held else ks
        pendings = spec.pending_choices(reqs)
        if not held:
            spec.commit_ahead(reqs, ks)
        kept = {r.request_id: 0 for r in reqs}
        if self.pending is not None:  # the step before lands
            prev_ks, prev_pendings = self.pending
            for req, k, p in zip(reqs, prev_ks, prev_pendings):
                kept[req.request_id] = n = self.accepted(k)
                spec.observe_ahead(req, req.num_computed_tokens, k, n, p)
            sched = SchedulerOutput([ScheduledRequest.of(r, 1 + k, (5,) * k) for r, k in zip(reqs, prev_ks)])
            spec.observe_step(sched, self.seconds(prev_ks), prev_ks)
        self.pending = (ks, pendings)
        return kept

    def land(self) -> dict[str, int]:
        """The step ahead in flight lands with nothing launched after it."""
        assert self.pending is not None
        spec, reqs = self.spec, self.requests
        (prev_ks, prev_pendings), self.pending = self.pending, None
        kept = {}
        for req, k, p in zip(reqs, prev_ks, prev_pendings):
            kept[req.request_id] = n = self.accepted(k)
            spec.observe_ahead(req, req.num_computed_tokens, k, n, p)
        sched = SchedulerOutput([ScheduledRequest.of(r, 1 + k, (5,) * k) for r, k in zip(reqs, prev_ks)])
        spec.observe_step(sched, self.seconds(prev_ks), prev_ks)
        return kept

    def plain_step(self) -> dict[str, int]:
        spec = self.spec
        if not spec.plan_ahead(self.requests):
            return self.sync_step()  # a probe (or drafting paid): the synchronous verify
        sched = SchedulerOutput([ScheduledRequest.of(r, 1, ()) for r in self.requests])
        for _ in spec.k_counts.items():  # the engine's _count_spec_step reads the K counts
            pass
        spec.take_drafter_forwards()
        spec.observe(sched, {}, None)
        spec.observe_step(sched, self.seconds([0] * len(self.requests)))
        return {r.request_id: 0 for r in self.requests}


def microseconds_per_step(path: str, adaptive: str, batch: int, steps: int, tokenizer: Tokenizer,
                          accept: float, turnover: float = 0.0, phase_mix: bool = False) -> tuple[float, float]:
    """(µs per step, mean K chosen) over `steps` steps after as many to warm up."""
    run = Run(adaptive, batch, tokenizer, accept, draft_scale=8.0 if path == "plain" else 1.0, turnover=turnover,
              phase_mix=phase_mix)
    step = {"sync": run.sync_step, "ahead": run.ahead_step, "plain": run.plain_step}[path]
    total, ks = 0.0, 0
    for i in range(2 * steps):
        start = time.perf_counter()
        kept = step()
        if i >= steps:
            total += time.perf_counter() - start
            ks += sum(k for _, k in run.spec.chosen_k)
        run.advance(kept)
    return total / steps * 1e6, ks / steps / batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--path", default="sync,ahead,plain", help="comma list of sync, ahead, plain")
    ap.add_argument("--accept", type=float, default=0.8, help="per-position acceptance of a draft token")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the minimum is reported")
    ap.add_argument("--turnover", type=float, default=0.0,
                    help="per step, the chance that one request finishes and a new one takes its place")
    ap.add_argument("--phase-mix", action="store_true", help="every other request starts in reasoning")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_dir(str(demo_model_dir()))
    print("off: adaptive off (Kmax every step); on the plain path, phase with every phase_k 0 (nothing drafts)")
    print(f"{'path':>6} {'batch':>5} {'off us/step':>12} {'auto us/step':>13} {'auto - off':>11} {'auto mean K':>12}")
    for path in args.path.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            base = "phase0" if path == "plain" else "off"
            times: dict[str, list[tuple[float, float]]] = {base: [], "auto": []}
            for _ in range(args.repeats):
                for adaptive in times:
                    times[adaptive].append(microseconds_per_step(path, adaptive, batch, args.steps, tokenizer,
                                                                 args.accept, args.turnover, args.phase_mix))
            off, auto = min(times[base]), min(times["auto"])
            print(f"{path:>6} {batch:>5} {off[0]:12.1f} {auto[0]:13.1f} {auto[0] - off[0]:11.1f} {auto[1]:12.2f}")


if __name__ == "__main__":
    main()
