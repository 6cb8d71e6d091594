"""A request checked against the model before it is queued: the limits only the loaded model
knows (vocabulary, context length). `SamplingParams` checks its own fields when it is built."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from tandem.core import ParamError, SamplingParams


def check_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int, vocab: int) -> int:
    """Prompt and stop token ids within the vocabulary, prompt plus max_tokens within the context
    length. Returns the resolved max_tokens; raises ParamError naming the field."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ParamError(f"the prompt must be a list of token ids, got {type(prompt_token_ids).__name__}", "prompt")
    n = len(prompt_token_ids)
    if n == 0:
        raise ParamError("the prompt is empty", "prompt")
    # The length first: a prompt far past the context is refused before its ids are scanned.
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max_tokens > max_model_len or n >= max_model_len:
        raise ParamError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens" if params.max_tokens is not None and n < max_model_len else "messages",
        )
    if not _all_ints(prompt_token_ids):
        raise ParamError("prompt token ids must be integers", "prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise ParamError(f"prompt token ids must be in [0, {vocab})", "prompt")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ParamError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    return max_tokens


def _all_ints(values: Sequence[object]) -> bool:
    if set(map(type, values)) <= {int}:  # the common case, at C speed
        return True
    return all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values)
