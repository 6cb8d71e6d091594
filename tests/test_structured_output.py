"""Structured output in the engine: grammar masks on the demo model (fp32, CPU), also under
speculative decoding, and the bitmask kernel against a reference."""

from __future__ import annotations

import json

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.builtin import demo_model_dir
from tandem.core import ParamError
from tandem.engine.structured import MaskCache, apply_token_bitmask, json_schema_grammar
from tandem.server.chat_template import ChatTemplate

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    # Bounded, as a schema for a small model should be: an unbounded integer lets it write digits
    # until max_tokens.
    "properties": {"answer": {"type": "integer", "minimum": -10**9, "maximum": 10**9},
                   "steps": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}},
    "required": ["answer", "steps"],
    "additionalProperties": False,
}
# The demo's reasoning stays free; what follows </think> must be the schema's JSON.
GRAMMAR = json_schema_grammar(SCHEMA, ("<think>", "</think>"))
QUESTIONS = ["What is 48213 + 37795?", "Sort these numbers: 5, 3, 9, 1.", "What is 812 * 7?"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_model_dir()), dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=2048)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    return [tok.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS]


def _answer(text: str) -> str:
    assert "</think>" in text, text
    return text.split("</think>", 1)[1].strip()


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(_answer(text)), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_apply_token_bitmask_matches_a_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 70, [0, 2, 3]  # not a multiple of 32: the last word's high bits are padding
    logits = torch.randn(4, vocab, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    for n, r in enumerate(rows):
        for t in range(vocab):
            if not (int(bits[n, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    original = logits.clone()
    apply_token_bitmask(logits, rows, bits)
    assert torch.equal(logits, want)
    # Through the cache: the same result, and a mask seen before is a hit.
    cache = MaskCache(size=3)
    for expect_hits in (0, 3):
        again = original.clone()
        apply_token_bitmask(again, rows, bits, cache)
        assert torch.equal(again, want) and (cache.hits, cache.misses) == (expect_hits, 3)
    small = MaskCache(size=2)
    apply_token_bitmask(original.clone(), rows, bits, small)
    assert len(small._masks) == 2 and bits[0].numpy().tobytes() not in small._masks  # the oldest dropped


def test_json_schema_is_followed_where_the_free_model_answers_in_prose(llm) -> None:
    prompts = _prompts(llm)
    free = llm.generate(prompts, SamplingParams(max_tokens=400, temperature=0))
    assert not any(_valid(c.text) for c in free), [c.text[-80:] for c in free]
    constrained = llm.generate(prompts, SamplingParams(max_tokens=400, temperature=0, grammar=GRAMMAR))
    for c in constrained:
        assert c.finish_reason == "stop" and _valid(c.text), c.text[-200:]
        # The reasoning is the free model's: the grammar leaves it alone.
    for f, c in zip(free, constrained):
        assert c.text.split("</think>")[0] == f.text.split("</think>")[0]
    # Sampled, seeded: every draw follows the schema.
    sampled = llm.generate(prompts, [SamplingParams(max_tokens=400, temperature=1.0, seed=s, grammar=GRAMMAR)
                                     for s in range(len(prompts))])
    assert all(c.finish_reason == "stop" and _valid(c.text) for c in sampled), [c.text[-120:] for c in sampled]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3}, {"method": "dspark"}])
def test_grammar_under_speculative_decoding_is_token_identical(llm, spec) -> None:
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=400, temperature=0, grammar=GRAMMAR)
    plain = llm.generate(prompts, params)
    spec_llm = LLM(str(demo_model_dir()), dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=2048,
                   speculative_config=spec)
    drafted = spec_llm.generate(prompts, params)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]
    assert all(_valid(c.text) for c in drafted)
    sampled = spec_llm.generate(prompts, [SamplingParams(max_tokens=400, temperature=1.0, seed=s, grammar=GRAMMAR)
                                          for s in range(len(prompts))])
    assert all(c.finish_reason == "stop" and _valid(c.text) for c in sampled), [c.text[-120:] for c in sampled]


def test_bad_grammars_are_refused_naming_the_problem(llm) -> None:
    with pytest.raises(ParamError, match="grammar must be a non-empty string"):
        SamplingParams(grammar="  ")
    bad = "start: %json " + json.dumps({"type": "objekt"})
    assert "objekt" in llm.engine.structured.check(bad)
    assert llm.engine.structured.check(GRAMMAR) is None
    req = llm.engine.new_request("bad", [1, 2, 3], SamplingParams(grammar=bad))
    with pytest.raises(ParamError, match="invalid grammar.*objekt"):
        llm.engine.add(req)
    assert not llm.engine.has_unfinished and "bad" not in llm.engine.structured
