"""Block pool and KV cache manager, on plain Python state (no model)."""

import pytest
import torch

from tandem.core import Request, SamplingParams
from tandem.kv.block_pool import BlockPool
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import KVCacheSpec, group_layers

BS = 4


def make_manager(num_blocks: int, caching: bool = True) -> KVCacheManager:
    groups = group_layers([KVCacheSpec("full", 2, 8, torch.float32)] * 3)
    return KVCacheManager(groups, num_blocks, BS, caching)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def test_layers_with_one_spec_form_one_group():
    groups = group_layers([KVCacheSpec("full", 2, 8, torch.float32)] * 3)
    assert len(groups) == 1 and groups[0].layer_indices == (0, 1, 2)
    assert groups[0].bytes_per_block(BS) == 3 * BS * 2 * 2 * 8 * 4


def test_unknown_cache_kind_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        KVCacheSpec("paged_lru", 2, 8, torch.float32)


def test_pool_ref_counts_and_lru_eviction_order():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    assert pool.num_free == 2
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.num_free == 4 and pool.lookup(b"ha") is a
    new = pool.allocate(3)  # two never-used blocks, then the LRU cached one (b)
    assert b in new and a not in new
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") is a
    pool.touch([a])  # revive a from the free queue
    assert a.ref_cnt == 1 and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def computed(kv: KVCacheManager, r: Request, n: int) -> None:
    """What the scheduler does once a step's forward pass wrote the K/V of r's first n tokens."""
    r.num_computed_tokens = n
    kv.commit(r)


def test_allocation_and_free_round_trip():
    kv = make_manager(8)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 5
    r.num_computed_tokens = 10
    r.output_token_ids.append(99)
    assert kv.allocate_slots(r, 1)  # token 11 fits in block 3
    assert len(kv.block_ids("a")) == 3
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []


def test_allocation_fails_without_side_effects():
    kv = make_manager(2)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = make_manager(16)
    a = req("a", list(range(13)))
    assert kv.allocate_slots(a, 13)
    assert kv.find_prefix(req("x", list(range(13)))).num_tokens == 0  # K/V not written yet: not cached
    computed(kv, a, 13)
    b = req("b", list(range(12)) + [77, 78])
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 12  # three full blocks shared
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]
    assert kv.block_ids("b")[3] != kv.block_ids("a")[3]
    # An identical, block-aligned prompt still computes its last block (logits are needed).
    c = req("c", list(range(12)))
    assert kv.find_prefix(c).num_tokens == 8
    assert kv.prefix_queries == 13 + 14 + 12 and kv.prefix_hits == 12 + 8


def test_freed_cached_blocks_are_revived_then_evicted_when_needed():
    kv = make_manager(4)
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    computed(kv, a, 9)
    kv.free(a)
    b = req("b", list(range(9)))
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 1, hit)
    kv.free(b)
    # A different request needing every block evicts the cached prefix.
    c = req("c", [500 + i for i in range(16)])
    assert kv.allocate_slots(c, 16)
    assert kv.find_prefix(req("d", list(range(9)))).num_tokens == 0


def test_caching_disabled_never_hits():
    kv = make_manager(8, caching=False)
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    computed(kv, a, 9)
    assert kv.find_prefix(req("b", list(range(9)))).num_tokens == 0


def test_one_full_group_keeps_its_geometry():
    kv = make_manager(8)
    assert kv.unit == BS and kv.num_blocks == 8 and kv.null_block() == 8
    assert kv.state_pools == [None] and kv.snapshot_pools == [None]
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [0, 1, 2] and kv.blocks_needed(10) == 3
