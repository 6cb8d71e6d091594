"""`tandem bench agentic`: multi-turn agentic conversations whose turns alternate reasoning, code,
JSON and tool-call tasks; decode tok/s per phase (reasoning / content / tool_call), TTFT, and the
draft acceptance per phase where the server's /metrics has it.

Per phase, a request's stream is cut into runs of chunks of one phase; a run's time goes from the
chunk before its first (the request's first chunk for the first run: TTFT is not phase time) to
its last chunk. A phase's tok/s is its tokens over its time, summed over every request of a
concurrency level; each request's first chunk and its one token (the prefill's) count in neither.

`--source builtin` builds conversations from small templates with random names and numbers; each
turn sees the history (assistant messages with their tool calls, a canned result per call, never
the reasoning). `--source demo` takes its turns from the demo model's corpus, the only prompts
that model answers sensibly; those turns are independent requests (no history is carried).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.client import BenchClient, StreamSample
from tandem.bench.report import ms, pct
from tandem.bench.specmetrics import acceptance, spec_delta, spec_lines
from tandem.bench.stats import percentile
from tandem.bench.tools.common import Headline, ToolResult, parse_int_list, progress

KINDS = ("reasoning", "code", "json", "tool")
PHASES = ("reasoning", "content", "tool_call")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=8, help="conversations per concurrency level (default 8)")
    p.add_argument("--concurrency", default="1,4", help="conversations in flight per level (default 1,4)")
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation (default 3)")
    p.add_argument("--source", choices=["builtin", "demo"], default="builtin",
                   help="builtin: templated tasks with history; demo: the demo model's corpus, "
                        "independent turns (default builtin)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per turn at most (default 512)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-think", action="store_true",
                   help='send chat_template_kwargs {"enable_thinking": false} (default: thinking on, nothing sent)')
    p.add_argument("--seed", type=int, default=0, help="varies the tasks and their order")


# ---- the workload ---------------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "run_python", "description": "Run a Python snippet in a sandbox and return its stdout.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                       "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web; returns titles and URLs.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]

_NAMES = ("Ada", "Bilal", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mateo", "Nia")
_CITIES = ("Lisbon", "Osaka", "Nairobi", "Quito", "Tallinn", "Hobart", "Fez", "Leipzig", "Cusco", "Da Nang")
_ITEMS = ("notebooks", "lamps", "kettles", "backpacks", "chairs", "headphones")
_FUNCS = ("top_k", "parse_pairs", "pascal_rows", "merge_ranges", "slugify", "chunked", "flatten", "run_length")
_TOPICS = ("sparse attention kernels", "LSM-tree compaction", "Raft leader election", "KV cache paging",
           "speculative decoding", "B-tree page splits", "CRDT text editing", "QUIC congestion control")


def _reasoning_task(r: random.Random) -> str:
    name, n = r.choice(_NAMES), r.randint(3, 12)
    price, disc, over = r.randint(7, 60), r.choice((5, 10, 15, 20)), r.randint(50, 200)
    a, b = r.randint(20, 60), r.randint(15, 50)
    both, group = r.randint(2, min(a, b) - 1), a + b + r.randint(5, 40)
    v1, v2, dist, hour = r.randint(60, 140), r.randint(60, 140), r.randint(150, 900), r.randint(6, 11)
    return r.choice((
        (f"{name} buys {n} {r.choice(_ITEMS)} at ${price} each. Orders over ${over} get {disc}% off, and "
         f"shipping is ${r.randint(4, 15)} unless the discounted total is above ${over * 2}. What does {name} pay?"),
        (f"In a group of {group} people, {a} speak French, {b} speak Spanish and {both} speak both. How many "
         f"speak neither, and what share of the group is that?"),
        (f"A train leaves {r.choice(_CITIES)} at {hour}:00 at {v1} km/h; another leaves a city {dist} km away at "
         f"{hour}:{r.choice(('15', '30', '45'))} at {v2} km/h towards it. At what time do they meet?"),
    )) + " Think it through step by step, then give the final answer."


def _code_task(r: random.Random) -> str:
    fn, k = r.choice(_FUNCS), r.randint(2, 9)
    return r.choice((
        (f"Write a Python function `{fn}(items, k={k})` that returns the k most common elements of a list, ties "
         f"broken by first appearance. Include type hints, a docstring and two doctests."),
        (f"Write a Python function `{fn}(text)` that parses lines of the form `key = value` into a dict, "
         f"skipping blank lines and lines starting with '#', and raising ValueError naming the line number "
         f"for any other line without '='."),
        (f"Write a Python function `{fn}(ranges)` that merges overlapping integer ranges given as (start, end) "
         f"tuples and returns them sorted; ranges closer than {k} apart merge too."),
        (f"Write a Python class `Cache{k}` implementing an LRU cache of capacity {k} with get(key) and "
         f"put(key, value), both O(1), without functools."),
    ))


def _json_task(r: random.Random) -> str:
    name, city, age = r.choice(_NAMES), r.choice(_CITIES), r.randint(19, 80)
    order, total, qty = r.randint(10000, 99999), r.randint(1000, 99999) / 100, r.randint(1, 9)
    skus = [f"{r.choice('ABCDEFGH')}{r.randint(100, 999)}" for _ in range(r.randint(3, 5))]
    lines = "; ".join(f"{s} x{r.randint(1, 12)} @ {r.randint(100, 9999) / 100}" for s in skus)
    return r.choice((
        (f'Extract the fields "name", "age", "city", "order_id" and "total" as a JSON object, nothing else: '
         f'"Hello, this is {name} ({age}) writing from {city}. Order #{order} for {qty} {r.choice(_ITEMS)} came to '
         f'${total} and arrived damaged."'),
        (f'Turn these order lines into a JSON array of objects with keys "sku", "qty" and "price" (numbers as '
         f'numbers), then add an object with the key "total": {lines}'),
    ))


def _tool_task(r: random.Random) -> str:
    a, b, m = r.randint(100, 999), r.randint(20, 99), r.randint(1000, 9999)
    return r.choice((
        f"Use the run_python tool to compute {a} ** {b} % {m}, then tell me the result.",
        (f"Search for recent work on {r.choice(_TOPICS)} with the search tool (at most {r.randint(3, 8)} results) "
         f"and summarise what you find."),
        f"Read src/{r.choice(_FUNCS)}.py with the read_file tool and tell me what its main function does.",
    ))


_TASKS = {"reasoning": _reasoning_task, "code": _code_task, "json": _json_task, "tool": _tool_task}
_CANNED = {
    "run_python": {"stdout": "4096\n", "exit_code": 0},
    "search": {"results": [{"title": "A survey", "url": "https://example.org/survey"},
                           {"title": "Benchmarks, revisited", "url": "https://example.org/bench"}]},
    "read_file": {"content": "def main(argv):\n    return sum(int(a) for a in argv)\n"},
}


@dataclass
class Task:
    """One turn: `messages` are what it adds (builtin: the user message; demo: the example's whole
    prompt), `tools` what the request offers."""

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool = True


@dataclass
class Conversation:
    """A conversation's turns and, where it carries history, the messages so far."""

    index: int
    tasks: list[Task]
    carry_history: bool = True
    history: list[dict[str, Any]] = field(default_factory=list)

    def request(self, t: int) -> list[dict[str, Any]]:
        """The messages turn t sends (for history: the history with turn t's messages added)."""
        if not self.carry_history:
            return [dict(m) for m in self.tasks[t].messages]
        self.history += self.tasks[t].messages
        return list(self.history)

    def record(self, t: int, s: StreamSample) -> None:
        """Fold turn t's answer into the history; a failed turn's messages are taken back out."""
        if not self.carry_history:
            return
        if not s.ok:
            del self.history[len(self.history) - len(self.tasks[t].messages):]
            return
        self.history += reply_messages(s, f"c{self.index}t{t}")


