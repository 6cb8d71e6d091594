"""`tandem bench streamgap`: how much a large prefill arriving mid-stream stalls a streaming
request. Each run streams the same kind of request twice: alone (its own baseline), then with a
large prompt sent once it has produced --after tokens. Reports max and p99 inter-token gaps."""

from __future__ import annotations

import argparse
import asyncio

from tandem.bench.client import BenchClient
from tandem.bench.filler import filler_prompt
from tandem.bench.report import ms
from tandem.bench.stats import percentile
from tandem.bench.tools.common import Headline, ToolResult, progress, unique_prompt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3, help="baseline + disturbed pairs (default 3)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens of the streaming request (default 256)")
    p.add_argument("--prefill-len", type=int, default=8192, help="prompt tokens of the intruding request (default 8192)")
    p.add_argument("--after", type=int, default=16, help="send the intruder after this many streamed tokens (default 16)")
    p.add_argument("--seed", type=int, default=0)


async def _disturbed(client: BenchClient, prompt: str, intruder: str, args: argparse.Namespace):
    started = asyncio.Event()
    intruder_task: asyncio.Task | None = None

    async def watch() -> None:
        # the intruder leaves once the streaming request has produced `after` chunks
        nonlocal intruder_task
        await started.wait()
        intruder_task = asyncio.create_task(client.stream(intruder, max_tokens=1))

    watcher = asyncio.create_task(watch())
    s = await client.stream(prompt, max_tokens=args.max_tokens, ignore_eos=True,
                            on_chunk=lambda n: started.set() if n >= args.after else None)
    started.set()
    await watcher
    intr = await intruder_task if intruder_task else None
    return s, intr


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("streamgap", ["run", "phase", "tokens", "ITL p50 ms", "ITL p99 ms", "max gap ms", "intruder TTFT ms"], [])
    prefill = client.cap_length(args.prefill_len, 16)
    if prefill != args.prefill_len:
        res.notes.append(f"intruder prompt capped to {prefill} tokens (server max_model_len {client.max_model_len})")
    bar = progress(args.runs * 2, "streamgap", not args.quiet)
    base_max, dist_max, base_p99, dist_p99 = [], [], [], []
    for r in range(args.runs):
        seed = args.seed * 100003 + r * 17
        for phase in ("baseline", "disturbed"):
            prompt = filler_prompt(24, seed * 2 + (phase == "disturbed"))
            intr = None
            if phase == "baseline":
                s = await client.stream(prompt, max_tokens=args.max_tokens, ignore_eos=True)
            else:
                intruder, _ = await unique_prompt(client, prefill, seed + 5)
                s, intr = await _disturbed(client, prompt, intruder, args)
            bar.update(1)
            res.total += 1 + (intr is not None)
            itls = s.itls
            sample = {"run": r + 1, "phase": phase, **s.to_dict(), "intruder": intr.to_dict() if intr else None}
            res.samples.append(sample)
            if not s.ok or not itls:
                res.failed += 1
                res.rows.append([r + 1, phase, "-", "-", "-", "-", "-"])
                continue
            if intr is not None and not intr.ok:
                res.failed += 1
            mx, p99 = max(itls), percentile(itls, 99)
            (base_max if phase == "baseline" else dist_max).append(mx)
            (base_p99 if phase == "baseline" else dist_p99).append(p99)
            res.rows.append([r + 1, phase, s.tokens, ms(percentile(itls, 50)), ms(p99), ms(mx),
                             ms(intr.ttft) if intr is not None and intr.ok else "-"])
    bar.close()
    lines = []
    if base_max and dist_max:
        b, d = max(base_max), max(dist_max)
        lines.append(f"max gap: baseline {ms(b)} ms -> with a {prefill}-token prefill {ms(d)} ms ({d / b:.1f}x)")
        lines.append(f"p99 gap: baseline {ms(max(base_p99))} ms -> {ms(max(dist_p99))} ms")
    res.summary = {"baseline_max_gap_s": base_max, "disturbed_max_gap_s": dist_max, "baseline_p99_gap_s": base_p99,
                   "disturbed_p99_gap_s": dist_p99, "intruder_tokens": prefill, "lines": lines}
    res.headline = Headline("max gap s", dist_max, higher_is_better=False)
    return res
