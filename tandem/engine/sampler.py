"""Logits -> tokens (and logprobs) for a batch of requests, each with its own SamplingParams.

Order of operations (as in vLLM): logprobs come from the raw model logits; then min_tokens
masking, penalties, temperature, top-k, top-p and min-p, then the draw. Greedy requests take the
argmax after penalties. A request with a seed draws from its own generator, so its output does not
depend on what else is in the batch.

A call that raises can be undone for the seeded rows (`rollback`), so the engine can re-sample a
failed batch row by row without drawing twice from any seeded request's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core import Logprob, Request, SamplingParams, TokenLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def mask_eos_and_stop(row: torch.Tensor, req: Request) -> None:
    """In place, row [V]: the min_tokens rule (EOS and stop tokens cannot be drawn). Callers apply
    it while the request has generated fewer than min_tokens tokens."""
    banned = [t for t in (*req.eos_token_ids, *req.params.stop_token_ids) if t < row.shape[0]]
    if banned:
        row[banned] = float("-inf")


def apply_penalties(logits: torch.Tensor, req: Request, params: SamplingParams,
                    pending: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] float32 for one request; penalties as OpenAI and vLLM define them. `pending`: a
    token the request has sampled that is not in its lists yet (async scheduling: a 0-d device
    tensor), counted as its last output token."""
    vocab = logits.shape[0]
    extra = () if pending is None else (pending.reshape(1).to(device=logits.device, dtype=torch.long),)
    if params.repetition_penalty != 1.0:
        # Repetition penalty (CTRL) covers prompt and output tokens. A pending token already seen
        # is indexed twice: both writes are the same value.
        seen = torch.cat([torch.tensor([t for t in set(req.all_token_ids) if t < vocab], dtype=torch.long,
                                       device=logits.device), *extra])
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and (req.output_token_ids or extra):
        out = torch.cat([torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device), *extra])
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


