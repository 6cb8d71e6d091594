"""Percentiles and summaries of samples (pure functions, no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50.0)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def stdev(values: Sequence[float]) -> float | None:
    """Sample standard deviation; 0.0 for one value, None for none."""
    if not values:
        return None
    if len(values) == 1:
        return 0.0
    m = sum(values) / len(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, median, min, max, mean, std, p50, p99 of a list of numbers."""
    vals = [float(v) for v in values if v is not None]
    return {
        "n": len(vals),
        "median": median(vals),
        "min": min(vals) if vals else None,
        "max": max(vals) if vals else None,
        "mean": mean(vals),
        "std": stdev(vals),
        "p50": percentile(vals, 50.0),
        "p99": percentile(vals, 99.0),
    }
