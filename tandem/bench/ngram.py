"""Prompt-lookup (n-gram) drafting simulated offline, with greedy verification.

The model's real output is known (the completion), so a draft's fate is known too: the target,
decoding greedily, accepts the longest prefix of the draft that equals the next completion tokens,
then emits one token of its own. The simulation therefore gives the *ceiling* of n-gram drafting
for this traffic: what a lossless prompt-lookup proposer could gain if it cost nothing.

The proposer is the serving one, `tandem.spec.ngram` (its docstring states the rule): at each step
it proposes up to K tokens that followed the most recent earlier occurrence of the context's last
n-gram (prompt + completion so far, longest n first). No draft -> the step decodes one token as
usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.spec.ngram import NgramIndex


@dataclass
class NgramStats:
    k: int
    steps: int = 0  # target forward passes (verify steps and plain steps)
    drafts: int = 0  # steps that had a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step where a draft was made: 1 + accepted per draft (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def tokens_per_step(self) -> float | None:
        """Generated tokens per target forward pass over all steps: the speed-up ceiling."""
        return self.generated_tokens / self.steps if self.steps else None

    @property
    def draft_coverage(self) -> float | None:
        return self.drafts / self.steps if self.steps else None

    def add(self, other: "NgramStats") -> None:
        self.steps += other.steps
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.generated_tokens += other.generated_tokens

    def to_dict(self) -> dict:
        return {
            "k": self.k, "steps": self.steps, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens, "generated_tokens": self.generated_tokens,
            "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_step": self.tokens_per_step, "draft_coverage": self.draft_coverage,
        }


def simulate(prompt: Sequence[int], completion: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> NgramStats:
    """Replay one completion with drafts of at most k tokens; see the module docstring."""
    stats = NgramStats(k=k)
    context = NgramIndex(min_n, max_n, prompt)
    i = 0
    while i < len(completion):
        draft = context.propose(k)
        accepted = 0
        for tok in draft:
            if i + accepted < len(completion) and completion[i + accepted] == tok:
                accepted += 1
            else:
                break
        # the target emits its own token after the accepted ones (unless the completion ended)
        emitted = min(accepted + 1, len(completion) - i)
        stats.steps += 1
        if draft:
            stats.drafts += 1
            stats.draft_tokens += len(draft)
            stats.accepted_tokens += accepted
        stats.generated_tokens += emitted
        context.extend(completion[i:i + emitted])
        i += emitted
    return stats


def simulate_many(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], ks: Sequence[int] = tuple(range(1, 9)),
                  min_n: int = 1, max_n: int = 3) -> list[NgramStats]:
    out = []
    for k in ks:
        total = NgramStats(k=k)
        for prompt, completion in pairs:
            total.add(simulate(prompt, completion, k, min_n, max_n))
        out.append(total)
    return out
