"""Tokenizer files and incremental detokenization."""

from pathlib import Path

import pytest

from tandem.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from tiny_models import ASSETS, TOKENIZER_JSON


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    (d / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "chat_template": "{{ messages }}"}')
    (d / "generation_config.json").write_text('{"eos_token_id": [2040], "temperature": 0.6, "top_k": 20}')
    return Tokenizer.from_dir(d)


def test_reads_eos_template_and_defaults(tok):
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids and 2040 in tok.eos_token_ids
    assert tok.chat_template == "{{ messages }}"
    assert tok.generation_defaults == {"temperature": 0.6, "top_k": 20}


def test_missing_or_broken_tokenizer_names_the_file(tmp_path: Path):
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot be read"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_detokenizer_matches_full_decode(tok):
    text = "Héllo wörld — 数字 123 ✓ done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # partial characters are held, never emitted


def test_incomplete_character_is_flushed_at_the_end(tok):
    ids = tok.encode("ok 𝔘𝔫𝔦")  # rare 4-byte characters: several byte-level tokens each
    # Drop the last byte-level token(s) so the text ends inside a multi-byte character.
    cut = next(n for n in range(len(ids) - 1, 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    held = "".join(detok.push([i]) for i in ids[:cut])
    assert not held.endswith("\ufffd")
    assert held + detok.push([], final=True) == tok.decode(ids[:cut])


def test_assets_exist():
    assert (ASSETS / "builtin_chat_template.jinja").is_file()


def test_bad_sampling_default_names_the_file_and_key(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0}')
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(info.value).startswith(f'{tmp_path / "generation_config.json"}: "top_p" 0 is refused: top_p must be')
