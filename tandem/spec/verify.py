"""Verify one request's speculative draft against the target's logits from one forward.

The target runs one forward over the request's 1+K tokens: the last generated token followed by
the K draft tokens. Its logits row i is the target's prediction after the request's tokens plus
draft[:i]. `verify` turns those rows into 1..K+1 new tokens, lossless:

- Greedy (temperature 0): accept draft tokens while each equals the target's argmax, then append
  the target's own argmax at the first mismatch (or after the last draft: the bonus token). The
  argmax is taken after the same min_tokens masking and penalties the non-speculative sampler
  applies, so the tokens are the ones stepping that sampler one token at a time would produce.
- Sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Draft token x drawn from
  the drafter's q is accepted with probability min(1, p(x)/q(x)); at the first rejection the
  token is drawn from norm(max(0, p - q)) instead; when every draft is accepted one bonus token
  is drawn from p of row K. p is the distribution the non-speculative sampler would draw from
  (penalties, min_tokens, temperature, top-k, top-p, min-p), so every emitted token has exactly
  the target's distribution given the tokens before it.

The engine (`LLMEngine`) calls it for every request that verifies a draft. The caller owns what
comes after: appending the tokens, cutting them at the first EOS / stop token / stop string /
max_tokens (the tokens before the cut are distributed exactly as without speculation; the ones
after are discarded), and freeing the KV entries of the rejected drafts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tandem.core import Request, TokenLogprobs
from tandem.engine.sampler import apply_penalties, filter_logits_batch, mask_eos_and_stop, top_logprobs


@dataclass(frozen=True)
class VerifyResult:
    """What one verification step produced for one request.

    tokens: draft[:num_accepted] followed by one token of the target's (the correction drawn at
        the first rejected position, or the bonus token when all K drafts were accepted):
        1 .. K+1 tokens. tokens[i] was chosen at logits row i.
    num_accepted: draft tokens accepted, 0 .. K (per-position acceptance for metrics follows:
        positions < num_accepted were accepted, the next one, if any, was rejected).
    logprobs: with params.logprobs set, one entry per token, from the raw logits of its row (as
        the sampler reports them: before penalties and filtering); else None.
    """

    tokens: list[int]
    num_accepted: int
    logprobs: list[TokenLogprobs] | None = None


def penalized_logits(logits: torch.Tensor, req: Request, draft: list[int]) -> torch.Tensor:
    """logits [K+1, V] -> a float32 copy with min_tokens masking and penalties applied per row.

    Row i is processed as the sampler processes a step whose history is the request's tokens plus
    draft[:i]: draft[:i] count as generated tokens for the penalties and for min_tokens (EOS and
    stop tokens are masked while fewer than min_tokens tokens have been generated). Greedy
    decoding takes the argmax of these rows; sampling filters them (`target_probs`).
    """
    rows = logits.float().clone()  # [K+1, V]
    params = req.params
    done = req.num_output_tokens
    if not params.needs_penalties and done >= params.min_tokens:
        return rows
    for i in range(rows.shape[0]):
        if done + i < params.min_tokens:
            mask_eos_and_stop(rows[i], req)
        if params.needs_penalties:
            # A copy of the request whose history includes draft[:i] (the prompt list is shared).
            ahead = dataclasses.replace(req, output_token_ids=req.output_token_ids + draft[:i])
            rows[i] = apply_penalties(rows[i].clone(), ahead, params)
    return rows


def target_probs(logits: torch.Tensor, req: Request, draft: list[int]) -> torch.Tensor:
    """logits [K+1, V] -> probs [K+1, V] float32: row i is the distribution the non-speculative
    sampler would draw from after the request's tokens plus draft[:i] (`penalized_logits`, then
    temperature, top-k, top-p and min-p). For a greedy request each row is one-hot at its argmax."""
    rows = penalized_logits(logits, req, draft)
    params = req.params
    if params.greedy:
        return torch.nn.functional.one_hot(rows.argmax(dim=-1), rows.shape[1]).float()
    n, dev = rows.shape[0], rows.device
    filtered = filter_logits_batch(
        rows,
        torch.full((n,), params.temperature, device=dev),
        torch.full((n,), params.top_k, dtype=torch.long, device=dev),
        torch.full((n,), params.top_p, device=dev),
        torch.full((n,), params.min_p, device=dev),
    )
    return torch.softmax(filtered, dim=-1)


def verify(
    req: Request,
    draft: list[int],
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Accept a prefix of `draft` and add one target token; see the module docstring.

    req: the request before this step; req.output_token_ids are the tokens generated so far (the
        last of them is the first of the 1+K tokens the target was run on; draft is not in it).
    draft: K >= 0 proposed token ids. K = 0 is a plain one-token step through the same path.
    logits: [K+1, V] the target's raw logits; row i after the request's tokens plus draft[:i].
    draft_probs: [K, V] row i is the distribution draft[i] was drawn from (the drafter's,
        after the request's tokens plus draft[:i]), on logits' device. None: a one-hot q at each
        draft token; draft[i] is then accepted with probability p(draft[i]), and otherwise the
        token is drawn from p without it. That is lossless whatever chose the drafts, so a
        deterministic drafter (n-gram lookup, a greedy draft model) must pass None: its softmax
        is not what its tokens were drawn from, and verifying against it biases the output. A
        sampling drafter passes the q it drew from, which accepts more (min(1, p/q) >= p).
    generator: the request's generator (seeded requests) or the engine's shared one; None is
        torch's default generator for logits' device. A sampling step draws K uniforms and then
        one token, whatever is accepted, so the same seed and the same drafts give the same
        tokens. Greedy requests draw nothing. With K = 0 the draw is the sampler's: the same
        generator state gives the token `Sampler` would give.

    Ignored for greedy requests: draft_probs and generator.
    """
    _check_shapes(draft, logits, draft_probs)
    if req.params.greedy:
        tokens, accepted = _verify_greedy(req, draft, logits)
    else:
        tokens, accepted = _verify_sampled(req, draft, logits, draft_probs, generator)
    logprobs = None
    if req.params.logprobs is not None:
        raw = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # raw model logits, as the sampler
        logprobs = [top_logprobs(raw[i], t, req.params.logprobs) for i, t in enumerate(tokens)]
    return VerifyResult(tokens, accepted, logprobs)


