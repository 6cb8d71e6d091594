"""spec/phase.py: the phase of a request from the tokens it generated, with the demo tokenizer's
real marker ids and prompts rendered by the demo chat template, and with a copy of that tokenizer
whose markers are not tokens (the text fallback)."""

from __future__ import annotations

import json

import pytest

from tandem.builtin import demo_model_dir
from tandem.server.chat_template import ChatTemplate
from tandem.spec.phase import CONTENT, PHASES, REASONING, TOOL_CALL, PhaseMarkers, PhaseTracker
from tandem.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir())


@pytest.fixture(scope="module")
def markers(tok) -> PhaseMarkers:
    return PhaseMarkers.from_tokenizer(tok)


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, int]:
    names = {"think": "<think>", "end": "</think>", "call": "<tool_call>", "call_end": "</tool_call>"}
    return {k: tok.token_to_id(v) for k, v in names.items()}


@pytest.fixture(scope="module")
def plain_tok(tok, tmp_path_factory) -> Tokenizer:
    """The demo tokenizer without its think and tool-call tokens: the markers are BPE pieces."""
    data = json.loads((demo_model_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    gone = {"<think>", "</think>", "<tool_call>", "</tool_call>"}
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in gone]
    out = tmp_path_factory.mktemp("plain_tokenizer")
    (out / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return Tokenizer.from_dir(out)


def _prompt(tok: Tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return tok.encode(ChatTemplate(tok.chat_template).render(messages, kwargs=kwargs))


def _text(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


# ---- markers from the tokenizer ----------------------------------------------------------------


def test_demo_tokenizer_markers_are_single_tokens(tok, markers, ids):
    for name in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tok.encode(name) == [tok.token_to_id(name)]  # one added token each
    assert markers.think_start == {ids["think"]} and markers.think_end == {ids["end"]}
    assert markers.tool_call_start == {ids["call"]} and markers.tool_call_end == {ids["call_end"]}
    assert markers.text == () and markers.tracks_reasoning
    assert {tok.encode("\n")[0], tok.encode("\n\n")[0], tok.encode(" ")[0]} <= markers.whitespace_ids
    assert not {ids["think"], tok.encode("a")[0]} & markers.whitespace_ids
    assert set(PHASES) == {REASONING, CONTENT, TOOL_CALL}


# ---- the starting phase from the prompt ----------------------------------------------------------


def test_thinking_enabled_prompt_starts_in_content_and_the_model_opens_reasoning(tok, markers, ids):
    prompt = _prompt(tok, [{"role": "user", "content": "hi"}])
    tr = PhaseTracker(markers, prompt)
    assert tr.phase == CONTENT
    assert tr.update([ids["think"]]) == REASONING
    assert tr.update(_text(tok, "\nlet me see\n")) == REASONING
    assert tr.update([ids["end"]]) == CONTENT
    assert tr.update(_text(tok, "\n\nHello.")) == CONTENT


def test_an_older_think_block_in_the_prompt_does_not_switch(tok, markers, ids):
    # An agent's tool loop: the current turn's earlier assistant message keeps its reasoning, so
    # the prompt holds a closed think block and a tool call before the new generation prompt.
    messages = [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call ls.",
         "tool_calls": [{"function": {"name": "ls", "arguments": {"path": "."}}}]},
        {"role": "tool", "content": "a.py b.py"},
    ]  # fmt: skip
    prompt = _prompt(tok, messages)
    assert ids["end"] in prompt and ids["call"] in prompt and ids["call_end"] in prompt
    tr = PhaseTracker(markers, prompt)
    assert tr.phase == CONTENT
    assert tr.update([ids["think"]]) == REASONING  # the old `</think>` did not make content sticky


def test_a_quoted_think_in_the_last_user_message_does_not_open_reasoning(tok, markers, ids):
    prompt = _prompt(tok, [{"role": "user", "content": "What does <think> do?"}])
    assert ids["think"] in prompt
    assert PhaseTracker(markers, prompt).phase == CONTENT


def test_thinking_disabled_by_the_template_is_content_from_the_start(tok, markers, ids):
    prompt = _prompt(tok, [{"role": "user", "content": "hi"}], enable_thinking=False)
    assert tok.decode(prompt[-4:], skip_special_tokens=False) == "<think>\n\n</think>\n\n"
    tr = PhaseTracker(markers, prompt)
    assert tr.phase == CONTENT
    assert tr.update([ids["think"]]) == CONTENT  # the block the template closed stays closed


def test_a_template_that_opens_the_block_starts_in_reasoning(tok, markers, ids):
    prompt = _text(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    tr = PhaseTracker(markers, prompt)
    assert tr.phase == REASONING
    assert tr.update(_text(tok, "hmm\n")) == REASONING
    assert tr.update([ids["end"]]) == CONTENT


# ---- generated tokens ----------------------------------------------------------------------------


def test_content_after_think_end_is_sticky(tok, markers, ids):
    tr = PhaseTracker(markers, _text(tok, "<|im_start|>assistant\n<think>\n"))
    assert tr.update([ids["end"]]) == CONTENT
    assert tr.update([ids["think"]]) == CONTENT  # a `<think>` in the answer does not reopen reasoning
    assert tr.update(_text(tok, "code") + [ids["think"]]) == CONTENT


def test_tool_call_begin_is_the_fallback_switch_out_of_reasoning(tok, markers, ids):
    tr = PhaseTracker(markers)
    tr.update([ids["think"]] + _text(tok, "call ls\n"))
    assert tr.phase == REASONING
    assert tr.update([ids["call"]]) == TOOL_CALL  # no `</think>` before it
    assert tr.update(_text(tok, '\n{"name": "ls"}\n') + [ids["end"]]) == TOOL_CALL  # text inside the call
    assert tr.update([ids["call_end"]]) == CONTENT
    assert tr.update([ids["think"]]) == CONTENT  # reasoning is over


def test_tool_call_from_content_and_back(tok, markers, ids):
    tr = PhaseTracker(markers, _prompt(tok, [{"role": "user", "content": "hi"}], enable_thinking=False))
    assert tr.update(_text(tok, "Sure.\n") + [ids["call"]] + _text(tok, "{}")) == TOOL_CALL
    assert tr.update([ids["call_end"]] + _text(tok, "\n")) == CONTENT


def test_multi_token_updates_count_a_marker_in_the_middle(tok, markers, ids):
    a, b = _text(tok, "ab")[:1], _text(tok, "cd")[:1]
    tr = PhaseTracker(markers)
    assert tr.update(a + [ids["think"]] + b) == REASONING
    assert tr.update(a + [ids["end"]] + b + b) == CONTENT
    # several markers in one update apply in order
    assert PhaseTracker(markers).update([ids["think"]] + a + [ids["end"]] + b) == CONTENT
    assert PhaseTracker(markers).update([ids["end"], ids["think"]]) == CONTENT
    assert PhaseTracker(markers).update([ids["think"], ids["call"], ids["call_end"]]) == CONTENT
    assert PhaseTracker(markers).update([]) == CONTENT


def test_no_markers_means_always_content(tok, ids):
    none = PhaseMarkers()
    assert not none.tracks_reasoning
    tr = PhaseTracker(none, _text(tok, "<|im_start|>assistant\n<think>\n"))
    assert tr.phase == CONTENT
    assert tr.update([ids["think"], ids["call"]]) == CONTENT
    # without tool-call markers only `</think>` ends reasoning
    think_only = PhaseMarkers(think_start=frozenset({ids["think"]}), think_end=frozenset({ids["end"]}))
    tr = PhaseTracker(think_only)
    assert tr.update([ids["think"], ids["call"]]) == REASONING
    assert tr.update([ids["end"]]) == CONTENT


# ---- markers that are not single tokens: matched as text ---------------------------------------------


def test_split_markers_are_matched_as_text(plain_tok):
    tok = plain_tok
    assert tok.token_to_id("<think>") is None and len(tok.encode("</think>")) > 1
    markers = PhaseMarkers.from_tokenizer(tok)
    assert markers.think_start == frozenset() and dict(markers.text) == {
        "think_start": "<think>", "think_end": "</think>", "tool_call_start": "<tool_call>",
        "tool_call_end": "</tool_call>"}  # fmt: skip
    # The encoded marker is not what appears in real output: ">" merges with the newlines after it.
    assert tok.encode("</think>") != tok.encode("</think>\n\nok")[: len(tok.encode("</think>"))]

    out = tok.encode("<think>\nplan it\n</think>\n\nThe answer.<tool_call>\n{}\n</tool_call>\nbye")
    expected = []  # the phase after each token, from the decoded text so far
    for i in range(1, len(out) + 1):
        text = tok.decode(out[:i], skip_special_tokens=False)
        if "<tool_call>" in text and "</tool_call>" not in text:
            expected.append(TOOL_CALL)
        elif "</think>" in text or "</tool_call>" in text:
            expected.append(CONTENT)
        else:
            expected.append(REASONING if "<think>" in text else CONTENT)
    assert set(expected) == {REASONING, CONTENT, TOOL_CALL}

    one_by_one = PhaseTracker(markers)
    assert [one_by_one.update([t]) for t in out] == expected  # markers split across every update
    for cut in range(len(out) + 1):  # and across any two updates
        tr = PhaseTracker(markers)
        assert tr.update(out[:cut]) == (expected[cut - 1] if cut else CONTENT)
        assert tr.update(out[cut:]) == expected[-1]


def test_split_markers_at_the_end_of_the_prompt(plain_tok):
    tok = plain_tok
    markers = PhaseMarkers.from_tokenizer(tok)
    head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert PhaseTracker(markers, tok.encode(head)).phase == CONTENT
    assert PhaseTracker(markers, tok.encode(head + "<think>\n")).phase == REASONING
    disabled = PhaseTracker(markers, tok.encode(head + "<think>\n\n</think>\n\n"))
    assert disabled.phase == CONTENT
    assert disabled.update(tok.encode("<think>")) == CONTENT
