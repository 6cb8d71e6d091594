"""Plain-text and markdown tables, number formatting, JSON output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt(value: Any, digits: int = 1) -> str:
    """Numbers with fixed decimals, None as '-', everything else as str."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000.0 * seconds:.1f}"


def pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100.0 * fraction:.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table: text columns left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_looks_numeric(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    t = text.rstrip("%x").replace("/", "").replace("±", "").replace(" ", "")
    if t in ("", "-"):
        return True
    try:
        float(t)
        return True
    except ValueError:
        return False


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=_default) + "\n")


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")
