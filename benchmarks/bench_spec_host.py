"""Host time of the speculative stage per step, with a proposer that costs nothing: what a K
policy's own bookkeeping adds to every step (`SpecDecoder.propose`, `observe`, `observe_step`),
`adaptive: off` against `auto`, at several batch sizes. No model runs; requests advance by what a
random verify accepted. On a small GPU step this host time is what separates policies that choose
the same K (the device machine's Xeon runs Python about three times slower than the CPU machine).

    python benchmarks/bench_spec_host.py --batches 1,4,16 --steps 3000
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
from tandem.spec.goodput import hand_cost  # noqa: E402
from tandem.spec.proposer import Draft  # noqa: E402
from tandem.tokenizer import Tokenizer  # noqa: E402

KMAX = 4
# A GPU-like table: a verify token costs 5% of a 1 ms step, at every bucket.
COST = {b: {q: 1e-3 * (1 + 0.05 * (q - 1)) for q in range(1, KMAX + 2)} for b in (1, 2, 4, 8, 16, 32, 64)}


class FreeProposer:
    """Drafts K copies of one token, with a confidence, at no cost."""

    def __init__(self) -> None:
        self.confidence = torch.full((KMAX,), 0.9)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        return [Draft([5] * k, None, self.confidence[:k]) for k in ks]

    def observe(self, batch, kept, aux) -> None:  # noqa: ANN001
        pass

    def remove(self, request_id: str) -> None:
        pass

    def __len__(self) -> int:
        return 0


def microseconds_per_step(adaptive: str, batch: int, steps: int, tokenizer: Tokenizer) -> float:
    config = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": KMAX, "adaptive": adaptive})
    spec = SpecDecoder(config, tokenizer, 10**7, FreeProposer())
    if adaptive == "auto":
        spec.auto = AutoK(KMAX, config.draft_depths(), hand_cost(COST))
    requests = []
    for i in range(batch):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=10**7, temperature=0.0))
        req.num_computed_tokens = 2
        requests.append(req)
    rng, total = random.Random(0), 0.0
    for _ in range(steps):
        start = time.perf_counter()
        drafts = spec.propose(requests)
        sched = SchedulerOutput([ScheduledRequest.of(r, 1, tuple(drafts[r.request_id].tokens)
                                                     if r.request_id in drafts else ()) for r in requests])
        accepted = {s.request.request_id: rng.randint(0, len(s.draft)) for s in sched.scheduled}
        spec.observe(sched, accepted, None)
        spec.observe_step(sched, 1e-3)
        total += time.perf_counter() - start
        for s in sched.scheduled:  # each request moves on by what it kept
            s.request.output_token_ids.extend([7] * (1 + accepted[s.request.request_id]))
            s.request.num_computed_tokens = s.request.num_tokens - 1
    return total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the minimum is reported")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_dir(str(demo_model_dir()))
    print(f"{'batch':>5} {'off us/step':>12} {'auto us/step':>13} {'auto - off':>11}")
    for batch in (int(b) for b in args.batches.split(",")):
        times = {"off": [], "auto": []}
        for _ in range(args.repeats):
            for adaptive in times:
                times[adaptive].append(microseconds_per_step(adaptive, batch, args.steps, tokenizer))
        off, auto = min(times["off"]), min(times["auto"])
        print(f"{batch:>5} {off:12.1f} {auto:13.1f} {auto - off:11.1f}")


if __name__ == "__main__":
    main()
