"""`tandem bench decode`: long generations, one at a time, with draft acceptance per run."""

from __future__ import annotations

import argparse
import random

from tandem.bench.client import BenchClient
from tandem.bench.report import ms, pct
from tandem.bench.specmetrics import NO_METRICS, acceptance, add_deltas, spec_delta, spec_lines
from tandem.bench.stats import percentile, summarize
from tandem.bench.tools.common import Headline, ToolResult, progress

_TOPICS = ("the history of lighthouses", "how bridges are designed", "a journey across a desert", "the life of bees",
           "how compilers work", "a city built on water", "the invention of clocks", "a mountain rescue",
           "the economics of a small bakery", "how rivers shape valleys", "a chess tournament", "the first printing press")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=5, help="sequential generations (default 5)")
    p.add_argument("--max-tokens", type=int, default=768, help="tokens per generation (default 768)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="ask the server to generate exactly --max-tokens (vLLM/Tandem extension)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="varies the prompts")


def decode_prompt(i: int, seed: int) -> str:
    rng = random.Random(seed * 1000003 + i)
    topic = rng.choice(_TOPICS)
    return (f"[{rng.randrange(16**6):06x}] Write a long, detailed essay about {topic}, "
            f"with at least {rng.randint(6, 12)} paragraphs.")


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("decode", ["run", "tokens", "tok/s", "TTFT ms", "ITL p50 ms", "ITL p99 ms", "accept", "accept len", "status"], [])
    bar = progress(args.runs, "decode", not args.quiet)
    all_itls: list[float] = []
    deltas = []  # each run's spec counter changes, None where the server has no counters
    for i in range(args.runs):
        prompt = decode_prompt(i, args.seed)
        before = await client.spec_counters()
        if args.endpoint == "chat":
            s = await client.stream(messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                                    ignore_eos=args.ignore_eos, temperature=args.temperature)
        else:
            s = await client.stream(prompt, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature)
        delta = spec_delta(before, await client.spec_counters())
        deltas.append(delta)
        spec = acceptance(delta)
        bar.update(1)
        res.total += 1
        if not s.ok:
            res.failed += 1
            res.rows.append([i + 1, "-", "-", "-", "-", "-", "-", "-", f"failed: {s.error}"[:60]])
            res.samples.append({"run": i + 1, **s.to_dict(), "spec": spec})
            continue
        itls = s.itls
        all_itls += itls
        res.rows.append([i + 1, s.tokens, s.decode_tok_s, ms(s.ttft), ms(percentile(itls, 50)), ms(percentile(itls, 99)),
                         pct(spec and spec["acceptance_rate"]), _f(spec and spec["mean_acceptance_length"]), "ok"])
        res.samples.append({"run": i + 1, **s.to_dict(), "spec": spec})
    bar.close()
    ok = [x for x in res.samples if x["ok"]]
    tps = summarize([x["decode_tok_s"] for x in ok if x["decode_tok_s"] is not None])
    ttft = summarize([x["ttft"] for x in ok])
    rates = [x["spec"]["acceptance_rate"] for x in ok if x["spec"] and x["spec"]["acceptance_rate"] is not None]
    overall = acceptance(add_deltas(deltas))
    res.summary = {
        "decode_tok_s": tps, "ttft_s": ttft, "itl_s": summarize(all_itls),
        "acceptance_rate": summarize(rates) if rates else None,
        "spec": overall,  # every run's counter changes together; None: no speculative decoding metrics
        "lines": [
            f"decode tok/s: median {_f(tps['median'])}  min {_f(tps['min'])}  max {_f(tps['max'])}  (n={tps['n']})",
            f"TTFT ms: median {ms(ttft['median'])}   ITL ms: p50 {ms(percentile(all_itls, 50))}  p99 {ms(percentile(all_itls, 99))}",
            _acceptance_line(overall),
            *(spec_lines([(str(i + 1), x["spec"]) for i, x in enumerate(res.samples)] + [("all", overall)])
              if overall is not None else []),
        ],
    }
    if any(x["num_chunks"] < x["tokens"] for x in ok):
        res.notes.append("some chunks carried several tokens (speculative decoding or output held back by the server): "
                         "ITL is measured between chunks, tok/s from usage counts")
    res.headline = Headline("decode tok/s", [x["decode_tok_s"] for x in ok if x["decode_tok_s"] is not None])
    return res


def _acceptance_line(overall: dict | None) -> str:
    if overall is None:
        return f"draft acceptance: {NO_METRICS}"
    if not overall["drafts"]:
        return "draft acceptance: - (the server counts speculative decoding but drafted nothing in these runs)"
    return (f"draft acceptance, all runs: {pct(overall['acceptance_rate'])} of {int(overall['draft_tokens'])} draft tokens, "
            f"mean acceptance length {_f(overall['mean_acceptance_length'])}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
