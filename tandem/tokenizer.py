"""Tokenizer files of an HF-format directory: tokenizer.json (fast tokenizer), tokenizer_config.json
(chat template, special tokens) and generation_config.json (eos ids, default sampling)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer


class TokenizerError(ValueError):
    pass


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class Tokenizer:
    model_dir: Path
    fast: FastTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: missing (Tandem needs a fast tokenizer.json)")
        try:
            fast = FastTokenizer.from_file(str(tok_path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise TokenizerError(f"{tok_path}: cannot be read ({e})") from e
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        eos_ids: set[int] = set()
        gen_eos = gen.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos_ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos_ids.update(int(i) for i in gen_eos)
        if eos is not None and fast.token_to_id(eos) is not None:
            eos_ids.add(fast.token_to_id(eos))
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gen}
        if not gen.get("do_sample", True) and "temperature" not in defaults:
            defaults["temperature"] = 0.0
        return cls(model_dir, fast, template, bos, eos, frozenset(eos_ids), defaults)

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Chat templates already write bos/special tokens, so raw encoding adds none by default.
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.fast.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.fast.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A token may end in the middle of a UTF-8 character (byte-level BPE); text is emitted only once
    it decodes without a replacement character, and only the last few tokens are re-decoded.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] were decoded already (context)
        self.read_offset = 0
        self.text = ""

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; returns the new text. Text ending in an incomplete UTF-8 character is held
        back until more tokens complete it, or until `final` (the sequence ended) flushes it."""
        self.ids.extend(new_ids)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = dec(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            # The last decoded chunk stays as left context: some decoders (SentencePiece-style
            # metaspace) decide a token's leading space from its neighbour.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
