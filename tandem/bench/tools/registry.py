"""Tool name -> module."""

from __future__ import annotations

from types import ModuleType

from tandem.bench.tools import agentic, bracket_run, conc, ctx, decode, ngram_ceiling, pptg, quality, streamgap

TOOLS: dict[str, ModuleType] = {
    "decode": decode,
    "ctx": ctx,
    "conc": conc,
    "quality": quality,
    "pp-tg": pptg,
    "streamgap": streamgap,
    "ngram-ceiling": ngram_ceiling,
    "agentic": agentic,
    "bracket": bracket_run,
}

HELP = {
    "decode": "long generations: tok/s, TTFT, ITL, draft acceptance per run",
    "ctx": "TTFT and decode speed at several context lengths",
    "conc": "concurrency sweep: aggregate and per-request tok/s, TTFT",
    "quality": "needle retrieval at several lengths and depths (pass count)",
    "pp-tg": "llama-bench-style pp/tg table",
    "streamgap": "inter-token gaps of a stream while a large prefill arrives",
    "ngram-ceiling": "offline n-gram (prompt lookup) drafting ceiling for K=1..8",
    "agentic": "phase-alternating agentic mix: reasoning, code / JSON / tool calls over several turns; tok/s per phase",
    "bracket": "base -> candidate -> base with a ledger and a verdict",
}
