"""`tandem bench ctx`: TTFT (prefill) and decode speed at several context lengths."""

from __future__ import annotations

import argparse

from tandem.bench.client import BenchClient
from tandem.bench.report import ms
from tandem.bench.stats import median
from tandem.bench.tools.common import Headline, ToolResult, cap_lengths, parse_int_list, progress, unique_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="2K,8K,32K,128K", help="context lengths in tokens (default 2K,8K,32K,128K)")
    p.add_argument("--runs", type=int, default=1, help="requests per length (default 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--seed", type=int, default=0)


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("ctx", ["context", "prompt tok", "cached", "TTFT ms", "prefill tok/s", "decode tok/s", "out tok", "ok"], [])
    lengths = cap_lengths(client, parse_int_list(args.lengths), args.max_tokens + 8, res.notes)
    bar = progress(len(lengths) * args.runs, "ctx", not args.quiet)
    headline: list[float] = []
    for li, length in enumerate(lengths):
        got = []
        for r in range(args.runs):
            seed = args.seed * 100003 + li * 1009 + r
            prompt, _ = await unique_prompt(client, length, seed)
            s = await client.stream(prompt, max_tokens=args.max_tokens, ignore_eos=True)
            bar.update(1)
            res.total += 1
            prefill = s.prompt_tokens / s.ttft if s.ok and s.prompt_tokens and s.ttft else None
            res.samples.append({"context": length, "run": r + 1, **s.to_dict(), "prefill_tok_s": prefill})
            if not s.ok:
                res.failed += 1
                continue
            got.append((s, prefill))
        if not got:
            res.rows.append([length, "-", "-", "-", "-", "-", "-", f"0/{args.runs}"])
            continue
        ttft = median([s.ttft for s, _ in got])
        pre = median([p for _, p in got if p is not None])
        dec = median([s.decode_tok_s for s, _ in got if s.decode_tok_s is not None])
        res.rows.append([length, _int_median([s.prompt_tokens or 0 for s, _ in got]), _int_median([s.cached_tokens or 0 for s, _ in got]),
                         ms(ttft), pre, dec, _int_median([s.tokens for s, _ in got]), f"{len(got)}/{args.runs}"])
        headline += [s.decode_tok_s for s, _ in got if s.decode_tok_s is not None]
    bar.close()
    res.headline = Headline("decode tok/s", headline)
    return res


def _int_median(values: list[int]) -> int:
    return int(round(median(values) or 0))
