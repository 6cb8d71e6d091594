"""Needle retrieval: a fact planted at a given depth in filler, a question about it, and scoring
of the answer (pure logic)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tandem.bench.filler import sentences, unique_tag

_ADJECTIVES = ("amber", "violet", "copper", "silver", "crimson", "ivory", "olive", "scarlet", "cobalt", "jade")
_NOUNS = ("falcon", "lighthouse", "glacier", "violin", "tortoise", "comet", "canyon", "orchid", "anchor", "kettle")


@dataclass(frozen=True)
class Needle:
    subject: str  # e.g. "copper falcon"
    code: str  # six digits, the answer

    @property
    def fact(self) -> str:
        return f"The secret access code for the {self.subject} is {self.code}."

    @property
    def question(self) -> str:
        return (f"What is the secret access code for the {self.subject}, according to the text above? "
                "Reply with the number only.")


def make_needle(seed: int) -> Needle:
    rng = random.Random(seed * 104729 + 1)
    subject = f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    return Needle(subject=subject, code=str(rng.randrange(100000, 1000000)))


def plant(filler: list[str], fact: str, depth: float) -> list[str]:
    """Insert `fact` between sentences at fraction `depth` (0 = first, 1 = last) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    at = round(depth * len(filler))
    return filler[:at] + [fact] + filler[at:]


def haystack_prompt(num_sentences: int, needle: Needle, depth: float, seed: int) -> str:
    """Filler with the needle planted at `depth`, then the question."""
    body = " ".join(plant(sentences(num_sentences, seed), needle.fact, depth))
    return f"{unique_tag(seed)} Read the following text carefully.\n\n{body}\n\n{needle.question}"


_DIGIT_SEPARATORS = re.compile(r"(?<=\d)[,\s._'](?=\d)")


def score(answer: str | None, code: str) -> bool:
    """True when the answer contains the code as a whole number (digit-group separators such as
    `482,913` or `482 913` are allowed; `4829130` or `48291` are not the code)."""
    if not answer:
        return False
    joined = _DIGIT_SEPARATORS.sub("", answer)
    return re.search(rf"(?<!\d){re.escape(code)}(?!\d)", joined) is not None
