"""How far a drafter's own confidence per token (DSpark's confidence head) can be trusted:
`AutoK.refine` cuts drafts on it, calibrated against what verifies accepted."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.spec.goodput import PHASE_DECAY

CONFIDENCE_BINS = 10
CONFIDENCE_WEIGHT = 8.0  # pseudo-observations of the raw confidence in each bin's calibration


class ConfidenceCalibration:
    """P(accepted | the drafter's confidence c), per phase: decayed accept / try counts in
    `CONFIDENCE_BINS` bins of c, shrunk towards c itself (an uncalibrated head is taken at its
    word until verifies say otherwise)."""

    def __init__(self, decay: float = PHASE_DECAY, weight: float = CONFIDENCE_WEIGHT) -> None:
        self.decay = decay
        self.weight = weight
        self._counts: dict[str, list[list[float]]] = {}  # phase -> [bin] -> [accepted, tried]

    @staticmethod
    def _bin(c: float) -> int:
        return min(max(int(c * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)

    def rate(self, phase: str, c: float) -> float:
        counts = self._counts.get(phase)
        if counts is None:
            return c
        accepted, tried = counts[self._bin(c)]
        return (accepted + self.weight * c) / (tried + self.weight)

    def observe(self, phase: str, confidence: Sequence[float], num_accepted: int) -> None:
        """A verify of len(confidence) drafts accepted the first num_accepted: positions up to the
        first rejection were tried."""
        counts = self._counts.setdefault(phase, [[0.0, 0.0] for _ in range(CONFIDENCE_BINS)])
        for cell in counts:
            cell[0] *= self.decay
            cell[1] *= self.decay
        for i, c in enumerate(confidence[: num_accepted + 1]):
            cell = counts[self._bin(c)]
            cell[1] += 1.0
            if i < num_accepted:
                cell[0] += 1.0
