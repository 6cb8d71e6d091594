"""`tandem bench pp-tg`: a llama-bench-style table. `ppN` = prefill speed of N prompt tokens
(prompt tokens / time to first token), `tgN` = decode speed over N generated tokens, `@ dD` = with
D tokens already in context (for pp, the D-token prefix is sent first so a prefix cache holds it;
the `cached` column shows what the server reported as reused)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from tandem.bench.client import BenchClient
from tandem.bench.filler import filler_prompt, filler_words, fit_to_length
from tandem.bench.stats import mean, median, stdev
from tandem.bench.tools.common import Headline, ToolResult, progress, unique_prompt

_TEST = re.compile(r"^(pp|tg)(\d+)(?:@d(\d+))?$")


@dataclass(frozen=True)
class Case:
    kind: str  # "pp" or "tg"
    n: int
    depth: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}{self.n}" + (f" @ d{self.depth}" if self.depth else "")


def parse_tests(text: str) -> list[Case]:
    out = []
    for part in text.split(","):
        p = part.strip().replace(" ", "").lower()
        m = _TEST.match(p)
        if not m:
            raise ValueError(f"bad test {part!r}: use ppN, tgN, ppN@dD or tgN@dD")
        out.append(Case(m.group(1), int(m.group(2)), int(m.group(3) or 0)))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tests", default="pp512,tg128,pp2048@d4096,tg128@d4096",
                   help="comma-separated tests (default pp512,tg128,pp2048@d4096,tg128@d4096)")
    p.add_argument("--runs", type=int, default=3, help="repetitions per test (default 3)")
    p.add_argument("--seed", type=int, default=0)


async def _one(client: BenchClient, t: Case, seed: int) -> tuple[dict, float | None]:
    if t.kind == "tg":
        prompt = (await unique_prompt(client, t.depth, seed))[0] if t.depth else filler_prompt(12, seed)
        s = await client.stream(prompt, max_tokens=t.n, ignore_eos=True)
        return {**s.to_dict(), "test": t.name}, s.decode_tok_s if s.ok else None
    prefix = ""
    if t.depth:
        prefix = (await unique_prompt(client, t.depth, seed))[0]
        await client.stream(prefix, max_tokens=1)  # puts the prefix in the server's prefix cache, if it has one
    body, _ = await fit_to_length(lambda n: filler_words(n, seed + 7), t.n, client.count_tokens)
    prompt = (prefix + " " + body) if prefix else filler_prompt(0, seed) + " " + body
    s = await client.stream(prompt, max_tokens=1)
    if not s.ok or not s.ttft or not s.prompt_tokens:
        return {**s.to_dict(), "test": t.name}, None
    new_tokens = s.prompt_tokens - (s.cached_tokens or 0) if t.depth else s.prompt_tokens
    return {**s.to_dict(), "test": t.name, "new_prompt_tokens": new_tokens}, new_tokens / s.ttft


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("pp-tg", ["model", "test", "t/s", "± std", "cached", "runs ok"], [])
    tests = parse_tests(args.tests)
    bar = progress(len(tests) * args.runs, "pp-tg", not args.quiet)
    headline: list[float] = []
    for ti, t in enumerate(tests):
        need = t.depth + t.n + 8
        if client.max_model_len is not None and need > client.max_model_len:
            res.notes.append(f"{t.name} skipped: needs {need} tokens, server max_model_len is {client.max_model_len}")
            bar.update(args.runs)
            continue
        rates, cached = [], []
        for r in range(args.runs):
            sample, rate = await _one(client, t, args.seed * 100003 + ti * 1009 + r)
            bar.update(1)
            res.total += 1
            res.samples.append({**sample, "run": r + 1, "tok_s": rate})
            if rate is None:
                res.failed += 1
                continue
            rates.append(rate)
            cached.append(sample.get("cached_tokens") or 0)
        res.rows.append([client.model, t.name, mean(rates), stdev(rates), int(median(cached)) if cached else "-",
                         f"{len(rates)}/{args.runs}"])
        if t.kind == "tg":
            headline += rates
    bar.close()
    res.headline = Headline("tg tok/s", headline)
    return res
