"""Chat rendering and the demo tokenizer.

Chats are rendered with the built-in chat template through the server's own `ChatTemplate`, so
training sees exactly what the server sends. The tokenizer is a byte-level BPE trained with
`tokenizers` on a sample of the corpus, with the same pre-tokenizer as the built-in model (digits
one by one) and Qwen3's special and added tokens.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tandem.builtin import _PRETOKENIZE_PATTERN, ADDED_TOKENS, CHAT_TEMPLATE_ASSET, SPECIAL_TOKENS, build_tokenizer_config
from tandem.demo.corpus import Example, make_corpus

VOCAB_SIZE = 6144  # BPE vocabulary plus the added tokens
MAX_POSITIONS = 16384
_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)


@lru_cache(maxsize=1)
def chat_template():
    from tandem.server.chat_template import ChatTemplate

    return ChatTemplate(CHAT_TEMPLATE_ASSET.read_text(encoding="utf-8"), eos_token="<|im_end|>")


def render(messages: list[dict[str, Any]], tools: list | None = None, add_generation_prompt: bool = False,
           enable_thinking: bool = True) -> str:
    return chat_template().render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  kwargs={"enable_thinking": enable_thinking})


def render_example(ex: Example) -> str:
    """The whole chat as training text."""
    return render(ex.messages, ex.tools, enable_thinking=ex.enable_thinking)


def render_prompt(ex: Example, upto: int | None = None) -> str:
    """The prompt for the assistant turn at message index `upto` (default: the first one)."""
    if upto is None:
        upto = next(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
    return render(ex.messages[:upto], ex.tools, add_generation_prompt=True, enable_thinking=ex.enable_thinking)


def assistant_char_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of assistant turns (after `<|im_start|>assistant\\n`, up to and including
    `<|im_end|>`): the tokens the loss is taken on."""
    return [m.span(1) for m in _ASSISTANT.finditer(text)]


# ---- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(n_examples: int = 20000, seed: int = 1) -> str:
    """Train the demo BPE on `n_examples` corpus chats plus the built-in prose corpus (which gives
    the merges the narrow task corpus cannot); returns tokenizer.json text."""
    from tandem.builtin import CORPUS_ASSET

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(ADDED_TOKENS), min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=[],
    )
    texts = [CORPUS_ASSET.read_text(encoding="utf-8")] * 4
    for ex in make_corpus(seed, n_examples):
        text = render_example(ex)
        for t in SPECIAL_TOKENS + ADDED_TOKENS:  # markers are added tokens, not BPE material
            text = text.replace(t, "\n")
        texts.append(text)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok.to_str(pretty=False) + "\n"


def tokenizer_config(tokenizer_json: str) -> dict[str, Any]:
    return build_tokenizer_config(tokenizer_json, MAX_POSITIONS)


def special_ids(tokenizer_json: str) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode_example(tok, ex: Example) -> tuple[list[int], list[int]]:
    """(token ids, loss mask 0/1) of one rendered chat; the mask covers assistant turns."""
    text = render_example(ex)
    enc = tok.encode(text, add_special_tokens=False)
    spans = assistant_char_spans(text)
    mask, j = [], 0
    for start, end in enc.offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        mask.append(1 if j < len(spans) and spans[j][0] <= start < spans[j][1] else 0)
    return enc.ids, mask
