"""One request's output post-processing: its detokenizer and timing (`RequestState`), and the stop
rules applied to each token it keeps (`take_token`). The engine calls `take_token` once per kept
token, in order, also for the tokens of an accepted draft, so a request ends at the same token and
the same character with or without speculation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.core import Request, TokenLogprobs
from tandem.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    """Engine-side bookkeeping of a request (text, timing) that the scheduler does not need."""

    detok: IncrementalDetokenizer
    sent_chars: int = 0  # characters of detok.text already returned
    first_token_time: float | None = None
    last_token_time: float | None = None
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)


def take_token(req: Request, state: RequestState, token: int, grammar_done: bool, eos_token_ids: frozenset[int],
               max_model_len: int) -> tuple[str, str | None, int | str | None]:
    """Detokenize one token just appended to req.output_token_ids and apply the stop conditions:
    EOS and stop tokens (after min_tokens), a complete grammar (`grammar_done`; `eos_token_ids`
    are the tokenizer's, so a grammar's EOS stops also under ignore_eos), stop strings (a possible
    partial one held back), max_tokens and the context length. Returns (the text it releases,
    finish reason or None, stop reason)."""
    params = req.params
    finish, stop_reason = None, None
    stopped_by_token = False
    if token in req.eos_token_ids and req.num_output_tokens > params.min_tokens - 1:
        finish, stopped_by_token = "stop", True
    elif token in params.stop_token_ids and req.num_output_tokens > params.min_tokens - 1:
        finish, stop_reason, stopped_by_token = "stop", token, True
    elif grammar_done and token in eos_token_ids:  # the grammar's EOS (ignore_eos, min_tokens)
        finish, stopped_by_token = "stop", True
    elif grammar_done:
        finish = "stop"
    last = finish is not None or req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len
    if not stopped_by_token or params.include_stop_str_in_output:
        state.detok.push([token], final=last)
    elif last:
        state.detok.push([], final=True)
    text = state.detok.text
    hold = 0
    if params.stop and finish is None and req.num_output_tokens >= params.min_tokens:
        hit = find_stop(text, state.sent_chars, params.stop)
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if params.include_stop_str_in_output else pos
            text = text[:end]
            finish, stop_reason = "stop", stop
        else:
            # Hold back a possible partial stop string at the end of the text.
            hold = max(len(s) for s in params.stop) - 1
    if finish is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len):
        finish = "length"
    if finish is not None:
        hold = 0
    emit_upto = max(state.sent_chars, len(text) - hold)
    new_text = text[state.sent_chars : emit_upto]
    state.sent_chars = emit_upto
    return new_text, finish, stop_reason


def find_stop(text: str, sent: int, stops: Iterable[str]) -> tuple[int, str] | None:
    """Earliest stop string in the unsent tail (a stop may straddle already-sent text only if
    it was held back, which `hold` guarantees)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, sent - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
