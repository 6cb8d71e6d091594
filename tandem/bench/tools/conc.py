"""`tandem bench conc`: a concurrency sweep; aggregate and per-request tok/s and TTFT."""

from __future__ import annotations

import argparse

from tandem.bench.client import BenchClient
from tandem.bench.report import ms
from tandem.bench.stats import median, percentile
from tandem.bench.tools.common import Headline, ToolResult, gather_with_progress, parse_int_list, progress, unique_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,2,4,8", help="concurrent requests per level (default 1,2,4,8)")
    p.add_argument("--runs", type=int, default=1, help="rounds per level (default 1)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request (default 256)")
    p.add_argument("--seed", type=int, default=0)


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("conc", ["conc", "requests", "agg tok/s", "per-req tok/s", "TTFT p50 ms", "TTFT p99 ms", "ok"], [])
    levels = parse_int_list(args.concurrency)
    prompt_len = client.cap_length(args.prompt_len, args.max_tokens + 8)
    bar = progress(sum(levels) * args.runs, "conc", not args.quiet)
    headline: list[float] = []
    for c in levels:
        ok, agg_rates, total = [], [], 0
        for r in range(args.runs):
            seeds = [args.seed * 1_000_003 + c * 10007 + r * 101 + i for i in range(c)]
            prompts = [(await unique_prompt(client, prompt_len, sd))[0] for sd in seeds]
            samples = await gather_with_progress(
                [client.stream(p, max_tokens=args.max_tokens, ignore_eos=True) for p in prompts], bar)
            total += c
            good = [s for s in samples if s.ok]
            if good:
                wall = max(s.end for s in good) - min(s.start for s in samples)
                agg_rates.append(sum(s.tokens for s in good) / wall if wall > 0 else 0.0)
            ok += good
            res.samples += [{"concurrency": c, "round": r + 1, **s.to_dict()} for s in samples]
        res.total += total
        res.failed += total - len(ok)
        if not ok:
            res.rows.append([c, total, "-", "-", "-", "-", f"0/{total}"])
            continue
        ttfts = [s.ttft for s in ok]
        agg = median(agg_rates)
        res.rows.append([c, total, agg, median([s.decode_tok_s for s in ok if s.decode_tok_s is not None]),
                         ms(percentile(ttfts, 50)), ms(percentile(ttfts, 99)), f"{len(ok)}/{total}"])
        headline += agg_rates
    bar.close()
    res.headline = Headline("aggregate tok/s", headline)
    return res