def reply_messages(s: StreamSample, id_prefix: str) -> list[dict[str, Any]]:
    """The assistant message of an answer (content and tool calls, not the reasoning) and one tool
    result per call; a call the server gave no id gets one, so that the result can name it."""
    msg: dict[str, Any] = {"role": "assistant", "content": s.text}
    calls = [{"id": c["id"] or f"call_{id_prefix}_{i}", "type": "function",
              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
             for i, c in enumerate(s.tool_calls)]
    if not calls:
        return [msg]
    msg["tool_calls"] = calls
    results = [{"role": "tool", "tool_call_id": c["id"],
                "content": json.dumps(_CANNED.get(c["function"]["name"], {"ok": True}))} for c in calls]
    return [msg] + results


def turn_kinds(r: random.Random, turns: int) -> list[str]:
    """A shuffled order of the four kinds, repeated: consecutive turns never have the same kind."""
    order = list(KINDS)
    r.shuffle(order)
    return [order[t % len(order)] for t in range(turns)]


def builtin_conversation(seed: int, level: int, index: int, turns: int) -> Conversation:
    r = random.Random(f"agentic:{seed}:{level}:{index}")
    system = {"role": "system", "content": f"You are a coding agent working in the {r.choice(_CITIES).lower()}-"
                                           f"{r.randrange(16**4):04x} repository. Call a tool when it helps."}
    tasks = [Task(k, [{"role": "user", "content": _TASKS[k](r)}], TOOLS) for k in turn_kinds(r, turns)]
    return Conversation(index, tasks, history=[system])


_DEMO_FAMILIES = {"reasoning": ("arithmetic", "sort", "count"), "code": ("python",), "json": ("json",), "tool": ("tool",)}


def demo_conversation(seed: int, level: int, index: int, turns: int) -> Conversation:
    from tandem.demo.corpus import EVAL_SEED, make_example

    r = random.Random(f"agentic-demo:{seed}:{level}:{index}")
    tasks = []
    for kind in turn_kinds(r, turns):
        ex = make_example(EVAL_SEED, r.randrange(10**9), family=r.choice(_DEMO_FAMILIES[kind]))
        tasks.append(Task(kind, ex.prompt_messages(), ex.tools, ex.enable_thinking))
    return Conversation(index, tasks, carry_history=False)


def build_conversations(source: str, seed: int, level: int, n: int, turns: int) -> list[Conversation]:
    """n conversations of a concurrency level (each level its own, so no level reuses another's prefixes)."""
    make = demo_conversation if source == "demo" else builtin_conversation
    return [make(seed, level, i, turns) for i in range(n)]


# ---- per-phase accounting -------------------------------------------------------------------------


def phase_seconds(s: StreamSample) -> dict[str, float]:
    """Seconds per phase: each chunk after the first adds the gap since the chunk before it to its
    phase, which sums each run of one phase from the chunk before it to its last chunk. The first
    chunk's phase is present even when it got no time."""
    t, ph = s.chunk_times, s.chunk_phases
    out = {ph[0]: 0.0} if ph else {}
    for i in range(1, len(t)):
        out[ph[i]] = out.get(ph[i], 0.0) + t[i] - t[i - 1]
    return out


def phase_texts(s: StreamSample) -> dict[str, str]:
    """The text of each phase the stream had (tool calls: name + arguments of each)."""
    calls = "".join(c["function"]["name"] + c["function"]["arguments"] for c in s.tool_calls)
    texts = {"reasoning": s.reasoning, "content": s.text, "tool_call": calls}
    return {p: x for p, x in texts.items() if x or p in s.chunk_phases}


def split_tokens(total: int, weights: dict[str, float]) -> dict[str, int]:
    """`total` shared out in proportion to `weights`, rounded so that the parts add up (largest
    remainders first); all of it to the first key when every weight is 0."""
    mass = sum(weights.values())
    if not mass:
        return {p: (total if i == 0 else 0) for i, p in enumerate(weights)}
    exact = {p: total * w / mass for p, w in weights.items()}
    out = {p: int(v) for p, v in exact.items()}
    for p in sorted(exact, key=lambda p: out[p] - exact[p])[: total - sum(out.values())]:
        out[p] += 1
    return out


async def phase_tokens(client: BenchClient, samples: list[StreamSample]) -> tuple[list[dict[str, int]], bool]:
    """Tokens per phase of each sample, and True when the server's /tokenize counted them. The
    request's usage count is what it generated, tags such as </think> included, so it is shared
    out over the phases in proportion to their /tokenize counts (without /tokenize: their
    characters); only a stream without usage takes the /tokenize counts as they are."""
    weights = []
    for s in samples:
        texts = phase_texts(s)
        counts = await asyncio.gather(*(client.count_tokens(x, special=False) for x in texts.values() if x))
        if any(n is None for n in counts):
            break
        it = iter(counts)
        weights.append({p: (next(it) if x else 0) for p, x in texts.items()})
    tokenized = len(weights) == len(samples)
    if not tokenized:
        weights = [{p: len(x) for p, x in phase_texts(s).items()} for s in samples]
    out = []
    for s, w in zip(samples, weights):
        exact = tokenized and s.completion_tokens is None
        out.append(dict(w) if exact else split_tokens(s.tokens, w))
    return out, tokenized


@dataclass
class PhaseTotal:
    tokens: int = 0
    decode_tokens: int = 0  # less each request's first token, which came with the prefill
    seconds: float = 0.0

    @property
    def tok_s(self) -> float | None:
        return self.decode_tokens / self.seconds if self.seconds > 0 else None


def tally(samples: list[StreamSample], tokens: list[dict[str, int]]) -> dict[str, PhaseTotal]:
    """Tokens and seconds per phase over successful samples, phases in PHASES order."""
    out = {p: PhaseTotal() for p in PHASES}
    for s, counts in zip(samples, tokens):
        secs = phase_seconds(s)
        first = s.chunk_phases[0] if s.chunk_phases else None
        for p in set(secs) | set(counts):
            n = counts.get(p, 0)
            total = out.setdefault(p, PhaseTotal())
            total.tokens += n
            total.decode_tokens += max(0, n - (p == first))
            total.seconds += secs.get(p, 0.0)
    return {p: t for p, t in out.items() if t.tokens or t.seconds}


# ---- running --------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What every request of the run shares; `tools_ok` goes False once the server turns tools down."""

    args: argparse.Namespace
    tools_ok: bool = True
    notes: list[str] = field(default_factory=list)


async def _turn(client: BenchClient, conv: Conversation, t: int, run: _Run) -> tuple[StreamSample, bool]:
    """Turn t of a conversation: its sample and whether tools were sent. An HTTP 400 to a request
    with tools is retried without; when that succeeds, no later request sends tools."""
    task = conv.tasks[t]
    messages = conv.request(t)
    extra: dict[str, Any] = {}
    if run.args.no_think or not task.enable_thinking:
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    with_tools = bool(task.tools) and run.tools_ok

    async def send(tools: bool) -> StreamSample:
        body = {**extra, **({"tools": task.tools, "tool_choice": "auto"} if tools else {})}
        return await client.stream(messages=messages, max_tokens=run.args.max_tokens,
                                   temperature=run.args.temperature, extra=body)

    s = await send(with_tools)
    if with_tools and s.status == 400:
        retry = await send(False)
        if retry.ok:  # the tools were what the server turned down (else keep the first failure)
            if run.tools_ok:
                run.tools_ok = False
                run.notes.append(f"the server turned down tools ({s.error}); the rest of the run sends none "
                                 f"(vLLM needs --enable-auto-tool-choice --tool-call-parser NAME)")
            s, with_tools = retry, False
    conv.record(t, s)
    return s, with_tools


async def _level(client: BenchClient, convs: list[Conversation], c: int, run: _Run, bar) -> list[dict[str, Any]]:
    """Every turn of `convs`, c conversations at a time (the next starts when one ends)."""
    pending = list(convs)
    done: list[dict[str, Any]] = []

    async def worker() -> None:
        while pending:
            conv = pending.pop(0)
            for t, task in enumerate(conv.tasks):
                s, tools = await _turn(client, conv, t, run)
                done.append({"conversation": conv.index, "turn": t, "kind": task.kind, "tools": tools, "sample": s})
                bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(c, len(convs)))))
    return sorted(done, key=lambda d: (d["conversation"], d["turn"]))


