"""Tokenizer files of an HF-format directory: tokenizer.json (fast tokenizer), tokenizer_config.json
(chat template, special tokens) and generation_config.json (eos ids, default sampling)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from tandem.core import ParamError, SamplingParams


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message is one line naming the file (and key)."""


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:36] + "..."


def describe_json(value: Any) -> str:
    """A JSON value as an error message names it (short, one line): 'the string "0.7"', 'a list', 'NaN'."""
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, str):
        return f"the string {_short(json.dumps(value))}"  # quoted and escaped: the message stays one line
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("nan", "NaN").replace("inf", "Infinity")
    if isinstance(value, (int, float)):
        return f"the number {_short(str(value))}"
    return {list: "a list", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read ({e})") from None
    except ValueError as e:  # JSONDecodeError, or a number of more than 4300 digits
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: must be a JSON object, got {describe_json(value)}")
    return value


def _token_text(cfg: dict[str, Any], key: str, path: Path) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    value = cfg.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        got = f'an object whose "content" is {describe_json(text)}' if isinstance(value, dict) else describe_json(value)
        raise TokenizerError(f'{path}: "{key}" must be a string, null or an object with a string "content", '
                             f"got {got}")  # fmt: skip
    return text


def _chat_template(cfg: dict[str, Any], path: Path) -> str | None:
    """A string, or named templates [{"name", "template"}] of which "default" (else the first) is used."""
    template = cfg.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if not isinstance(template, list):
        raise TokenizerError(f'{path}: "chat_template" must be a string or a list of '
                             f'{{"name", "template"}} objects, got {describe_json(template)}')  # fmt: skip
    named: dict[str, str] = {}
    for i, entry in enumerate(template):
        ok = isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("name", "template"))
        if not ok:
            keys = json.dumps(sorted(entry)) if isinstance(entry, dict) else None
            got = f"an object with keys {keys}" if keys else describe_json(entry)
            raise TokenizerError(f'{path}: "chat_template"[{i}] must be an object with a string "name" and '
                                 f'a string "template", got {got}')  # fmt: skip
        named[entry["name"]] = entry["template"]
    return named.get("default") or next(iter(named.values()), None)


def _eos_token_ids(gen: dict[str, Any], path: Path, fast: FastTokenizer) -> set[int]:
    value = gen.get("eos_token_id")
    if value is None:
        return set()
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            got = f"{describe_json(i)} in the list" if isinstance(value, list) else describe_json(value)
            raise TokenizerError(f'{path}: "eos_token_id" must be a token id or a list of token ids, got {got}')
        if not 0 <= i < 2**32 or fast.id_to_token(i) is None:  # (the bound keeps the id a u32)
            raise TokenizerError(f'{path}: "eos_token_id" {i} is not a token of tokenizer.json (its ids run '
                                 f"0..{fast.get_vocab_size(with_added_tokens=True) - 1})")  # fmt: skip
    return set(ids)


def _sampling_defaults(gen: dict[str, Any], path: Path) -> dict[str, Any]:
    """The sampling defaults of generation_config.json, checked as a request's fields would be, so a
    bad file fails at start-up instead of failing every request that leaves the field out."""
    defaults: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = gen.get(key)
        if value is None:  # null: not set
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TokenizerError(f'{path}: "{key}" must be a number, got {describe_json(value)}')
        if isinstance(value, float) and not math.isfinite(value):
            raise TokenizerError(f'{path}: "{key}" must be a finite number, got {describe_json(value)}')
        if key == "top_k":
            if isinstance(value, float) and not value.is_integer():
                raise TokenizerError(f'{path}: "top_k" must be an integer, got {describe_json(value)}')
            value = int(value)
        defaults[key] = value
    do_sample = gen.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TokenizerError(f'{path}: "do_sample" must be true or false, got {describe_json(do_sample)}')
    if do_sample is False and "temperature" not in defaults:
        defaults["temperature"] = 0.0
    try:
        SamplingParams(**defaults)
    except ParamError as e:
        key = e.param if e.param in defaults else None
        where = f'"{key}" {_short(str(defaults[key]))}' if key else f"the sampling defaults {_short(str(defaults))}"
        raise TokenizerError(f"{path}: {where} is refused: {e}") from None
    return defaults


def read_generation_defaults(directory: str | Path) -> dict[str, Any]:
    """The sampling defaults of `directory`/generation_config.json (`--generation-config DIR`),
    checked as `Tokenizer.from_dir` checks the model directory's; TokenizerError naming the path
    when the file is missing or bad."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: missing (--generation-config DIR reads the sampling defaults from "
                             "DIR/generation_config.json)")
    return _sampling_defaults(_read_json(path), path)


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
        """Read and check the tokenizer files; any problem raises TokenizerError naming the file
        and the key (generation_config.json's sampling defaults are validated like a request)."""
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: missing (Tandem needs a fast tokenizer.json)")
        try:
            fast = FastTokenizer.from_file(str(tok_path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise TokenizerError(f"{tok_path}: cannot be read ({e})") from e
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path)
        template = _chat_template(cfg, cfg_path)
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            try:
                template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_path}: cannot be read ({e})") from None
        bos, eos = _token_text(cfg, "bos_token", cfg_path), _token_text(cfg, "eos_token", cfg_path)
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path)
        eos_ids = _eos_token_ids(gen, gen_path, fast)
        if eos is not None and fast.token_to_id(eos) is not None:
            eos_ids.add(fast.token_to_id(eos))
        defaults = _sampling_defaults(gen, gen_path)
        return cls(model_dir, fast, template, bos, eos, frozenset(eos_ids), defaults)

    def with_generation_config(self, source: str) -> Tokenizer:
        """This tokenizer with the sampling defaults `--generation-config source` asks for: "auto"
        keeps the model directory's generation_config.json ones, "vllm" drops them (SamplingParams'
        own apply), a directory's generation_config.json replaces them. eos ids stay the model's."""
        if source == "auto":
            return self
        return replace(self, generation_defaults={} if source == "vllm" else read_generation_defaults(source))

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
