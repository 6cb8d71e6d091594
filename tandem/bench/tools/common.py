"""What every tool returns, and helpers shared by the tools."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tqdm import tqdm

from tandem.bench.client import BenchClient
from tandem.bench.filler import filler_prompt, fit_to_length
from tandem.bench.report import fmt, table

T = TypeVar("T")


@dataclass
class Headline:
    """The one number per sample that `bracket` compares."""

    name: str
    values: list[float]
    higher_is_better: bool = True


@dataclass
class ToolResult:
    tool: str
    headers: list[str]
    rows: list[list[Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0
    total: int = 0
    notes: list[str] = field(default_factory=list)
    headline: Headline | None = None

    def render(self) -> str:
        out = [table(self.headers, self.rows)]
        if self.summary.get("lines"):
            out += [""] + list(self.summary["lines"])
        out += [f"failed requests: {self.failed}/{self.total}"] if self.failed else []
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "table": {"headers": self.headers, "rows": [[fmt(c) if isinstance(c, float) else c for c in r] for r in self.rows]},
            "summary": {k: v for k, v in self.summary.items() if k != "lines"},
            "failed": self.failed,
            "total": self.total,
            "notes": self.notes,
            "headline": None if self.headline is None else vars(self.headline),
            "samples": self.samples,
        }


def progress(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A progress bar on stderr (hidden when stderr is not a terminal unless forced)."""
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=False, dynamic_ncols=True)


async def gather_with_progress(jobs: Iterable[Awaitable[T]], bar: tqdm) -> list[T]:
    async def one(job: Awaitable[T]) -> T:
        result = await job
        bar.update(1)
        return result

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def parse_int_list(text: str) -> list[int]:
    """'2K,8K,32768' -> [2048, 8192, 32768] (K = 1024, M = 1024*1024)."""
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        if not p:
            continue
        mult = 1
        if p.endswith("K"):
            mult, p = 1024, p[:-1]
        elif p.endswith("M"):
            mult, p = 1024 * 1024, p[:-1]
        out.append(int(float(p) * mult))
    if not out:
        raise ValueError(f"expected a comma-separated list of numbers, got {text!r}")
    return out


def cap_lengths(client: BenchClient, lengths: Sequence[int], reserve: int, notes: list[str]) -> list[int]:
    """Lengths capped at the server's max_model_len (minus `reserve`), duplicates dropped."""
    out: list[int] = []
    for n in lengths:
        capped = client.cap_length(n, reserve)
        if capped != n:
            notes.append(f"length {n} capped to {capped} (server max_model_len {client.max_model_len}, {reserve} reserved)")
        if capped not in out:
            out.append(capped)
    return out


_CALIBRATION_WORDS = 400


async def unique_prompt(client: BenchClient, target_tokens: int, seed: int) -> tuple[str, int | None]:
    """A prompt of about `target_tokens` tokens that shares no prefix with any other seed's. Sized
    with the server's /tokenize; without it, from tokens per word measured once by usage counts."""
    per_word = None
    if client.has_tokenize is False:
        if client.tokens_per_word is None:
            n = await client.prompt_tokens_by_usage(filler_prompt(_CALIBRATION_WORDS, -1))
            client.tokens_per_word = (n / _CALIBRATION_WORDS) if n else 1.5
        per_word = client.tokens_per_word
    return await fit_to_length(lambda n: filler_prompt(n, seed), target_tokens, client.count_tokens, tokens_per_unit=per_word)
