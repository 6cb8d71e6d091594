"""Generated filler text and prompts of a target token length.

Filler is plain English-looking sentences drawn from a fixed word list with a seeded RNG, so runs
are reproducible and every prompt can be made unique (no prefix cache can help) by seeding it
differently and starting it with a unique tag."""

from __future__ import annotations

import random
import secrets
from collections.abc import Awaitable, Callable

WORDS = (
    "the a river stone quiet morning garden window market winter summer letter village engine "
    "bridge harbor lantern orchard meadow signal paper candle forest valley station ladder mirror "
    "kitchen pocket shadow thunder island compass feather pillow basket harvest painter teacher "
    "sailor farmer doctor baker walks carries finds builds opens remembers watches follows keeps "
    "paints gathers counts measures answers listens returns leaves brings slowly gently often "
    "never always nearly almost quickly carefully again later early outside inside across behind "
    "beneath beyond through under over near with without before after while because although "
    "green golden narrow ancient bright heavy silent distant warm cold gentle crowded empty small "
    "large patient curious careful tired happy old new long short round steady clever humble "
    "their every each some many few several other another whole half second third last first "
    "road hill cloud rain wind light sound voice story song table chair door wall roof floor "
    "field yard shore tower cart wheel rope bell clock book map key coin thread needle cup bowl"
).split()


def sentence(rng: random.Random) -> str:
    n = rng.randint(8, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(count)]


_RUN_NONCE = secrets.randbelow(16**6)  # differs per process, so reruns miss the server's prefix cache too


def unique_tag(seed: int) -> str:
    """A short opening unique to this seed and this process, so no two prompts share a prefix
    beyond a token or two (prefix caches hash from the start of the prompt)."""
    rng = random.Random(seed * 7919 + 13)
    return f"Record {_RUN_NONCE:06x}{rng.randrange(16**6):06x}-{seed}:"


def filler_words(num_words: int, seed: int) -> str:
    """Exactly `num_words` words of filler sentences (the last one cut short)."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < num_words:
        words += sentence(rng).split()
    return " ".join(words[:num_words])


def filler_prompt(num_words: int, seed: int) -> str:
    """A unique tag and `num_words` words of filler: about 1.2-1.5 tokens per word."""
    return unique_tag(seed) + " " + filler_words(num_words, seed)


Counter = Callable[[str], Awaitable[int | None]]


async def fit_to_length(make: Callable[[int], str], target: int, count: Counter, *,
                        tokens_per_unit: float | None = None, tries: int = 4) -> tuple[str, int | None]:
    """Find n so that `make(n)` has about `target` tokens (never more when the counter works).

    `make(n)` builds a text from n units (words or sentences); `count(text)` returns its token count or None
    when the server cannot tokenize (then the estimate from `tokens_per_unit` is used as is).
    Returns (text, token count or None)."""
    per_unit = tokens_per_unit or 1.5
    n = max(1, int(target / per_unit))
    best: tuple[str, int] | None = None
    for _ in range(tries):
        text = make(n)
        got = await count(text)
        if got is None:
            return text, None
        if got <= target and (best is None or got > best[1]):
            best = (text, got)
        if abs(got - target) <= max(2, target // 100) and got <= target:
            break
        per_unit = max(got, 1) / n
        n_next = max(1, int(target / per_unit))
        if n_next == n:
            n_next = n - 1 if got > target else n + 1
        if n_next < 1:
            break
        n = n_next
    if best is None:  # every try was too long: take the shortest possible
        text = make(1)
        return text, await count(text)
    return best
