"""`tandem bench quality`: needle retrieval at several lengths and depths, scored as a pass count."""

from __future__ import annotations

import argparse

from tandem.bench.client import BenchClient
from tandem.bench.filler import fit_to_length
from tandem.bench.needle import haystack_prompt, make_needle, score
from tandem.bench.tools.common import Headline, ToolResult, cap_lengths, parse_int_list, progress

_TEMPLATE_RESERVE = 64  # chat template tokens around the message


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="2K,32K,128K", help="haystack lengths in tokens (default 2K,32K,128K)")
    p.add_argument("--depths", default="25,50,75", help="needle depths in percent (default 25,50,75)")
    p.add_argument("--max-tokens", type=int, default=64, help="answer tokens (raise it for reasoning models)")
    p.add_argument("--seed", type=int, default=0)


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("quality", ["length", "depth", "prompt tok", "expected", "answer", "pass"], [])
    lengths = cap_lengths(client, parse_int_list(args.lengths), args.max_tokens + _TEMPLATE_RESERVE, res.notes)
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    bar = progress(len(lengths) * len(depths), "quality", not args.quiet)
    passes: list[float] = []
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            seed = args.seed * 100003 + li * 101 + di
            needle = make_needle(seed)
            prompt, _ = await fit_to_length(lambda n: haystack_prompt(n, needle, depth / 100.0, seed), length,
                                           client.count_tokens, tokens_per_unit=15.0, tries=6)
            s = await client.stream(messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens)
            bar.update(1)
            res.total += 1
            answer = s.text.strip() if s.ok else None
            passed = s.ok and score(answer, needle.code)
            if not s.ok:
                res.failed += 1
            passes.append(1.0 if passed else 0.0)
            if not s.ok:
                shown = f"(failed: {str(s.error)[:40]})"
            elif not answer:
                shown = f"(no content; {len(s.reasoning)} chars of reasoning)" if s.reasoning else "(empty)"
            else:
                shown = answer.replace("\n", " ")[:40]
            res.rows.append([length, f"{depth}%", s.prompt_tokens if s.ok else "-", needle.code, shown, "pass" if passed else "FAIL"])
            res.samples.append({"length": length, "depth": depth, "needle": needle.fact, "expected": needle.code,
                                "passed": passed, **s.to_dict()})
    bar.close()
    n_pass = int(sum(passes))
    res.summary = {"passed": n_pass, "total": len(passes), "score": f"{n_pass}/{len(passes)}",
                   "lines": [f"needle retrieval: {n_pass}/{len(passes)}"]}
    res.headline = Headline("needle pass", passes)
    return res