async def run(client: BenchClient, args: argparse.Namespace) -> ToolResult:
    headers = ["conc", "phase", "tokens", "seconds", "tok/s", "share", "TTFT p50 ms", "ok"]
    res = ToolResult("agentic", headers, [])
    levels = parse_int_list(args.concurrency)
    bar = progress(len(levels) * args.conversations * args.turns, "agentic", not args.quiet)
    state = _Run(args)
    summaries = [await _measure_level(client, c, state, bar, res) for c in levels]
    bar.close()
    tokenized = all(x.pop("tokenized") for x in summaries)
    res.headline = Headline("aggregate tok/s", [x["agg_tok_s"] for x in summaries if x["agg_tok_s"] is not None])
    res.summary = {"levels": summaries, "tokens_by": "tokenize" if tokenized else "estimate",
                   "lines": spec_lines([(f"conc {x['concurrency']}", x["spec"]) for x in summaries])}
    res.notes += state.notes + _notes(args, tokenized, res.samples)
    return res


async def _measure_level(client: BenchClient, c: int, state: _Run, bar, res: ToolResult) -> dict[str, Any]:
    """One concurrency level: its rows and samples go into `res`; returns its summary."""
    args = state.args
    convs = build_conversations(args.source, args.seed, c, args.conversations, args.turns)
    before = await client.spec_counters()
    t0 = time.perf_counter()
    turns = await _level(client, convs, c, state, bar)
    wall = time.perf_counter() - t0
    spec = acceptance(spec_delta(before, await client.spec_counters()))
    ok = [d["sample"] for d in turns if d["sample"].ok]
    tokens, tokenized = await phase_tokens(client, ok)  # after the clock stopped
    phases = tally(ok, tokens)
    res.total += len(turns)
    res.failed += len(turns) - len(ok)
    per_sample = iter(tokens)
    for d in turns:
        s = d.pop("sample")
        extra = {"phase_tokens": next(per_sample), "phase_seconds": phase_seconds(s)} if s.ok else {}
        res.samples.append({"concurrency": c, **d, **s.to_dict(), **extra})
    agg = sum(s.tokens for s in ok) / wall if ok and wall > 0 else None
    res.rows += _rows(c, phases, ok, len(turns), wall, agg)
    return {"concurrency": c, "wall_s": wall, "agg_tok_s": agg, "requests": len(turns), "ok": len(ok),
            "ttft_p50_s": percentile([s.ttft for s in ok], 50), "spec": spec, "tokenized": tokenized,
            "phases": {p: {**vars(t), "tok_s": t.tok_s} for p, t in phases.items()}}


