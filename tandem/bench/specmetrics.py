"""Speculative-decoding acceptance from a server's `/metrics` page (Prometheus text).

`parse_spec_metrics` reads the spec_decode counters of one scrape (Tandem's `tandem:` names, each
labelled `model_name` and `phase`, or vLLM's `vllm:` names, which have no phase); `spec_delta` takes
two scrapes' difference, the counts of one run; `acceptance` turns counts into the figures vLLM
logs (mean acceptance length, acceptance rate, per-position acceptance), for all phases together
and for each phase that drafted. A server without these counters (not Tandem or vLLM, or
speculation off) gives None all the way through, never an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tandem.bench.report import pct, table

# counter name after `tandem:`/`vllm:` and before `_total` -> its short name here
_COUNTERS = {
    "spec_decode_num_drafts": "drafts",
    "spec_decode_num_draft_tokens": "draft_tokens",
    "spec_decode_num_accepted_tokens": "accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",  # labelled position
    "spec_decode_k": "k",  # Tandem: request-steps by chosen draft depth, labelled k
}
_INDEX_LABEL = {"accepted_per_pos": "position", "k": "k"}

# (short name, phase or None where unlabelled, position or K or None) -> value, summed over other labels
SpecCounts = dict[tuple[str, str | None, int | None], float]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

NO_METRICS = ("no speculative decoding metrics (the server's /metrics has no spec_decode counters: "
              "not Tandem or vLLM, or speculation is off)")


def parse_spec_metrics(text: str) -> SpecCounts:
    """The spec_decode counters in a Prometheus text page, summed over every label except `phase`
    and `position`/`k` (so over model names and vLLM's `engine`). `_created` samples are skipped."""
    out: SpecCounts = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        prefix, _, rest = m.group(1).partition(":")
        if prefix not in ("tandem", "vllm"):
            continue
        short = _COUNTERS.get(rest.removesuffix("_total"))
        if short is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        index = labels.get(_INDEX_LABEL.get(short, ""))
        try:
            key = (short, labels.get("phase"), None if index is None else int(index))
            out[key] = out.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue  # a position or value that is not a number: not ours
    return out


def spec_delta(before: SpecCounts | None, after: SpecCounts | None) -> SpecCounts | None:
    """What happened between two scrapes; None when a scrape failed or the server has no counters.
    A counter missing before (not yet incremented: Tandem creates each labelled child on first
    use) counts as 0."""
    if before is None or not after:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def add_deltas(deltas: Iterable[SpecCounts | None]) -> SpecCounts | None:
    """The sum of several runs' deltas (None ones skipped); None when all are None."""
    out: SpecCounts | None = None
    for d in deltas:
        if d is None:
            continue
        out = out or {}
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def acceptance(delta: SpecCounts | None) -> dict[str, Any] | None:
    """{drafts, draft_tokens, accepted_tokens, acceptance_rate (accepted / drafted tokens),
    mean_acceptance_length (1 + accepted per draft), per_position ([i]: accepted at position i per
    draft), k (Tandem: {K: share of request-steps}), phases: {phase: the same without phases}} for
    all phases together and for each phase that drafted or counted K; rates are None where nothing
    was drafted. None when the server has no counters."""
    if delta is None:
        return None
    phases = sorted({p for _, p, _ in delta if p is not None})
    figures = {p: _figures(delta, {p}) for p in phases}
    return {**_figures(delta, None), "phases": {p: f for p, f in figures.items() if f["drafts"] or f["k"]}}


def _figures(delta: SpecCounts, phases: set[str] | None) -> dict[str, Any]:
    def total(short: str) -> float:
        return sum(v for (s, p, _), v in delta.items() if s == short and (phases is None or p in phases))

    def by_index(short: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for (s, p, i), v in delta.items():
            if s == short and i is not None and (phases is None or p in phases):
                out[i] = out.get(i, 0.0) + v
        return out

    drafts, drafted, accepted = total("drafts"), total("draft_tokens"), total("accepted_tokens")
    per_pos = by_index("accepted_per_pos")
    ks = {k: n for k, n in sorted(by_index("k").items()) if n}
    steps = sum(ks.values())
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        # positions never accepted have no sample (Tandem) yet are real positions: fill them with 0
        "per_position": [per_pos.get(i, 0.0) / drafts for i in range(max(per_pos) + 1)] if drafts and per_pos else [],
        "k": {k: n / steps for k, n in ks.items()},
    }


def spec_lines(runs: list[tuple[str, dict[str, Any] | None]]) -> list[str]:
    """A table of acceptance per (run, phase) with an `all` row for each run's phases together
    (the only row where the server has no phases), then each run's K distribution; NO_METRICS when
    no run had counters."""
    headers = ["run", "phase", "drafts", "drafted", "accepted", "accept", "accept len", "per-position"]
    rows: list[list[Any]] = []
    ks: list[str] = []
    for label, acc in runs:
        if acc is None:
            rows.append([label, "-", "-", "-", "-", "-", "-", "no metrics"])
            continue
        phases = acc["phases"]
        shown = [("all", acc)] if len(phases) != 1 or not acc["drafts"] else []
        for name, f in shown + [(p, f) for p, f in phases.items() if f["drafts"]]:
            rows.append([label, name, int(f["drafts"]), int(f["draft_tokens"]), int(f["accepted_tokens"]),
                         pct(f["acceptance_rate"]), _f2(f["mean_acceptance_length"]),
                         ", ".join(f"{r:.3f}" for r in f["per_position"]) or "-"])
        if any(f["k"] for f in phases.values()):
            ks.append(f"K, run {label}: " + ", ".join(f"{p} {format_k(f['k'])}" for p, f in phases.items() if f["k"]))
    if all(acc is None for _, acc in runs):
        return [f"speculative decoding: {NO_METRICS}"]
    return ["speculative decoding (server /metrics, difference over each run):", table(headers, rows)] + ks


def format_k(shares: dict[int, float]) -> str:
    """'{1: 80%, 0: 20%}', largest share first."""
    items = sorted(shares.items(), key=lambda kv: (-kv[1], kv[0]))
    return "{" + ", ".join(f"{k}: {100.0 * s:.0f}%" for k, s in items) + "}"


def _f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
