"""Logits -> tokens (and logprobs) for a batch of requests, each with its own SamplingParams.

Order of operations (as in vLLM): logprobs come from the raw model logits; then min_tokens
masking, penalties, temperature, top-k, top-p and min-p, then the draw. Greedy requests take the
argmax after penalties. A request with a seed draws from its own generator, so its output does not
depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core import Logprob, Request, SamplingParams, TokenLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: torch.Tensor, req: Request, params: SamplingParams) -> torch.Tensor:
    """logits [V] float32 for one request; penalties as OpenAI and vLLM define them."""
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        # Repetition penalty (CTRL) covers prompt and output tokens.
        seen = torch.tensor([t for t in set(req.all_token_ids) if t < vocab], dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with tokens outside top-k / top-p / min-p set to -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def top_logprobs(raw_logprobs: torch.Tensor, token_id: int, n: int) -> TokenLogprobs:
    chosen = Logprob(token_id, float(raw_logprobs[token_id]))
    top: tuple[Logprob, ...] = ()
    if n > 0:
        vals, ids = torch.topk(raw_logprobs, n)
        top = tuple(Logprob(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(chosen, top)


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.params.seed
        if seed is None:
            return self.default_generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [S, V] float32, one row per request -> one token per request."""
        logits = logits.float()
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        for i, req in enumerate(requests):
            params = req.params
            row = logits[i].clone()
            if req.num_output_tokens < params.min_tokens:
                banned = [t for t in (*req.eos_token_ids, *params.stop_token_ids) if t < row.shape[0]]
                if banned:
                    row[banned] = float("-inf")
            if params.needs_penalties:
                row = apply_penalties(row, req, params)
            if params.greedy:
                token = int(torch.argmax(row))
            else:
                probs = torch.softmax(filter_logits(row, params), dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self._generator(req)))
            token_ids.append(token)
            if params.logprobs is not None and raw_logprobs is not None:
                logprobs.append(top_logprobs(raw_logprobs[i], token, params.logprobs))
            else:
                logprobs.append(None)
        return SamplerOutput(token_ids, logprobs)