def _verify_greedy(req: Request, draft: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    target = penalized_logits(logits, req, draft).argmax(dim=-1).tolist()  # [K+1]: the one host sync
    return accept_greedy(draft, target)


def is_plain_greedy(req: Request) -> bool:
    """Whether `verify` would take the plain argmax of the raw rows for this request (greedy, no
    penalties, min_tokens reached, no logprobs): then many requests' rows can be reduced in one
    device pass and accepted with `accept_greedy`, with the very tokens `verify` gives."""
    p = req.params
    return p.greedy and not p.needs_penalties and req.num_output_tokens >= p.min_tokens and p.logprobs is None


def is_plain_sampled(req: Request) -> bool:
    """Whether a sampled request's target distribution is the filtered softmax of its raw rows
    (no penalties, min_tokens reached, no logprobs): what a speculative step ahead can verify on
    the device (`tandem.engine.spec_ahead.accept_sampled_on_device`)."""
    p = req.params
    return not p.greedy and not p.needs_penalties and req.num_output_tokens >= p.min_tokens and p.logprobs is None


def accept_greedy(draft: list[int], target: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance on the host: target [K+1] holds the argmax of each row. Drafts are kept
    while they equal it; then the target's own token (the correction, or the bonus after all K).
    Returns (tokens, number of drafts accepted)."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]], n


def _verify_sampled(
    req: Request,
    draft: list[int],
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    p = target_probs(logits, req, draft)  # [K+1, V]
    k, dev = len(draft), p.device
    if k == 0:
        return [int(torch.multinomial(p[0], 1, generator=generator))], 0
    d = torch.tensor(draft, dtype=torch.long, device=dev)  # [K]
    pos = torch.arange(k, device=dev)
    p_draft = p[pos, d]  # [K]
    q = None if draft_probs is None else draft_probs.float()  # [K, V]
    q_draft = torch.ones(k, device=dev) if q is None else q[pos, d]  # [K]; one-hot q: 1
    u = torch.rand(k, generator=generator, device=dev)  # [K]
    # Accept draft i when u < p/q, written u * q < p: q <= p always accepts (u < 1), p = 0 (the
    # token is outside the target's filtered support) never does. q = 0 cannot happen when the
    # draft was drawn from q; should it happen anyway (underflow, a drafter reporting the wrong q)
    # the draft is rejected, as vLLM does: the emitted token then comes from the residual.
    accept = (u * q_draft < p_draft) & (q_draft > 0)  # [K]
    n = accept.long().cumprod(dim=0).sum()  # 0-d, device: drafts accepted before the first rejection
    # Row i: where the token comes from when draft i is the first rejected; row K: the bonus.
    final = torch.cat([_residual(p[:k], q, d), p[k:]])  # [K+1, V]
    token = torch.multinomial(final.index_select(0, n.view(1))[0], 1, generator=generator)  # [1]
    accepted, tok = torch.cat([n.view(1), token]).tolist()  # the one host sync
    return draft[:accepted] + [tok], accepted


def _residual(p: torch.Tensor, q: torch.Tensor | None, d: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row: p [K, V], q [K, V] or None (one-hot at d [K]) -> [K, V].

    With a one-hot q this is p without the draft token, renormalised. A row with no mass left
    (p <= q everywhere, i.e. p == q, where a rejection comes only from rounding) falls back to p.
    """
    if q is None:
        res = p.scatter(1, d[:, None], 0.0)  # p - 1 <= 0 at the draft token
    else:
        res = (p - q).clamp_min(0.0)
    mass = res.sum(dim=-1, keepdim=True)  # [K, 1]
    return torch.where(mass > 0, res / mass, p)


def _check_shapes(draft: list[int], logits: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
    k = len(draft)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verify needs K+1 = {k + 1} logits rows (the last generated token's and one per draft "
                         f"token) for {k} draft tokens, got a tensor of shape {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if any(not 0 <= t < vocab for t in draft):
        raise ValueError(f"draft tokens must be ids in [0, {vocab}), got {draft}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must have shape [K, V] = [{k}, {vocab}] (one row per draft token), "
                         f"got {tuple(draft_probs.shape)}; pass None for a deterministic (n-gram) drafter")
