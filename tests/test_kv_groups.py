"""Cache groups of several kinds (sliding window, compressed, indexer keys, state slots) on the
paged pool, on plain Python state: the KV manager's growth, freeing, rollback and prefix rules."""

import pytest
import torch

from tandem.core import Request, SamplingParams
from tandem.kv.groups import (
    entry_slots,
    group_blocks,
    kv_bytes_per_token,
    kv_cache_bytes,
    state_rows,
    token_slots,
)
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import KVCacheSpec, group_layers, prefix_unit

BS = 4
F32 = torch.float32
SLIDE = KVCacheSpec("sliding_window", 1, 8, F32, window=6, k_is_v=True)
CSA = KVCacheSpec("compressed", 1, 8, F32, ratio=2, index_head_dim=4, overlap=True)
HCA = KVCacheSpec("compressed", 1, 8, F32, ratio=4)
FULL = KVCacheSpec("full", 2, 8, F32)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def step(kv: KVCacheManager, r: Request, n: int) -> None:
    """Schedule n tokens of r, 'run' them and commit, as the scheduler does."""
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    kv.commit(r)


def v4_layers() -> list:
    """Layer 0 sliding only, 1 CSA, 2 HCA (each compressed layer also has its sliding window)."""
    return [SLIDE, (SLIDE, CSA), (SLIDE, HCA)]


def v4_manager(blocks=(32, 32, 32), caching=True, slots=4) -> KVCacheManager:
    return KVCacheManager(group_layers(v4_layers()), blocks, BS, caching, num_state_slots=slots)


def test_specs_geometry_bytes_and_state():
    groups = group_layers(v4_layers())
    assert [g.spec for g in groups] == [SLIDE, CSA, HCA]
    assert [g.layer_indices for g in groups] == [(0, 1, 2), (1,), (2,)]
    assert SLIDE.bytes_per_token() == 8 * 4  # K=V: one vector
    assert FULL.bytes_per_token() == 2 * 2 * 8 * 4
    assert CSA.bytes_per_token() == (8 + 4) * 4 / 2 and HCA.bytes_per_token() == 8 * 4 / 4
    assert CSA.tokens_per_block(BS) == 8 and HCA.tokens_per_block(BS) == 16
    assert [HCA.blocks_for(t, BS) for t in (0, 3, 4, 16, 17, 19, 20)] == [0, 0, 1, 1, 1, 1, 2]
    assert groups[1].bytes_per_block(BS) == BS * (8 + 4) * 4
    # State ring: CSA keeps 3 windows of kv|gate at 2D (Ca|Cb), the indexer too; HCA 2 windows at D.
    assert CSA.state_shapes() == {"compressor": (6, 32), "indexer": (6, 16)}
    assert HCA.state_shapes() == {"compressor": (8, 16)} and HCA.snapshot_shapes() == {}
    assert CSA.snapshot_shapes() == {"compressor": (2, 32), "indexer": (2, 16)}
    assert groups[1].state_bytes() == (6 * 32 + 6 * 16) * 4
    assert prefix_unit(groups, BS) == 16 and prefix_unit(group_layers([FULL]), BS) == BS
    with pytest.raises(ValueError, match="window"):
        KVCacheSpec("sliding_window", 1, 8, F32)
    with pytest.raises(ValueError, match="compressed"):
        KVCacheSpec("full", 1, 8, F32, ratio=4)


def test_compressed_groups_need_state_slots():
    with pytest.raises(ValueError, match="num_state_slots"):
        KVCacheManager(group_layers(v4_layers()), 8, BS)


