"""The bracket rule: base -> candidate -> base, and a verdict only when the candidate beats both
base runs by more than the base runs differ from each other (pure logic)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bench.stats import median


@dataclass(frozen=True)
class Verdict:
    decision: str  # "candidate wins", "candidate loses" or "no decision"
    base1: float
    candidate: float
    base2: float
    spread: float  # |base1 - base2|: the drift of the same configuration across the bracket
    margin: float  # how far the candidate is past the nearer base run (signed, in the good direction)

    @property
    def change(self) -> float:
        """Candidate relative to the mean of the base runs (signed fraction)."""
        base = (self.base1 + self.base2) / 2
        return (self.candidate - base) / base if base else 0.0


def verdict(base1: Sequence[float], candidate: Sequence[float], base2: Sequence[float],
            higher_is_better: bool = True) -> Verdict:
    """Compare run medians. The candidate wins when it is better than *both* base runs by more than
    their spread, loses when it is worse than both by more than the spread; anything else is
    "no decision" (the bracket cannot tell the change from drift)."""
    if not base1 or not candidate or not base2:
        raise ValueError("every run of the bracket needs at least one sample")
    b1, c, b2 = median(base1), median(candidate), median(base2)
    assert b1 is not None and c is not None and b2 is not None
    spread = abs(b1 - b2)
    sign = 1.0 if higher_is_better else -1.0
    best_base = max(sign * b1, sign * b2)
    worst_base = min(sign * b1, sign * b2)
    if sign * c - best_base > spread:
        decision, margin = "candidate wins", sign * c - best_base
    elif worst_base - sign * c > spread:
        decision, margin = "candidate loses", sign * c - worst_base
    else:
        decision, margin = "no decision", sign * c - best_base
    return Verdict(decision, b1, c, b2, spread, margin)
