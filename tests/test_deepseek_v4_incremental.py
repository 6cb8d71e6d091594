"""DeepSeek-V4's incremental forward (`forward_step` on a `DeepseekV4State`, deepseek_v4_state.py)
against its own cache-free `forward_full` (itself exact against transformers in test_deepseek_v4.py),
fp32 on CPU, on the same tiny configs: chunked prefill not aligned to the ratios or the window,
token-by-token decode, speculative steps with rollback across window closes, packed requests."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")
from test_deepseek_v4 import CASES, TOL, VOCAB, _models

from tandem.models.deepseek_v4 import DeepseekV4ForCausalLM
from tandem.models.deepseek_v4_attention import Indexer
from tandem.models.deepseek_v4_state import DeepseekV4State, rollback


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, DeepseekV4ForCausalLM, int]:
    _hf, ours, length = _models(request.param)
    return request.param, ours, length


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _ratios(model: DeepseekV4ForCausalLM) -> set[int]:
    return {model.args.compress_rates[k] for k in model.args.layer_types if k in model.args.compress_rates}


def _feed(model: DeepseekV4ForCausalLM, state: DeepseekV4State, ids: torch.Tensor, chunks: list[int]
          ) -> tuple[torch.Tensor, DeepseekV4State]:
    """Feed `ids` in chunks of the given sizes (cycled) -> (logits [len(ids), V], state)."""
    out, pos, i = [], 0, 0
    while pos < len(ids):
        n = min(chunks[i % len(chunks)], len(ids) - pos)
        (logits,), (state,) = model.forward_step([ids[pos: pos + n]], [state])
        out.append(logits)
        pos, i = pos + n, i + 1
    return torch.cat(out), state


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{what}: max |incremental - full| = {diff:.3g} > {TOL}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{what}: argmax differs (max abs diff {diff:.3g})"
    return diff


def _assert_bounded(model: DeepseekV4ForCausalLM, state: DeepseekV4State) -> None:
    """Window rows stay within W - 1 + R, compressor rows within (1 or 2) m - 1 + R: fixed-size per request."""
    R, W = state.max_rollback, model.args.sliding_window
    for layer in state.layers:
        assert layer.window.rows.shape[0] <= W - 1 + R
        for c in (layer.compressor, layer.indexer):
            if c is not None:
                assert c.kv.rows.shape[0] <= (1 + c.overlap) * c.ratio - 1 + R
                assert c.entries.shape[0] == state.length // c.ratio


@torch.no_grad()
def test_chunked_prefill_then_decode(case) -> None:
    name, model, length = case
    ids = _tokens(length + 12, seed=3)
    ref = model.forward_full(ids[None])[0]  # [T, V]
    prefill, state = _feed(model, model.new_state(), ids[:length], [3, 5, 7])
    _assert_bounded(model, state)
    decode, state = _feed(model, state, ids[length:], [1])
    _assert_bounded(model, state)
    assert state.length == len(ids)
    _assert_matches(torch.cat((prefill, decode)), ref, f"{name}: prefill in 3/5/7 chunks + 12 decode tokens")


@torch.no_grad()
def test_speculative_steps_with_rollback(case) -> None:
    """Rounds of: a step of 4 draft tokens, keep `accepted` of them (rollback 4 - accepted), then one
    corrected token. Every kept logit equals the full forward of the kept sequence, and the
    rollbacks undo window closes of every ratio in the model."""
    name, model, length = case
    top = max(_ratios(model))
    prompt = _tokens(length // top * top - 2, seed=4)  # the first step closes a window of every ratio
    logits, state = _feed(model, model.new_state(max_rollback=4), prompt, [5, 7])
    kept, kept_logits, undone = [prompt], [logits], set()
    g = torch.Generator().manual_seed(5)
    for accepted in (1, 0, 3, 2, 2, 0, 1, 3, 2, 2, 0, 1):
        draft, fix = torch.randint(0, VOCAB, (4,), generator=g), torch.randint(0, VOCAB, (1,), generator=g)
        (logits,), (state,) = model.forward_step([draft], [state])
        undone |= {m for m in _ratios(model) if (state.length - 4 + accepted) // m != state.length // m}
        state = rollback(state, 4 - accepted)
        (fixed,), (state,) = model.forward_step([fix], [state])
        kept += [draft[:accepted], fix]
        kept_logits += [logits[:accepted], fixed]
        _assert_bounded(model, state)
    ids = torch.cat(kept)
    assert state.length == len(ids)
    assert undone == _ratios(model), f"rollbacks undid closes of ratios {undone}, not all of {_ratios(model)}"
    _assert_matches(torch.cat(kept_logits), model.forward_full(ids[None])[0],
                    f"{name}: 12 rounds of a 4-token step, rollback, corrected token")


@torch.no_grad()
def test_rollback_beyond_max_rollback_is_refused(case) -> None:
    _name, model, length = case
    _, state = _feed(model, model.new_state(max_rollback=2), _tokens(length, seed=6), [7])
    state_after = rollback(state, 2)  # within max_rollback: fine
    assert state_after.length == length - 2 and state.length == length  # the old state is untouched
    with pytest.raises(ValueError, match="max_rollback=2"):
        rollback(state_after, 3)  # 5 tokens back in all, since the last step
    with pytest.raises(ValueError, match="cannot roll back"):
        rollback(state, length + 1)


@torch.no_grad()
def test_packed_requests_with_separate_states(case) -> None:
    """Two requests of different lengths in one forward_step call per step, each on its own state,
    with different chunk sizes; each equals its own full forward."""
    name, model, length = case
    seqs = [_tokens(length + 6, seed=7), _tokens(length // 2 + 3, seed=8)]
    chunks = [[6, 1, 4], [3, 8, 1]]
    states = [model.new_state(), model.new_state()]
    got, pos, i = [[], []], [0, 0], 0
    while any(p < len(s) for p, s in zip(pos, seqs)):
        live = [r for r in range(2) if pos[r] < len(seqs[r])]
        step = {r: min(chunks[r][i % 3], len(seqs[r]) - pos[r]) for r in live}
        logits, new = model.forward_step([seqs[r][pos[r]: pos[r] + step[r]] for r in live], [states[r] for r in live])
        for r, lg, st in zip(live, logits, new):
            got[r].append(lg)
            states[r], pos[r] = st, pos[r] + step[r]
        i += 1
    for r, seq in enumerate(seqs):
        _assert_matches(torch.cat(got[r]), model.forward_full(seq[None])[0],
                        f"{name}: packed request {r} ({len(seq)} tokens)")


def test_indexer_ties_go_to_the_lower_entry() -> None:
    """Equal index scores (exactly 0 when every head's relu is 0) pick the lower entry, whatever
    the number of entries: what lets a step with N entries pick as a full forward with more."""
    _, model, _ = _models("all_kinds")
    indexer: Indexer = model.model.layers[1].self_attn.compressor.indexer
    with torch.no_grad():
        indexer.scorer.weights_proj.weight.zero_()  # every score 0: all tie
    hidden, q_latent = torch.randn(1, 1, 48), torch.randn(1, 1, 32)
    rotary = model.model.rotary_emb["compress"]
    for n in (6, 9, 30):  # the query at position 23 has closed 6 entries
        visible = indexer.pick(torch.randn(1, n, indexer.head_dim), hidden, q_latent, torch.tensor([23]), rotary)
        assert visible[0, 0].nonzero().flatten().tolist() == list(range(indexer.topk))
