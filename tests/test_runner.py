"""Runner input packing and CUDA-graph keys, on CPU (graph capture itself is in test_gpu.py)."""

import torch

from tandem.core import Request, SamplingParams
from tandem.engine.runner import ModelRunner, batch_buckets
from tandem.engine.scheduler import ScheduledRequest
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import KVCacheSpec, group_layers


def test_batch_buckets_cover_every_batch_size():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    for n in range(1, 41):
        assert any(b >= n for b in batch_buckets(40))


def make_runner() -> tuple[ModelRunner, KVCacheManager]:
    kv = KVCacheManager(group_layers([KVCacheSpec("full", 1, 4, torch.float32)]), 16, 4, False)
    return ModelRunner(model=None, kv=kv, device=torch.device("cpu")), kv  # type: ignore[arg-type]


def test_build_step_packs_decode_and_prefill_chunks():
    runner, kv = make_runner()
    a = Request("a", list(range(10, 16)), SamplingParams())  # 6 tokens, decoding its 7th
    a.output_token_ids = [99]
    a.num_computed_tokens = 6
    b = Request("b", list(range(50, 61)), SamplingParams())  # 11-token prompt, chunk 4..10
    b.num_computed_tokens = 4
    assert kv.allocate_slots(b, 7) and kv.allocate_slots(a, 1)
    batch = [ScheduledRequest.of(a, 1), ScheduledRequest.of(b, 7)]
    ids, pos, step = runner.build_step(batch)
    assert ids.tolist() == [99] + list(range(54, 61))
    assert pos.tolist() == [6] + list(range(4, 11))
    assert step.query_start_loc_cpu == (0, 1, 8) and step.seq_lens_cpu == (7, 11) and step.max_query_len == 7
    a_blocks, b_blocks = kv.block_ids("a"), kv.block_ids("b")
    slots = step.slot_mappings[0].tolist()
    assert slots[0] == a_blocks[1] * 4 + 2  # position 6 -> second block, offset 2
    assert slots[1:] == [b_blocks[p // 4] * 4 + p % 4 for p in range(4, 11)]
    assert step.block_tables[0][1, :3].tolist() == b_blocks
    assert step.logits_indices.tolist() == [0, 7]  # both reach their last known token


def test_only_uniform_sampling_steps_use_graphs():
    runner, kv = make_runner()
    runner.buckets = (1, 2, 4)
    runner.graphs = {(b, q): None for b in runner.buckets for q in (1, 2)}  # type: ignore[misc]
    reqs = []
    for i in range(3):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams())
        r.output_token_ids = [4]
        r.num_computed_tokens = 3
        reqs.append(r)
    decode = [ScheduledRequest.of(r, 1) for r in reqs]
    assert runner._graph_key(decode) == (4, 1)  # padded to the next bucket
    assert runner._graph_key(decode[:1]) == (1, 1)
    prefill = Request("p", list(range(9)), SamplingParams())
    assert runner._graph_key(decode + [ScheduledRequest.of(prefill, 9)]) is None
    chunk = Request("c", list(range(20)), SamplingParams())
    assert runner._graph_key([ScheduledRequest.of(chunk, 1)]) is None  # a 1-token prefill chunk samples nothing