def test_sliding_window_gives_back_blocks_behind_the_window():
    kv = KVCacheManager(group_layers([SLIDE]), 8, BS)
    r = req("a", list(range(40)))
    step(kv, r, 8)  # tokens 0..7: blocks 0, 1
    assert kv.num_free_blocks == 6
    step(kv, r, 4)  # queries 8..11 see keys from 3: block 0 still read
    assert kv.num_free_blocks == 5 and kv.block_ids("a")[0] != kv.null_block()
    block0 = kv.pools[0].blocks[kv.block_ids("a")[0]]
    assert kv.allocate_slots(r, 1)  # query 12 sees keys 7..12: block 0 (tokens 0..3) goes back
    ids = kv.block_ids("a")
    assert ids[0] == kv.null_block() == 8 and len(ids) == 4
    assert block0.ref_cnt == 0 and block0.block_id in kv.pools[0].free_queue
    assert kv.num_free_blocks == 5  # one given back, one taken for token 12
    r.num_computed_tokens += 1
    peak = 0
    for _ in range(27):  # decode to 40 tokens: never more than ceil((W-1+1)/bs)+1 live blocks
        step(kv, r, 1)
        live = [b for b in kv.block_ids("a") if b != kv.null_block()]
        peak = max(peak, len(live))
        assert min(kv.block_ids("a").index(b) for b in live) == (r.num_computed_tokens - 1 - 5) // BS
    assert peak <= SLIDE.max_blocks_held(40, BS) == 3
    assert kv.usage == 2 / 8  # keys 34..39 sit in blocks 8, 9; a full group would hold 10 blocks
    assert len(kv.block_ids("a")) == 10  # positional: placeholders keep indices = position // bs
    kv.free(r)
    assert kv.num_free_blocks == 8


