"""`tandem bench ngram-ceiling`: replay prompt/completion pairs through a simulated prompt-lookup
proposer with greedy verification (see tandem/bench/ngram.py) and print, for K = 1..8, the
acceptance ceiling and mean accepted length. Pairs come from a JSONL file or are collected from the
server (greedy, temperature 0)."""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from tandem.bench.client import BenchClient, BenchError
from tandem.bench.ngram import simulate_many
from tandem.bench.report import pct
from tandem.bench.tools.common import Headline, ToolResult, parse_int_list, progress

_CODE = '''def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            order_id, customer, amount = line.strip().split(",")
            orders.append({"id": order_id, "customer": customer, "amount": float(amount)})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals
'''
_NOTE = ("The meeting on Tuesday covered the warehouse move, the new shipping schedule and the budget for the "
         "spring catalogue. The warehouse move starts on the first of the month; the shipping schedule changes "
         "from three days a week to five days a week; the budget for the spring catalogue stays the same as last year.")
COLLECT_PROMPTS = (
    f"Add type hints and docstrings to this Python code. Return the whole file.\n\n{_CODE}",
    f"Rename the variable `orders` to `records` everywhere in this code and return the full code.\n\n{_CODE}",
    f"Rewrite this note as a bulleted list, keeping every detail.\n\n{_NOTE}",
    f"Convert this note to JSON with the keys topic, date and decision for each item.\n\n{_NOTE}",
    f"Explain step by step what this code does, quoting each line you explain.\n\n{_CODE}",
    f"Fix any grammar problems in this text and return the corrected text in full.\n\n{_NOTE}",
)
_WORD = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="JSONL of pairs: {prompt, completion} text or {prompt_ids, completion_ids}")
    p.add_argument("--collect", type=int, default=0, help="collect this many pairs from the server instead (greedy)")
    p.add_argument("--prompts", help="JSONL with a `prompt` per line for --collect (default: built-in editing tasks)")
    p.add_argument("--save", help="write the collected pairs to this JSONL")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens when collecting (default 256)")
    p.add_argument("--k", default="1,2,3,4,5,6,7,8", help="draft lengths to simulate (default 1..8)")
    p.add_argument("--min-n", type=int, default=1, help="shortest n-gram to match (default 1)")
    p.add_argument("--max-n", type=int, default=3, help="longest n-gram to match (default 3)")
    p.add_argument("--tokenizer", choices=["auto", "server", "words"], default="auto",
                   help="how text becomes tokens: the server's /tokenize, or words and punctuation (auto: server if it can)")


def needs_server(args: argparse.Namespace) -> bool | None:
    """True when the server is required, None when it helps (its tokenizer), False when unused."""
    if args.collect or args.tokenizer == "server":
        return True
    if args.tokenizer == "words" or _ids_only(args.data):
        return False
    return None


def _ids_only(path: str | None) -> bool:
    if not path:
        return False
    rows = _read_jsonl(path)
    return bool(rows) and all("prompt_ids" in r and "completion_ids" in r for r in rows)


def _read_jsonl(path: str) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise BenchError(f"cannot read {path}: {e.strerror}") from e
    rows = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise BenchError(f"{path}:{i} is not valid JSON: {e}") from e
    return rows


class _WordTokenizer:
    """Words and punctuation (with their leading space) as tokens; ids assigned on first sight."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in _WORD.findall(text)]


async def _collect(client: BenchClient, args: argparse.Namespace, res: ToolResult) -> list[dict]:
    prompts = [r["prompt"] for r in _read_jsonl(args.prompts)] if args.prompts else list(COLLECT_PROMPTS)
    rng = random.Random(0)
    bar = progress(args.collect, "collect", not args.quiet)
    rows = []
    for i in range(args.collect):
        prompt = prompts[i % len(prompts)]
        if i >= len(prompts):
            prompt = f"[{rng.randrange(16**6):06x}] {prompt}"
        s = await client.stream(messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens)
        bar.update(1)
        res.total += 1
        if not s.ok:
            res.failed += 1
            continue
        rows.append({"prompt": prompt, "completion": s.reasoning + s.text})
    bar.close()
    if args.save:
        Path(args.save).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


async def run(client: BenchClient | None, args: argparse.Namespace) -> ToolResult:
    res = ToolResult("ngram-ceiling", ["K", "acceptance", "mean accept len", "tokens/step", "draft coverage", "drafted", "accepted"], [])
    if args.collect:
        assert client is not None
        rows = await _collect(client, args, res)
    elif args.data:
        rows = _read_jsonl(args.data)
    else:
        raise BenchError("ngram-ceiling needs --data FILE.jsonl or --collect N")
    words = _WordTokenizer()
    use_server = client is not None and args.tokenizer != "words"
    pairs = []
    for r in rows:
        if "prompt_ids" in r and "completion_ids" in r:
            pairs.append((list(r["prompt_ids"]), list(r["completion_ids"])))
            continue
        prompt, completion = r.get("prompt", ""), r.get("completion", "")
        if use_server:
            p_ids, c_ids = await client.tokenize_ids(prompt), await client.tokenize_ids(completion)
            if p_ids is None or c_ids is None:
                if args.tokenizer == "server":
                    raise BenchError("the server has no working POST /tokenize; use --tokenizer words")
                use_server = False
            else:
                pairs.append((p_ids, c_ids))
                continue
        pairs.append((words(prompt), words(completion)))
    if not pairs:
        raise BenchError("no prompt/completion pairs to simulate")
    res.notes.append(f"{len(pairs)} pairs, {sum(len(c) for _, c in pairs)} completion tokens, tokens from "
                     f"{'the server tokenizer' if use_server else 'ids in the file' if not words.vocab else 'words (no server tokenizer)'}; "
                     f"n-gram {args.min_n}..{args.max_n}")
    ks = parse_int_list(args.k)
    stats = simulate_many(pairs, ks, args.min_n, args.max_n)
    for st in stats:
        res.rows.append([st.k, pct(st.acceptance_rate), st.mean_acceptance_length, st.tokens_per_step, pct(st.draft_coverage),
                         st.draft_tokens, st.accepted_tokens])
    res.summary = {"per_k": [st.to_dict() for st in stats]}
    res.samples = [{"prompt_tokens": len(p), "completion_tokens": len(c)} for p, c in pairs]
    res.headline = Headline("tokens/step", [st.tokens_per_step or 0.0 for st in stats])
    return res
