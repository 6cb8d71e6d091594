"""Scheduler logic without a model: steps are simulated by appending a fake token."""

import pytest
import torch

from tandem.config import SchedulerConfig
from tandem.core import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import KVCacheSpec, group_layers

BS = 4


def make(num_blocks: int, max_seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    groups = group_layers([KVCacheSpec("full", 1, 4, torch.float32)])
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                     KVCacheManager(groups, num_blocks, BS, caching))


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(), max_tokens=100)


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    samplers = [x.request for x in out.scheduled if x.samples]
    s.update_after_step(out)
    for r in samplers:
        r.output_token_ids.append(1000 + r.num_output_tokens)
    return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {x.request.request_id: x.num_tokens for x in out.scheduled}


def test_chunked_prefill_keeps_decodes_running():
    s = make(64, budget=8)
    s.add(req("a", 3))
    assert plan(run_step(s)) == {"a": 3}
    s.add(req("long", 20, start=100))
    # Each step: a's decode (1 token) goes first, the long prompt fills the rest of the budget.
    assert plan(run_step(s)) == {"a": 1, "long": 7}
    assert plan(run_step(s)) == {"a": 1, "long": 7}
    out = run_step(s)
    assert plan(out) == {"a": 1, "long": 6}
    assert [x.samples for x in out.scheduled] == [True, True]  # long's prefill is complete
    assert plan(run_step(s)) == {"a": 1, "long": 1}


def test_max_num_seqs_limits_the_running_batch():
    s = make(64, max_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 2, start=10 * i))
    assert set(plan(run_step(s))) == {"r0", "r1"}
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_frees_newest_and_recomputes_it():
    s = make(5, budget=64, caching=False)  # 20 token slots; no prefix cache: full recompute
    a, b = req("a", 8), req("b", 8, start=50)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 + 2 blocks, 1 free
    for _ in range(4):  # a: 9..12 tokens, b: 9..12 -> both need a third block at token 9
        out = run_step(s)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.waiting[0] is b
    kept_outputs = list(b.output_token_ids)
    # Run a to completion; b comes back and recomputes prompt + its outputs in one prefill.
    s.finish(a, "stop")
    out = run_step(s)
    assert plan(out) == {"b": 8 + len(kept_outputs)}
    assert b.output_token_ids[: len(kept_outputs)] == kept_outputs
    assert b.num_cached_prompt_tokens == 0


def test_prefix_cache_hit_skips_cached_tokens():
    s = make(32)
    a = req("a", 10)
    s.add(a)
    run_step(s)
    b = req("b", 10)  # same prompt
    s.add(b)
    out = run_step(s)
    assert plan(out)["b"] == 2 and b.num_cached_prompt_tokens == 8
    assert s.kv.block_ids("b")[:2] == s.kv.block_ids("a")[:2]


def test_abort_frees_everything():
    s = make(16)
    a, b = req("a", 10), req("b", 30, start=40)
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert not s.has_work and s.kv.num_free_blocks == 16 and not s.kv.req_blocks
    assert a.finish_reason == "abort" and a.status == RequestStatus.FINISHED


def test_prompt_larger_than_cache_is_rejected_not_deadlocked():
    s = make(4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(req("huge", 16))  # 16 tokens + 1 generated needs 5 blocks
    assert not s.has_work


def test_sequence_outgrowing_the_whole_cache_is_rejected():
    s = make(3)
    r = req("a", 10)
    s.add(r)
    rejected = []
    for _ in range(10):
        out = run_step(s)
        rejected += out.rejected
        if rejected:
            break
    assert rejected == [r]
    assert r.finish_reason == "error" and r.request_id not in s.requests
    assert not s.has_work and s.kv.num_free_blocks == 3
    s.finish(r, "abort")  # finishing again is a no-op
    assert r.finish_reason == "error"


def test_waiting_requests_wait_for_blocks_without_failing():
    s = make(6)
    s.add(req("a", 16))
    s.add(req("b", 16, start=100))  # cannot fit next to a: waits
    out = run_step(s)
    assert plan(out) == {"a": 16} and not out.rejected
    s.finish(s.requests["a"], "stop")
    assert plan(run_step(s)) == {"b": 16}


def test_draft_tokens_are_scheduled_cut_to_the_budget_and_rolled_back():
    s = make(16, budget=4)
    a = req("a", 6)
    s.add(a)
    run_step(s)
    run_step(s)  # 6 prompt tokens in two chunks (blocks 0, 1); a's 7th token is sampled
    assert a.num_tokens == 7 and a.num_computed_tokens == 6
    out = s.schedule({"a": [90, 91, 92, 93, 94]})
    [x] = out.scheduled
    assert x.draft == (90, 91, 92) and x.num_tokens == 4 and x.samples and x.num_logits == 4  # budget 4
    assert len(s.kv.block_ids("a")) == 3  # tokens 6..9: positions up to 9 need a third block
    # One draft token accepted: positions 6 (a's last token) and 7 keep their K/V; 8, 9 go back.
    s.update_after_step(out, {"a": 1})
    assert a.num_computed_tokens == 8 and len(s.kv.block_ids("a")) == 2
    assert s.kv.num_free_blocks == 14
    # Only blocks whose tokens are all in the request (accepted) are cached: block 1 holds
    # tokens 4..7 but token 7 (the accepted draft) is not appended yet, so it is not hashed.
    pool = s.kv.pools[0]
    assert [b.block_hash is not None for b in pool.blocks[:2]] == [True, False]
    a.output_token_ids += [90, 1234]  # the engine appends the accepted draft and the target's token
    out = s.schedule()
    assert [x.num_tokens for x in out.scheduled] == [1] and not out.scheduled[0].draft  # the target's token
    s.update_after_step(out)
    assert a.num_computed_tokens == 9 and pool.blocks[1].block_hash is not None
    s.finish(a, "stop")
    assert s.kv.num_free_blocks == 16


def test_a_draft_that_does_not_fit_is_dropped_not_preempting():
    s = make(2, budget=64)  # 8 token slots
    a = req("a", 7)
    s.add(a)
    run_step(s)
    out = s.schedule({"a": [1, 2, 3]})  # tokens 7..10 would need a third block
    assert [(x.num_tokens, x.draft) for x in out.scheduled] == [(1, ())] and not out.preempted