def test_token_slots_of_a_sliding_table_use_only_live_blocks():
    kv = KVCacheManager(group_layers([SLIDE]), 8, BS)
    r = req("a", list(range(30)))
    step(kv, r, 20)
    assert kv.allocate_slots(r, 2)  # queries 20, 21 see keys from 15
    ids = kv.block_ids("a")
    live_from = SLIDE.first_needed_block(20, BS)
    assert live_from == 3 and all(b == kv.null_block() for b in ids[:3]) and kv.null_block() not in ids[3:]
    assert token_slots(ids, BS, 20, 22) == [ids[5] * BS, ids[5] * BS + 1]
    assert all(s // BS != kv.null_block() for s in token_slots(ids, BS, 15, 22))  # every key it reads is live


def test_compressed_group_grows_one_block_per_block_size_times_ratio():
    kv = KVCacheManager(group_layers([HCA]), 8, BS, num_state_slots=2)
    r = req("a", list(range(70)))
    lengths = []
    for _ in range(70):
        step(kv, r, 1)
        lengths.append(len(kv.block_ids("a")))
    # Entry n exists once token 4n+3 is computed; a block of 4 entries covers 16 tokens and is
    # taken when its first entry is written (token 16j+3).
    assert [t for t in range(1, 70) if lengths[t] != lengths[t - 1]] == [3, 19, 35, 51, 67]
    assert lengths[2] == 0 and lengths[3] == 1 and lengths[-1] == 5  # 70 tokens: 17 entries
    assert kv.num_free_blocks == 3


def test_entry_slots_and_state_rows():
    ids = [5, 2]
    # ratio 2, block of 4 entries: tokens 5..9 close windows 2 (token 5), 3 (token 7), 4 (token 9).
    assert entry_slots(ids, BS, 2, 5, 10) == [5 * BS + 2, -1, 5 * BS + 3, -1, 2 * BS + 0]
    assert state_rows(HCA, 5, 7) == [5, 6]  # ring of 2 windows of 4 rows
    # A long chunk writes only the rows of its last state_ring windows: tokens 8..13 for CSA.
    assert state_rows(CSA, 0, 14) == [2, 3, 4, 5, 0, 1]


def test_state_slots_are_taken_with_the_request_and_given_back():
    kv = v4_manager(slots=2)
    a, b, c = req("a", [1] * 5), req("b", [2] * 5), req("c", [3] * 5)
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    slots = {kv.state_slot("a", 1), kv.state_slot("b", 1)}
    assert slots == {0, 1} and kv.state_slot("a", 2) in (0, 1)
    assert kv.state_slot("a", 0) == kv.num_state_slots == 2  # the sliding group has none: sink
    free = kv.num_free_blocks
    assert not kv.allocate_slots(c, 5)  # no slot left: nothing changes
    assert kv.num_free_blocks == free and kv.block_ids("c") == []
    kv.free(a)
    assert kv.allocate_slots(c, 5) and kv.state_slot("c", 1) == kv.state_slot("c", 2) in slots
    a.num_computed_tokens = 0
    assert kv.state_slot("a", 1) == 2


def test_trim_within_a_block_and_across_a_window_boundary():
    kv = KVCacheManager(group_layers([SLIDE, CSA]), 16, BS, num_state_slots=2)
    r = req("a", list(range(40)))
    step(kv, r, 17)
    csa = 1
    assert len(kv.block_ids("a", csa)) == 2  # 8 entries, 4 a block
    assert kv.allocate_slots(r, 2)  # verify 17, 18: token 17 closes window 8, entry 8 opens block 2
    assert len(kv.block_ids("a", csa)) == 3 and len(kv.block_ids("a", 0)) == 5
    kv.trim(r, 18)  # within window 9 and within the sliding block: nothing is given back
    assert len(kv.block_ids("a", csa)) == 3 and len(kv.block_ids("a", 0)) == 5
    kv.trim(r, 17)  # back across one window boundary (8 -> 9): the ring still holds windows 7, 8
    assert len(kv.block_ids("a", csa)) == 2 and len(kv.block_ids("a", 0)) == 5 and kv.req_end["a"] == 17
    assert kv.allocate_slots(r, 5)  # tokens 17..21 end in window 10: two boundaries from window 8
    free = kv.num_free_blocks
    with pytest.raises(RuntimeError, match="crosses 2 windows"):
        kv.trim(r, 17)
    assert kv.num_free_blocks == free and len(kv.block_ids("a", csa)) == 3  # refused: nothing changed
    kv.trim(r, 19)
    assert len(kv.block_ids("a", csa)) == 3 and len(kv.block_ids("a", 0)) == 5
    kv.trim(r, 18)
    kv.trim(r, 17)
    assert len(kv.block_ids("a", csa)) == 2 and kv.num_free_blocks == free + 2


def test_trim_into_a_given_back_window_is_refused():
    kv = KVCacheManager(group_layers([KVCacheSpec("sliding_window", 1, 8, F32, window=2)]), 8, BS)
    r = req("a", list(range(20)))
    step(kv, r, 12)
    assert kv.allocate_slots(r, 1)  # query 12 sees 11, 12: blocks 0, 1 go back
    r.num_computed_tokens = 13
    with pytest.raises(RuntimeError, match="given back"):
        kv.trim(r, 5)


def test_prefix_hit_is_the_longest_every_group_reuses_exactly():
    kv = v4_manager()
    prompt = list(range(100, 140))
    a = req("a", prompt)
    step(kv, a, 24)
    step(kv, a, 16)  # 40 tokens: unit 16 -> boundaries 16, 32 are reusable
    assert len(kv.snapshot_ids("a", 1)) == 2 and kv.snapshot_ids("a", 0) == []
    b = req("b", prompt[:36] + [7, 8, 9, 10])
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 32  # full blocks cover 36, but 32 is the last unit boundary
    assert kv.allocate_slots(b, b.num_tokens - 32, hit)
    sl, csa, hca = 0, 1, 2
    first = SLIDE.first_needed_block(32, BS)  # keys from 27: block 6
    assert kv.block_ids("b", sl)[:first] == [kv.null_block(sl)] * first
    assert kv.block_ids("b", sl)[first:8] == kv.block_ids("a", sl)[first:8]
    assert kv.block_ids("b", csa)[:2] == kv.block_ids("a", csa)[:2]  # 16 entries of 32 tokens
    assert kv.block_ids("b", hca)[:2] == kv.block_ids("a", hca)[:2]  # 8 entries
    assert kv.block_ids("b", hca)[2] != kv.block_ids("a", hca)[2]  # entries 8, 9: b's own block
    assert kv.snapshot_to_restore("b", csa, 32) == kv.snapshot_ids("a", csa)[1]
    assert kv.snapshot_to_restore("b", hca, 32) is None and kv.snapshot_to_restore("b", csa, 33) is None
    # A prompt sharing 30 tokens: full and sliding blocks reach 28, but only 16 is a unit boundary.
    assert kv.find_prefix(req("c", prompt[:30] + [1, 2])).num_tokens == 16
    assert kv.find_prefix(req("d", prompt[:15] + [1, 2])).num_tokens == 0


def test_a_group_that_lost_its_blocks_limits_the_hit():
    kv = v4_manager(blocks=(12, 32, 32))
    prompt = list(range(100, 140))
    a = req("a", prompt)
    step(kv, a, 40)
    kv.free(a)
    assert kv.find_prefix(req("b", prompt + [1])).num_tokens == 32
    c = req("c", list(range(500, 548)))  # unrelated: its 12 sliding blocks evict a's cached ones
    assert kv.allocate_slots(c, 48)
    hit = kv.find_prefix(req("b2", prompt + [1]))
    assert hit.num_tokens == 0
    assert kv.pools[2].lookup(kv._hash_at(kv.req_hashes["b2"], 16)) is not None  # HCA still cached


def test_sliding_blocks_given_back_stay_reusable_for_the_window_they_hold():
    kv = KVCacheManager(group_layers([SLIDE]), 16, BS)
    prompt = list(range(50, 90))
    a = req("a", prompt)
    for _ in range(10):
        step(kv, a, 4)
    assert kv.block_ids("a")[0] == kv.null_block()  # given back, still cached (same position, same prefix)
    hit = kv.find_prefix(req("b", prompt[:13] + [0]))
    assert hit.num_tokens == 12 and hit.blocks[0][0] is None  # keys from 7: block 0 not needed
    assert hit.blocks[0][1] is not None and hit.blocks[0][1].ref_cnt == 0  # revived from the free queue


def test_prefix_caching_off_allocates_no_snapshots():
    kv = v4_manager(caching=False)
    a = req("a", list(range(40)))
    step(kv, a, 40)
    assert kv.snapshot_ids("a", 1) == [] and kv.find_prefix(req("b", list(range(40)))).num_tokens == 0


def test_budget_per_group_and_for_a_long_context():
    groups = group_layers(v4_layers())
    n = 1000
    blocks = group_blocks(groups, BS, n, max_num_seqs=2)
    # Sliding: per request ceil((W-1+1)/bs)+1 = 3 live blocks; CSA: 500 entries -> 125 (+2); HCA 250 -> 63 (+2).
    assert blocks == (2 * 3, 125 + 2, 63 + 2)
    got = kv_cache_bytes(groups, BS, n, max_num_seqs=2)
    assert got[0] == 6 * 3 * BS * 8 * 4
    assert got[1] == 127 * BS * 12 * 4 + 2 * groups[1].state_bytes() + (1000 // 16 + 2) * groups[1].snapshot_bytes()
    assert got[2] == 65 * BS * 8 * 4 + 2 * groups[2].state_bytes()
    assert kv_bytes_per_token(groups) == 12 * 4 / 2 + 8 * 4 / 4
    # Qwen3-like: one full group, exactly blocks * bytes per block.
    full = group_layers([FULL] * 3)
    assert kv_cache_bytes(full, BS, n) == [(250 + 1) * full[0].bytes_per_block(BS)]


def test_v4_flash_shape_at_one_million_tokens_in_bf16():
    """V4-Flash's shape (head_dim 512, index_head_dim 128, window 128, CSA 4, HCA 128): the long-context
    cost is the compressed entries; the bound of the sliding windows does not grow."""
    bf16 = torch.bfloat16
    slide = KVCacheSpec("sliding_window", 1, 512, bf16, window=128, k_is_v=True)
    csa = KVCacheSpec("compressed", 1, 512, bf16, ratio=4, index_head_dim=128, overlap=True)
    hca = KVCacheSpec("compressed", 1, 512, bf16, ratio=128)
    layers = [slide, slide] + [(slide, csa) if i % 2 else (slide, hca) for i in range(41)]
    groups = group_layers(layers)
    per_token = kv_bytes_per_token(groups)
    assert per_token == 20 * (640 * 2 / 4) + 21 * (512 * 2 / 128)
    total = sum(kv_cache_bytes(groups, 16, 1 << 20))
    # Above it: per-request state and rounding, and the CSA overlap snapshots (20 KiB per layer per 2048 tokens).
    assert per_token * (1 << 20) < total < per_token * (1 << 20) * 1.05