def filter_logits_batch(
    logits: torch.Tensor,  # [S, V] float32
    temperature: torch.Tensor,  # [S]
    top_k: torch.Tensor,  # [S] int64; <= 0 or >= V: off
    top_p: torch.Tensor,  # [S]; 1.0: off
    min_p: torch.Tensor,  # [S]; 0.0: off
) -> torch.Tensor:
    """`filter_logits` for many rows at once, each with its own parameters (one sort for all)."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [S, V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [S, 1]: the k-th largest (ties stay in)
    logits = logits.masked_fill(logits < kth, float("-inf"))
    # Top-p over what top-k kept; masking keeps the sorted order, so the sort is reused.
    probs = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
    drop_sorted = ((torch.cumsum(probs, dim=-1) - probs) > top_p[:, None]) & (top_p < 1.0)[:, None]
    logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    below = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(below & (min_p > 0.0)[:, None], float("-inf"))


def top_logprobs(raw_logprobs: torch.Tensor, token_id: int, n: int) -> TokenLogprobs:
    chosen = Logprob(token_id, float(raw_logprobs[token_id]))
    top: tuple[Logprob, ...] = ()
    if n > 0:
        vals, ids = torch.topk(raw_logprobs, n)
        top = tuple(Logprob(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(chosen, top)


def host_logprobs(requests: list[Request], tokens: list[int], chosen: list[float], top_values: list[list[float]],
                  top_ids: list[list[int]]) -> list[TokenLogprobs | None]:
    """Each request's TokenLogprobs from `Sampler.logprobs_on_device`'s results brought to the host
    (None for a request that asks for none)."""
    out: list[TokenLogprobs | None] = []
    for i, (req, token) in enumerate(zip(requests, tokens)):
        n = req.params.logprobs
        out.append(None if n is None else TokenLogprobs(
            Logprob(token, chosen[i]), tuple(Logprob(top_ids[i][j], top_values[i][j]) for j in range(n))))
    return out


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        # Seeded generators the current call drew from, with their state before it (None: the
        # call created it). get_state is a host-side copy (~5 KB on CPU, 16 B on CUDA): no sync.
        self._undo: dict[str, torch.Tensor | None] = {}

    def generator_for(self, req: Request) -> torch.Generator:
        """The generator `req` draws from: its own, seeded one (created on first use, and recorded
        for `rollback`) or the engine's shared one. Speculative verification draws from it too, so
        a seeded request stays reproducible with speculation."""
        seed = req.params.seed
        if seed is None:
            return self.default_generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            self._undo.setdefault(req.request_id, None)
            gen = self.generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)  # SamplingParams reduced it into the range manual_seed takes
        else:
            self._undo.setdefault(req.request_id, gen.get_state())
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def rollback(self) -> None:
        """Undo the last call's draws from seeded generators: each is put back to its state before
        the call (or dropped, if the call created it; it is re-created from the seed). Sampling
        the same rows again then draws each seeded token once, as a call that never failed would.
        The engine's shared generator is not rolled back: unseeded rows promise no repeatability."""
        for request_id, state in self._undo.items():
            if state is None:
                self.generators.pop(request_id, None)
            elif request_id in self.generators:
                self.generators[request_id].set_state(state)
        self._undo = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [S, V] float32, one row per request -> one token per request (`sample`), brought
        to the host in a single copy, with the logprobs the requests ask for."""
        tokens = self.sample(logits, requests)
        on_device = self.logprobs_on_device(logits, requests, tokens)
        token_ids = tokens.tolist()  # the step's host sync (and one per logprobs tensor)
        if on_device is None:
            return SamplerOutput(token_ids, [None] * len(requests))
        return SamplerOutput(token_ids, host_logprobs(requests, token_ids, *(t.tolist() for t in on_device)))

    @staticmethod
    def logprobs_on_device(logits: torch.Tensor, requests: list[Request], tokens: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The logprobs the requests ask for, from the raw model logits (as vLLM), still on the
        device (async scheduling copies them with the tokens; `host_logprobs` reads them): (the
        chosen tokens' [S], the top values [S, n] and their ids [S, n]) with n the largest
        `logprobs` a request asks for (a request asking fewer takes the first ones); None when no
        request asks."""
        asked = [r.params.logprobs for r in requests if r.params.logprobs is not None]
        if not asked:
            return None
        raw = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
        chosen = raw.gather(1, tokens[:, None])[:, 0]  # [S]
        vals, ids = torch.topk(raw, max(asked), dim=-1)  # [S, n] each
        return chosen, vals, ids

    def sample(self, logits: torch.Tensor, requests: list[Request],
               pending: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """logits [S, V], one row per request -> the chosen tokens [S] int64, on the logits' device,
        without waiting for them (async scheduling keeps them there). `pending[i]`: request i's
        token sampled by the step before, still on the device (a 0-d tensor; None: its lists are
        complete), which penalties and min_tokens count as its last output token.

        Plain greedy rows take one batched argmax and plain sampling rows one batched filter and
        draw; rows with penalties, min_tokens or a seed are processed one by one on the device.
        """
        self._undo = {}
        logits = logits.float()
        dev = logits.device
        tokens = torch.empty(len(requests), dtype=torch.long, device=dev)  # [S]
        pending = pending or [None] * len(requests)
        outputs = [r.num_output_tokens + (p is not None) for r, p in zip(requests, pending)]
        simple = [not r.params.needs_penalties and n >= r.params.min_tokens for r, n in zip(requests, outputs)]
        greedy = [i for i, r in enumerate(requests) if simple[i] and r.params.greedy]
        # Unseeded sampling rows share one batched filter and one draw from the engine's generator.
        batched = [i for i, r in enumerate(requests) if simple[i] and not r.params.greedy and r.params.seed is None]
        if len(greedy) == len(requests):  # the common case: no index tensors to build
            return torch.argmax(logits, dim=-1)
        if greedy:
            rows = torch.tensor(greedy, device=dev)
            tokens[rows] = torch.argmax(logits[rows], dim=-1)
        if batched:
            rows = torch.tensor(batched, device=dev)
            ps = [requests[i].params for i in batched]
            filtered = filter_logits_batch(
                logits[rows],
                torch.tensor([p.temperature for p in ps], device=dev),
                torch.tensor([p.top_k for p in ps], device=dev),
                torch.tensor([p.top_p for p in ps], device=dev),
                torch.tensor([p.min_p for p in ps], device=dev),
            )
            draws = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=self.default_generator)
            tokens[rows] = draws[:, 0]
        done = set(greedy) | set(batched)
        for i, req in enumerate(requests):
            if i not in done:  # penalties, min_tokens or a per-request seed: one row at a time
                tokens[i] = self._sample_row(logits[i].clone(), req, pending[i], outputs[i])
        return tokens

    def _sample_row(self, row: torch.Tensor, req: Request, pending: torch.Tensor | None, num_output: int
                    ) -> torch.Tensor:
        """row [V] float32 (a copy) -> chosen token, a 0-d tensor on the device (`num_output`: the
        request's output tokens, `pending` included)."""
        params = req.params
        if num_output < params.min_tokens:
            mask_eos_and_stop(row, req)
        if params.needs_penalties:
            row = apply_penalties(row, req, params, pending)
        if params.greedy:
            return torch.argmax(row)
        probs = torch.softmax(filter_logits(row, params), dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator_for(req))[0]