def _rows(c: int, phases: dict[str, PhaseTotal], ok: list[StreamSample], n: int, wall: float,
          agg: float | None) -> list[list[Any]]:
    if not ok:
        return [[c, "all", "-", "-", "-", "-", "-", f"0/{n}"]]
    total = sum(t.tokens for t in phases.values())
    rows: list[list[Any]] = [[c, p, t.tokens, t.seconds, t.tok_s, pct(t.tokens / total if total else None), "-", "-"]
                             for p, t in phases.items()]
    ttft = ms(percentile([s.ttft for s in ok], 50))
    return rows + [[c, "all", sum(s.tokens for s in ok), wall, agg, "-", ttft, f"{len(ok)}/{n}"]]


def _notes(args: argparse.Namespace, tokenized: bool, samples: list[dict[str, Any]]) -> list[str]:
    weights = ("their /tokenize counts (tool calls: name + arguments)" if tokenized
               else "their characters (the server has no /tokenize)")
    notes = ["phase tok/s: a phase's tokens over its time, summed over requests; each request's first chunk (TTFT) "
             "and its token are left out. The all row: usage tokens over the level's wall time",
             f"phase tokens: each request's usage tokens shared out over its phases in proportion to {weights}"]
    if args.source == "demo":
        notes.append("--source demo: every turn is an independent request (a demo corpus prompt); no history is carried")
    offered = [s for s in samples if s["tools"] and s["ok"]]
    if offered and not any(s["tool_calls"] for s in offered):
        notes.append(f"none of the {len(offered)} requests that offered tools called one")
    return notes
