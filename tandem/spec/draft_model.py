"""Draft-model proposer: a smaller LM with the target's tokenizer drafts K tokens one at a time,
with a paged KV cache of its own kept in step with the tokens the target kept.

The drafter sees each request as a shadow sequence: the target's tokens (the prompt list is
shared, not copied) followed by the drafts it proposed last. Its KV cache holds K/V for a prefix
of that sequence. Before drafting, `propose` compares the drafts it fed with what the target then
kept: the K/V of the drafts the target accepted stay (they are the target's tokens now), the rest
roll back (`KVCacheManager.trim`), and the tokens the target added (the correction or bonus
token) are fed with the next draft step. Prefill runs alongside the target's: `observe` feeds the
drafter the prompt chunks the target just computed, so the first draft costs no long catch-up.

Every drafter forward goes through a `ModelRunner` of its own (CUDA graphs for one and two query
tokens per request: a draft step, and the first step after a verify that fed back a correction
and the last accepted draft; prefill graphs for longer feeds), within the engine's token budget
per forward. The draft steps after a proposal's first forward run chained on the device
(`ModelRunner.execute_chain`): the drafts reach the host once a proposal, not once a token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.core import Request
from tandem.engine.runner import ModelRunner, allocate_kv_caches
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.static_inputs import host_to_device
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import group_layers
from tandem.models.base import CausalLM
from tandem.spec.proposer import Draft
from tandem.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger("tandem")


@dataclass
class _Shadow:
    seq: Request  # the drafter's sequence: the target's prompt (shared list), output and drafts
    base: int = 0  # target tokens the sequence held when the drafts below were appended
    drafts: list[int] = field(default_factory=list)  # drafts appended after `base` tokens


def _feed_mode(mode: str, batch: Sequence[ScheduledRequest]) -> str:
    """How a feed ran, for the metrics and for auto, which tells a drafter's catch-up or prompt work
    ("prefill", "prefill_graph") from its steady state. The runner calls any forward with more
    query tokens than logits rows "prefill"; the feed after a verify (the correction and the last
    accepted draft: at most two tokens a request) is the drafter's decode step, which a graph of
    two query tokens replays on a GPU: run eagerly (on a CPU, or no graph fits), it is "eager"."""
    if mode == "prefill" and all(s.num_tokens <= 2 for s in batch):
        return "eager"
    return mode


class DraftModelProposer:
    """Drafts from a draft model; see the module docstring.

    generator_for(request) gives the generator a sampled request draws its drafts from (the
    engine's sampler: the request's seeded one, or the shared one). count_forward(mode) is called
    once per drafter forward with the runner's mode (cuda_graph / eager / prefill; metrics)."""

    # A prompt it was not shown is caught up on when the request first drafts (`_sync`), so the
    # engine may skip feeding it prompts of requests that are not going to draft (adaptive auto).
    prefill_is_optional = True
    # `observe` feeds prompt chunks and nothing else (drafts are caught up on by `_sync`).
    observes_prompt_chunks_only = True

    def __init__(self, model: CausalLM, device: torch.device, max_batched_tokens: int,
                 generator_for: Callable[[Request], torch.Generator],
                 count_forward: Callable[[str], None] = lambda mode: None) -> None:
        self.model = model
        self.device = device
        self.max_batched_tokens = max_batched_tokens
        self.generator_for = generator_for
        self.count_forward = count_forward
        self.vocab_size = int(model.hf_config["vocab_size"])
        self._shadows: dict[str, _Shadow] = {}
        self.kv: KVCacheManager | None = None
        self.runner: ModelRunner | None = None

    # -- start-up -----------------------------------------------------------------------------
    @staticmethod
    def check_tokenizer(path: Path, target: Tokenizer, target_vocab: int, draft_vocab: int) -> None:
        """Raise ValueError (one line) unless the drafter shares the target's vocabulary: the same
        vocab_size, and the same token strings when the drafter's directory has a tokenizer.json
        (without one the target's tokenizer is assumed, as vLLM does)."""
        where = "--speculative-config: model"
        if draft_vocab != target_vocab:
            raise ValueError(f"{where}: the draft model {path} has vocab_size {draft_vocab} but the target has "
                             f"{target_vocab}; a draft model must share the target's tokenizer")
        if not (path / "tokenizer.json").is_file():
            return
        try:
            draft_tok = Tokenizer.from_dir(path)
        except TokenizerError as e:
            raise ValueError(f"{where}: the draft model's tokenizer: {e}") from None
        a, b = target.fast.get_vocab(with_added_tokens=True), draft_tok.fast.get_vocab(with_added_tokens=True)
        if a != b:
            diff = next((t for t in sorted(set(a) ^ set(b))), None) or next(t for t in a if a[t] != b.get(t))
            raise ValueError(f"{where}: the draft model {path} has a different tokenizer ({len(b)} tokens vs the "
                             f"target's {len(a)}; e.g. {diff!r} differs); a draft model must share the target's")

    def kv_bytes_per_block(self, block_size: int) -> int:
        return sum(g.bytes_per_block(block_size) for g in group_layers(self.model.kv_cache_specs()))

    def allocate(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        """The drafter's KV cache: as many blocks as the target's, so a request that fits the
        target's cache fits the drafter's."""
        groups = group_layers(self.model.kv_cache_specs())
        self.kv = KVCacheManager(groups, num_blocks, block_size, enable_prefix_caching)
        allocate_kv_caches(self.model, self.kv, self.device)
        self.runner = ModelRunner(self.model, self.kv, self.device)
        if not self.runner.can_chain():  # its draft steps run chained (`propose`)
            raise ValueError("--speculative-config: a draft model with compressed KV caches (DeepSeek-V4's) is not "
                             "supported; use a draft model with plain or sliding-window attention")

    def capture(self, max_num_seqs: int, max_model_len: int, prefill: tuple[int, ...] = ()) -> None:
        """Graphs of one and two query tokens per request, and prefill graphs at the token totals
        `prefill` (the target's): the drafter's prompt chunks (`observe`) and its catch-up after
        steps at K = 0 replay them instead of costing an eager forward's host time (where its
        model's steps can take them: `ModelRunner.capture`)."""
        assert self.runner is not None, "allocate() first"
        self.runner.capture(max_num_seqs, {"drafter": (1, 2)}, max_model_len, prefill=prefill)

    def measure(self, buckets: Sequence[int], depths: Sequence[int], repeats: int = 5) -> dict[tuple[int, int], float]:
        """Seconds of drafting `depth` tokens per (batch, depth), from the drafter runner's
        forwards (`ModelRunner.measure`): a first step of two query tokens per request (the
        correction and the last accepted draft), then depth - 1 steps of one."""
        assert self.runner is not None, "allocate() first"
        one = self.runner.measure([(b, q) for b in buckets for q in (1, 2)], repeats)
        return {(b, d): one[(b, 2)] + (d - 1) * one[(b, 1)] for b in buckets for d in depths}

    # -- the proposer interface ---------------------------------------------------------------
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Request i's next ks[i] tokens from the drafter. One forward feeds each request what its
        drafter has not seen (the target's correction and last accepted draft, or a catch-up);
        the remaining ks[i] - 1 draft steps run chained on the device (`ModelRunner.execute_chain`),
        each fed the tokens picked from the previous step's logits, and the drafts reach the host
        once, at the end."""
        if len(requests) != len(ks):
            raise ValueError(f"propose needs one k per request, got {len(ks)} for {len(requests)} requests")
        drafts: list[Draft] = [Draft([]) for _ in requests]
        active = [i for i, k in enumerate(ks) if k > 0]
        shadows = {i: self._sync(requests[i]) for i in active}
        rows = self._feed([shadows[i] for i in active])  # logits after each request's last token
        fed = [i for i, row in zip(active, rows) if row is not None]
        if not fed:
            return drafts
        first, first_q = self._pick([requests[i] for i in fed], torch.stack([r for r in rows if r is not None]))
        chain = [i for i in fed if ks[i] > 1 and self._reserve(shadows[i], ks[i] - 1)]
        picked: list[tuple[torch.Tensor, list[torch.Tensor | None]]] = []
        if chain:
            reqs, lives = [requests[i] for i in chain], [ks[i] - 1 for i in chain]

            def pick(j: int, logits: torch.Tensor) -> torch.Tensor:
                tokens, qs = self._pick(reqs, logits, [life > j for life in lives])
                picked.append((tokens, qs))
                return tokens

            at = {i: r for r, i in enumerate(fed)}
            rows_of_chain = host_to_device([at[i] for i in chain], torch.int64, self.device)
            batch = [ScheduledRequest.of(shadows[i].seq, 1) for i in chain]
            mode = self.runner.execute_chain(batch, first.index_select(0, rows_of_chain), lives, pick)
            for _ in range(max(lives)):
                self.count_forward(mode)
        host = torch.cat([first] + [tokens for tokens, _ in picked]).tolist()  # the proposal's one host sync
        tokens = {i: [host[r]] for r, i in enumerate(fed)}
        probs = {i: [q] for i, q in zip(fed, first_q)}
        offset = len(fed)
        for _, qs in picked:
            for r, i in enumerate(chain):
                if len(tokens[i]) < ks[i]:
                    tokens[i].append(host[offset + r])
                    probs[i].append(qs[r])
            offset += len(chain)
        chained = set(chain)
        for i in fed:
            sh, toks = shadows[i], tokens[i]
            seq = sh.seq
            if i in chained:  # its placeholder becomes the first draft; all but the last were fed
                del seq.output_token_ids[-1]
                seq.num_computed_tokens += len(toks) - 1
            sh.drafts = list(toks)
            seq.output_token_ids.extend(toks)
            if i in chained:
                assert self.kv is not None
                self.kv.commit(seq)
            qs = [q for q in probs[i] if q is not None]
            drafts[i] = Draft(toks, torch.stack(qs) if qs else None)
        return drafts

    def observe(self, batch: Sequence[ScheduledRequest], kept: Sequence[int], aux: torch.Tensor | None) -> None:
        """Prefill alongside the target: feed the drafter the prompt chunks the target computed."""
        chunks = [(s.request, s.start + n) for s, n in zip(batch, kept) if not s.draft and s.num_tokens > 1]
        if not chunks:
            return
        shadows = [self._sync(req) for req, _ in chunks]
        self._feed(shadows, [min(upto, sh.seq.num_tokens - 1) for sh, (_, upto) in zip(shadows, chunks)])

    def remove(self, request_id: str) -> None:
        sh = self._shadows.pop(request_id, None)
        if sh is not None and self.kv is not None:
            self.kv.free(sh.seq)

    def __len__(self) -> int:
        return len(self._shadows)

    # -- internals ----------------------------------------------------------------------------
    def _sync(self, req: Request) -> _Shadow:
        """The request's shadow, rolled back to the drafts the target kept and extended with the
        target's tokens since (their K/V are computed by the next `_feed`)."""
        sh = self._shadows.get(req.request_id)
        if sh is None:
            sh = self._shadows[req.request_id] = _Shadow(Request(req.request_id, req.prompt_token_ids, req.params))
        seq, out, p = sh.seq, req.output_token_ids, req.num_prompt_tokens
        # The drafts were appended after `base` tokens; those the target now holds at the same
        # positions keep their K/V (an accepted draft is the target's token).
        kept = 0
        for d, t in zip(sh.drafts, out[sh.base - p :]):
            if d != t:
                break
            kept += 1
        valid = min(seq.num_computed_tokens, sh.base + kept) if sh.drafts else min(seq.num_computed_tokens, req.num_tokens)
        if valid < seq.num_computed_tokens:
            assert self.kv is not None
            self.kv.trim(seq, valid)
            seq.num_computed_tokens = valid
        seq.output_token_ids = list(out)
        sh.base, sh.drafts = req.num_tokens, []
        return sh

    def _feed(self, shadows: Sequence[_Shadow], upto: Sequence[int] | None = None) -> list[torch.Tensor | None]:
        """Compute K/V of each shadow's tokens up to `upto[i]` (default: all of them) in forwards
        within the token budget; returns, per shadow fed to its end, the logits row [V] after its
        last token (None for one fed only part way, or whose cache is full: it drafts no more)."""
        assert self.kv is not None and self.runner is not None, "allocate() first"
        ends = [sh.seq.num_tokens for sh in shadows] if upto is None else list(upto)
        rows: list[torch.Tensor | None] = [None] * len(shadows)
        pending = [i for i, sh in enumerate(shadows) if sh.seq.num_computed_tokens < ends[i]]
        while pending:
            budget, batch, owners = self.max_batched_tokens, [], []
            for i in list(pending):
                seq = shadows[i].seq
                hit = self.kv.find_prefix(seq) if seq.request_id not in self.kv.req_blocks else None
                start = hit.num_tokens if hit is not None else seq.num_computed_tokens
                n = min(ends[i] - start, budget)
                if n <= 0:
                    if budget <= 0:
                        break
                    pending.remove(i)  # a prefix hit covers it
                    if hit is not None and self.kv.allocate_slots(seq, 0, hit):
                        seq.num_computed_tokens = start
                    continue
                if not self.kv.allocate_slots(seq, n, hit):
                    logger.debug("draft model KV cache full: no more drafts for %s this step", seq.request_id)
                    pending.remove(i)
                    continue
                seq.num_computed_tokens = start
                s = ScheduledRequest.of(seq, n)
                batch.append(s)
                owners.append(i)
                budget -= n
            if not batch:
                break
            out = self.runner.execute(batch)
            self.count_forward(_feed_mode(out.mode, batch))
            r = 0
            for s, i in zip(batch, owners):
                seq = s.request
                seq.num_computed_tokens += s.num_tokens
                self.kv.commit(seq)
                if s.samples:
                    rows[i] = out.logits[r].clone()  # a graph output view is overwritten by the next forward
                    r += 1
                if seq.num_computed_tokens >= ends[i]:
                    pending.remove(i)
        return rows

    def _reserve(self, sh: _Shadow, n: int) -> bool:
        """Room in the drafter's cache for a chain of n draft steps after the shadow's computed
        tokens, behind a placeholder for its first draft (the chain's first query token). False,
        changing nothing, when the cache is full: the request drafts one token this step."""
        assert self.kv is not None
        if not self.kv.allocate_slots(sh.seq, n):
            logger.debug("draft model KV cache full: one draft for %s this step", sh.seq.request_id)
            return False
        sh.seq.output_token_ids.append(0)
        return True

    def _pick(self, reqs: Sequence[Request], logits: torch.Tensor, rows: Sequence[bool] | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One draft token per request from the drafter's logits [N, V], on the device: the argmax
        for a greedy request (q one-hot: None), else a draw from softmax(logits / temperature),
        with that q. `rows[j]` False: request j takes no draw (its row is not used; its generator
        is not advanced)."""
        greedy = [r.params.greedy for r in reqs]
        tokens = logits.argmax(dim=-1) if any(greedy) else logits.new_zeros(len(reqs), dtype=torch.int64)
        qs: list[torch.Tensor | None] = [None] * len(reqs)
        for j, req in enumerate(reqs):
            if greedy[j] or (rows is not None and not rows[j]):
                continue
            q = torch.softmax(logits[j].float() / req.params.temperature, dim=-1)
            tokens[j : j + 1].copy_(torch.multinomial(q, 1, generator=self.generator_for(req)))
            qs[j] = q
        return tokens, qs
