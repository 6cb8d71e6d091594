"""The length guard of the text workers: a text that no tokenization can fit into the model's
context is refused before it is tokenized (a 16 MB body then costs milliseconds, not seconds and
gigabytes). See `ContextGuard` for the bound and when a tokenizer has none.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from tokenizers import Tokenizer as FastTokenizer
from tokenizers.pre_tokenizers import ByteLevel

from tandem.tokenizer import Tokenizer

# A Unicode normalization form (NFC, NFD, NFKC, NFKD) shrinks a text's UTF-8 at most this many times:
# the Kelvin sign (3 bytes) becomes "K" under all four, MATHEMATICAL BOLD CAPITAL A (4 bytes) "A"
# under NFKC/NFKD. tests/test_text_workers.py derives the bound afresh from Python's Unicode tables.
MAX_SHRINK = 4
_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_GROWING_NORMALIZERS = frozenset({"Prepend", "ByteLevel"})  # and Replace by something no shorter
# Pre-tokenizers that only split text (or respell it no shorter: ByteLevel, Metaspace), never drop it.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"})


class _Unbounded(Exception):
    """Why this tokenizer's token count has no lower bound in the text's length."""


class ContextGuard:
    """Refuses, without tokenizing it, a text that no tokenization fits into `max_model_len` tokens.

    The bound: no token covers more than `token_bytes` bytes of the normalized text, so a text whose
    normalized UTF-8 has N bytes needs at least N / token_bytes tokens (add_special_tokens only adds
    some). `build` checks that each stage of the tokenizer keeps that true, else there is no guard:
    - normalizers only add text (Prepend, Replace by something no shorter, ByteLevel), or are a
      Unicode form: that shrinks a text at most MAX_SHRINK times, and not at all if it comes first and
      the text is in that form already (then so is every piece the tokenizer normalizes: substrings
      of a normalized text are normalized). Strip, Lowercase, BERT's and SentencePiece's delete or
      shrink text: no guard;
    - pre-tokenizers only split and respell (ByteLevel spells each byte as a character, Metaspace a
      space as "▁": a token's string covers at most as many bytes as it has characters or bytes);
      Whitespace-style ones drop spaces: no guard;
    - a model token covers the text its string spells (a subword prefix or suffix only adds), and
      every character has a token (the byte alphabet, byte fallback, or one unknown token per
      character), so nothing is dropped nor does a long run become one "<unk>"; a WordPiece or
      Unigram model, and BPE without such cover, have no guard;
    - an added token covers its content exactly: lstrip/rstrip would swallow any run of spaces
      beside it (no guard), and with truncation configured every text fits (none either).
    """

    def __init__(self, max_model_len: int, token_bytes: int, forms: tuple[str | None, ...]) -> None:
        self.max_model_len = max_model_len
        self.token_bytes = token_bytes
        self.forms = forms  # per normalizer step: its Unicode form, or None for one that only adds text

    @classmethod
    def build(cls, tokenizer: Tokenizer, max_model_len: int | None) -> tuple[ContextGuard | None, str]:
        """The guard, or None; and a line for the log that says which and why."""
        if max_model_len is None:
            return None, "no length guard (no max_model_len given)"
        fast = tokenizer.fast
        try:
            if fast.truncation is not None:
                raise _Unbounded("the tokenizer truncates, so every text fits")
            normalizers = _leaves(fast.normalizer, "normalizers")
            pre_tokenizers = _leaves(fast.pre_tokenizer, "pretokenizers")
            forms = tuple(_normalizer_form(spec) for spec in normalizers)
            for spec in pre_tokenizers:
                if spec["type"] not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
                    raise _Unbounded(f"its {spec['type']} pre-tokenizer can drop text")
            byte_level = any(spec["type"] == "ByteLevel" for spec in normalizers + pre_tokenizers)
            token_bytes = _max_token_bytes(fast, byte_level)
        except _Unbounded as e:
            return None, f"no length guard: {e}"
        guard = cls(max_model_len, token_bytes, forms)
        return guard, f"length guard: a token covers at most {token_bytes} bytes, max_model_len {max_model_len}"

    def refusal(self, text: str, what: str) -> str | None:
        """Why `text` (a string without lone surrogates) cannot fit, or None when it might."""
        fits = self.max_model_len * self.token_bytes  # bytes of normalized text that can fit
        if 4 * len(text) <= fits:  # at most 4 bytes a character: most texts cost no more than this
            return None
        size = len(text.encode("utf-8"))
        per_token = self.token_bytes * self._shrink(text)
        if size <= self.max_model_len * per_token:
            return None
        return (f"{what} is {size:,} bytes of UTF-8; no tokenization of it fits this model's maximum "
                f"context length of {self.max_model_len} tokens (a token covers at most {per_token} bytes); "
                "shorten it")  # fmt: skip

    def _shrink(self, text: str) -> int:
        """How many times over normalization may shrink this text."""
        factor = 1
        for i, form in enumerate(self.forms):
            # (Python's Unicode tables may be older than the tokenizer's: text normalized under
            # them stays normalized under later ones, by Unicode's stability policy.)
            if form is not None and not (i == 0 and unicodedata.is_normalized(form, text)):
                factor *= MAX_SHRINK
        return factor


def _leaves(component: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps as their tokenizer.json objects, Sequences flattened."""
    if component is None:
        return []
    return _flatten(json.loads(component.__getstate__()), key)  # __getstate__: its JSON, as pickle has it


def _flatten(spec: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return [leaf for step in spec[key] for leaf in _flatten(step, key)] if spec["type"] == "Sequence" else [spec]


def _normalizer_form(spec: dict[str, Any]) -> str | None:
    """A normalizer step's Unicode form, or None if it only adds text; _Unbounded if it may shrink it."""
    kind = spec["type"]
    if kind in _UNICODE_FORMS:
        return kind
    if kind in _GROWING_NORMALIZERS:
        return None
    pattern = spec.get("pattern", {}).get("String") if kind == "Replace" else None
    if pattern and len(spec["content"].encode("utf-8")) >= len(pattern.encode("utf-8")):
        return None
    raise _Unbounded(f"its {kind} normalizer can shrink text any number of times")


def _max_token_bytes(fast: FastTokenizer, byte_level: bool) -> int:
    """The most bytes of normalized text one token covers (see ContextGuard); _Unbounded if any."""
    model = fast.model
    if type(model).__name__ != "BPE":
        raise _Unbounded(f"its {type(model).__name__} model can turn a long run of text into one token")
    vocab = fast.get_vocab(with_added_tokens=False)
    if byte_level:  # each character of a token's string stands for one byte
        covered = set(ByteLevel.alphabet()) <= vocab.keys()
        longest = max(map(len, vocab), default=0)
    else:
        covered = model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256))
        longest = max((len(token.encode("utf-8")) for token in vocab), default=0)
    if not covered and (model.unk_token is None or model.fuse_unk):
        raise _Unbounded("its BPE model drops, or fuses into one unknown token, characters it has no token for")
    if not covered:
        longest = max(longest, 4)  # one unknown token per character
    for added in fast.get_added_tokens_decoder().values():
        if added.lstrip or added.rstrip:
            raise _Unbounded(f"its added token {added.content!r} swallows the whitespace beside it")
        longest = max(longest, len(added.content.encode("utf-8")))
    return longest
