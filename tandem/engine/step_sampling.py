"""Sampling and verifying one synchronous step's logits with the engine's `Sampler` (which keeps
the per-request generators and the penalties' state): each request's new tokens, or the error
that failed it alone (tandem/spec/verify.py holds the verification rules)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from itertools import accumulate

import torch

from tandem.core import Request
from tandem.engine.errors import brief, raise_if_fatal
from tandem.engine.sampler import Sampler, SamplerOutput
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.structured import StepMasks
from tandem.spec.proposer import Draft
from tandem.spec.verify import VerifyResult, accept_greedy, is_plain_greedy, verify

logger = logging.getLogger("tandem")


def sample_step(sampler: Sampler, logits: torch.Tensor, batch: list[ScheduledRequest], drafts: Mapping[str, Draft],
                masks: StepMasks | None = None) -> list[tuple[ScheduledRequest, VerifyResult | Exception]]:
    """The new tokens of every request that samples this step (logits [R, V]: each one's
    `num_logits` rows, in batch order), or the error that failed it alone.

    Requests without a draft are sampled together (`sample_rows`, the one-token path);
    plain greedy requests with a draft share one argmax pass (`accept_greedy`); every other
    request with a draft is verified on its 1 + K rows (`tandem.spec.verify`), drawing from
    the generator the sampler keeps for it. Requests with a grammar have their rows masked
    first (`masks`, from `StructuredOutputs.fill`); one whose mask failed is failed alone."""
    sampling = [s for s in batch if s.samples]
    offsets = list(accumulate((s.num_logits for s in sampling), initial=0))
    results: list[VerifyResult | Exception] = [Exception("not sampled")] * len(sampling)
    masked: dict[int, Exception] = {}
    if masks is not None:
        masks.apply(logits)
        masked = {i: masks.failed[s.request.request_id] for i, s in enumerate(sampling)
                  if s.request.request_id in masks.failed}
        for i, e in masked.items():
            results[i] = e
    plain = [i for i, s in enumerate(sampling) if not s.draft and i not in masked]
    if plain:
        rows = logits if len(plain) == len(sampling) else logits[[offsets[i] for i in plain]]
        sampled, failed = sample_rows(sampler, rows, [sampling[i].request for i in plain])
        for j, i in enumerate(plain):
            lp = sampled.logprobs[j]
            results[i] = failed[j] if j in failed else VerifyResult([sampled.token_ids[j]], 0,
                                                                    None if lp is None else [lp])
    # Plain greedy verifies (most of them) share one argmax over the step's rows and one host
    # sync; the others are verified one by one.
    batched = {i for i, s in enumerate(sampling) if s.draft and is_plain_greedy(s.request) and i not in masked}
    top = logits.argmax(dim=-1).tolist() if batched else []  # [R]
    for i in sorted(batched):
        tokens, n = accept_greedy(list(sampling[i].draft), top[offsets[i] : offsets[i + 1]])
        results[i] = VerifyResult(tokens, n)
    for i, s in enumerate(sampling):
        if s.draft and i not in batched and i not in masked:
            draft = drafts[s.request.request_id].cut(len(s.draft))  # the scheduler may cut a draft
            results[i] = verify_one(sampler, s, logits[offsets[i] : offsets[i + 1]], draft.probs)
    return list(zip(sampling, results))


def verify_one(sampler: Sampler, s: ScheduledRequest, logits: torch.Tensor, draft_probs: torch.Tensor | None
            ) -> VerifyResult | Exception:
    """Verify one request's draft on its logits rows [1 + K, V] (draft_probs: the q its tokens
    were drawn from, None for deterministic drafts); an error fails it alone."""
    req = s.request
    try:
        generator = None if req.params.greedy else sampler.generator_for(req)
        return verify(req, list(s.draft), logits, draft_probs, generator=generator)
    except Exception as e:  # noqa: BLE001 - a bad request must not fail the batch
        raise_if_fatal("sampling", e)
        return e


def sample_rows(sampler: Sampler, logits: torch.Tensor, reqs: list[Request]
                ) -> tuple[SamplerOutput, dict[int, Exception]]:
    """Sample the batch (logits [S, V]); when that raises, sample its rows one by one and
    blame only the rows that fail alone (returned by row; their tokens are placeholders).

    Before the retry the sampler rolls back the seeded generators the failed call drew from,
    so a seeded row that succeeds still draws exactly once and its tokens are the ones it
    would have had without the failure. Unseeded rows draw again from the engine's shared
    generator: they promise no repeatability. Greedy rows are unaffected."""
    try:
        return sampler(logits, reqs), {}
    except Exception as e:  # noqa: BLE001 - a bad row must not fail the batch
        raise_if_fatal("sampling", e)
        sampler.rollback()
        logger.warning("Sampling a batch of %d requests failed (%s); sampling them one by one",
                       len(reqs), brief(e), exc_info=e)
    tokens, logprobs = [0] * len(reqs), [None] * len(reqs)
    failed: dict[int, Exception] = {}
    for i, req in enumerate(reqs):
        try:
            row = sampler(logits[i : i + 1], [req])
        except Exception as e:  # noqa: BLE001
            raise_if_fatal("sampling", e)
            failed[i] = e
        else:
            tokens[i], logprobs[i] = row.token_ids[0], row.logprobs[0]
    return SamplerOutput(tokens, logprobs), failed
