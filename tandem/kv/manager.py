"""KV cache manager: which blocks each request holds, per cache group, and prefix-cache lookups.

This is the only owner of block tables. The scheduler asks it for slots; the runner reads
`block_ids(request_id, group)` to build the step's block tables and slot mappings, and for
compressed groups `state_slot`, `snapshot_ids` and `snapshot_to_restore` (see `tandem/kv/groups.py`
for the position -> slot arithmetic of each kind).

Each group has its own pool (its own page size). Tables are positional: entry j is block j of the
group's geometry (`KVCacheSpec.tokens_per_block`); a sliding group's blocks that fell behind the
window are given back and read as the group's null block (`null_block(g)`, the runner's sink).

Prefix caching reuses a prefix of L tokens only when every group can reuse it exactly: L is a
multiple of `unit` (every group's blocks and every compressed window end there, so no partial
window is carried), full and compressed groups have all their blocks before L cached, a sliding
group has the blocks of L's window cached (older ones need not exist), and an overlapping (CSA)
group has the snapshot of its overlap at L. One full group: unit = block size, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.core import Request
from tandem.kv.block_pool import Block, BlockPool, SlotPool
from tandem.kv.spec import CacheGroup, prefix_unit

Table = list[Block | None]  # positional; None: a block given back (behind a sliding window) or not held


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Chained block hash: a block's identity is its tokens *and* everything before them."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class PrefixHit:
    """Blocks found in the prefix cache for a request, per group (positional tables, None where a
    sliding group needs nothing), and the tokens they cover; per group, the overlap snapshot at
    `num_tokens` for CSA groups (None for the others)."""

    blocks: list[Table]
    num_tokens: int
    snapshots: list[Block | None] = field(default_factory=list)


def _live(table: Table) -> list[Block]:
    return [b for b in table if b is not None]


class KVCacheManager:
    def __init__(
        self,
        groups: tuple[CacheGroup, ...],
        num_blocks: int | Sequence[int],
        block_size: int,
        enable_prefix_caching: bool = True,
        min_compute: int = 1,
        num_state_slots: int | None = None,
    ) -> None:
        """num_blocks: per group (one int: the same for every group). min_compute: prompt tokens a
        prefix hit leaves to compute (at least 1: the last token's logits are needed; a drafter that
        reads the target's hidden states of the last W positions needs W). num_state_slots: requests
        that can hold state at once (max_num_seqs); required when a group is compressed."""
        if not groups:
            raise ValueError("a model needs at least one KV cache group")
        sizes = (num_blocks,) * len(groups) if isinstance(num_blocks, int) else tuple(num_blocks)
        if len(sizes) != len(groups):
            raise ValueError(f"num_blocks has {len(sizes)} entries for {len(groups)} cache groups")
        stateful = any(g.spec.has_state for g in groups)
        if stateful and not num_state_slots:
            raise ValueError("compressed cache groups need num_state_slots (pass max_num_seqs)")
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.min_compute = max(1, min_compute)
        self.unit = prefix_unit(groups, block_size)
        self.pools = [BlockPool(n, enable_prefix_caching) for n in sizes]
        self.num_state_slots = num_state_slots or 0
        self.state_pools = [SlotPool(self.num_state_slots) if g.spec.has_state else None for g in groups]
        # Overlap snapshots exist only to be reused: none without prefix caching. One per `unit`
        # tokens of the blocks the group can hold, plus one per request for rounding.
        self.snapshot_pools = [
            BlockPool(n * g.spec.tokens_per_block(block_size) // self.unit + self.num_state_slots, True)
            if g.spec.overlap and enable_prefix_caching else None
            for g, n in zip(groups, sizes)
        ]
        self.req_blocks: dict[str, list[Table]] = {}
        self.req_snapshots: dict[str, list[Table]] = {}  # per group; snapshot i: the overlap at (i+1)*unit
        self.req_state: dict[str, list[int | None]] = {}
        self.req_restore: dict[str, int] = {}  # prefix-hit length whose snapshots seed the state
        self.req_end: dict[str, int] = {}  # tokens the request's slots cover (what a step may write)
        self.req_hashes: dict[str, list[bytes]] = {}
        # Stats since start (read by metrics).
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks over every group's pool (one group: that pool's size)."""
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free for pool in self.pools)

    @property
    def usage(self) -> float:
        return max(pool.usage for pool in self.pools)

    def blocks_needed(self, num_tokens: int) -> int:
        """Live blocks, over all groups, a request of `num_tokens` tokens holds at most (decoding)."""
        return sum(g.spec.max_blocks_held(num_tokens, self.block_size) for g in self.groups)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever be held (by an otherwise empty cache)."""
        for g, pool in enumerate(self.pools):
            if self.groups[g].spec.max_blocks_held(num_tokens, self.block_size) > pool.num_blocks:
                return False
        return True

    # -- what the runner reads ----------------------------------------------------------------
    def null_block(self, group: int = 0) -> int:
        """The id placeholders read as: the runner's sink block, row `num_blocks` of the group's pool."""
        return self.pools[group].num_blocks

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self.req_blocks.get(request_id)
        if tables is None:
            return []
        null = self.null_block(group)
        return [null if b is None else b.block_id for b in tables[group]]

    def state_slot(self, request_id: str, group: int) -> int:
        """The request's state slot in a compressed group (`num_state_slots`, the sink, if none)."""
        slots = self.req_state.get(request_id)
        slot = slots[group] if slots else None
        return self.num_state_slots if slot is None else slot

    def snapshot_ids(self, request_id: str, group: int) -> list[int]:
        """Positional: id i is where the overlap at token (i+1)*unit is written (a CSA group with
        prefix caching; the null id, the snapshot pool's size, where not held)."""
        pool = self.snapshot_pools[group]
        tables = self.req_snapshots.get(request_id)
        if pool is None or tables is None:
            return []
        return [pool.num_blocks if b is None else b.block_id for b in tables[group]]

    def snapshot_to_restore(self, request_id: str, group: int, start: int) -> int | None:
        """The snapshot to copy into the state's window start//ratio - 1 before a step from `start`:
        set for the first step after a prefix hit of a CSA group, else None."""
        if self.req_restore.get(request_id) != start or self.snapshot_pools[group] is None:
            return None
        return self.req_snapshots[request_id][group][start // self.unit - 1].block_id

    # -- prefix cache -------------------------------------------------------------------------
    def _block_hashes(self, req: Request, upto_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks within its first `upto_tokens` tokens (memoised).
        Hash i identifies tokens [0, (i+1)*block_size): a group block or snapshot ending there uses it."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        n_full = max(0, min(upto_tokens, len(tokens))) // self.block_size
        while len(hashes) < n_full:
            i = len(hashes)
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block(hashes[-1] if hashes else None, chunk))
        return hashes[:n_full]

    def _hash_at(self, hashes: list[bytes], end_token: int) -> bytes:
        return hashes[end_token // self.block_size - 1]

    def find_prefix(self, req: Request) -> PrefixHit:
        """Longest prefix every group can reuse exactly, leaving at least `min_compute` tokens."""
        none = PrefixHit([[] for _ in self.groups], 0, [None] * len(self.groups))
        if not self.enable_prefix_caching:
            return none
        hashes = self._block_hashes(req, req.num_tokens - self.min_compute)
        limit = len(hashes) * self.block_size
        for g, group in enumerate(self.groups):  # groups that need every block: the cached run
            if group.spec.kind == "sliding_window":
                continue
            tpb = group.spec.tokens_per_block(self.block_size)
            n = 0
            while (n + 1) * tpb <= limit and self.pools[g].lookup(self._hash_at(hashes, (n + 1) * tpb)):
                n += 1
            limit = n * tpb
        hit = none
        for length in range(limit // self.unit * self.unit, 0, -self.unit):
            found = self._lookup(hashes, length)
            if found is not None:
                hit = found
                break
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit.num_tokens
        return hit

    def _lookup(self, hashes: list[bytes], length: int) -> PrefixHit | None:
        """Every group's blocks (and CSA snapshot) for a hit of `length` tokens, or None if one is missing."""
        tables: list[Table] = []
        for g, group in enumerate(self.groups):
            tpb = group.spec.tokens_per_block(self.block_size)
            first = group.spec.first_needed_block(length, self.block_size)
            table: Table = [None] * first
            for j in range(first, length // tpb):
                block = self.pools[g].lookup(self._hash_at(hashes, (j + 1) * tpb))
                if block is None:
                    return None
                table.append(block)
            tables.append(table)
        snaps: list[Block | None] = []
        for pool in self.snapshot_pools:
            snap = pool.lookup(self._hash_at(hashes, length)) if pool is not None else None
            if pool is not None and snap is None:
                return None
            snaps.append(snap)
        return PrefixHit(tables, length, snaps)

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` tokens after the request's computed ones (plus a prefix
        hit, for a request being scheduled for the first time): each group grows by its own rule,
        a sliding group first gives back the blocks this step's queries no longer see, a new request
        takes its state slots. False, changing nothing, when something does not fit."""
        rid = req.request_id
        held = self.req_blocks.get(rid)
        start = hit.num_tokens if hit else req.num_computed_tokens
        total = start + num_new_tokens
        n = len(self.groups)
        hit_blocks = hit.blocks if hit and held is None else [[] for _ in range(n)]
        hit_snaps = hit.snapshots if hit and held is None and hit.snapshots else [None] * n
        tables = held or hit_blocks
        snap_tables = self.req_snapshots.get(rid)
        if not self._fits(tables, snap_tables, hit_blocks, hit_snaps, start, total, new_request=held is None):
            return False
        if held is None:
            held = self.req_blocks[rid] = [[] for _ in range(n)]
            snap_tables = self.req_snapshots[rid] = [[] for _ in range(n)]
            self.req_state[rid] = [pool.allocate() if pool else None for pool in self.state_pools]
            if start and any(hit_snaps):
                self.req_restore[rid] = start
        for g, (group, pool) in enumerate(zip(self.groups, self.pools)):
            live_hit = _live(hit_blocks[g])
            pool.touch(live_hit)
            held[g].extend(hit_blocks[g])
            behind = group.spec.first_needed_block(start, self.block_size)
            released = _live(held[g][:behind])
            held[g][:behind] = [None] * min(behind, len(held[g]))
            pool.free(list(reversed(released)))  # they keep their hash: exact for a hit whose window holds them
            new = group.spec.blocks_for(total, self.block_size) - len(held[g])
            if new > 0:
                held[g].extend(pool.allocate(new))
            snap_pool = self.snapshot_pools[g]
            if snap_pool is not None:
                if hit_snaps[g] is not None:  # only the one at the hit seeds the state; earlier ones are not needed
                    snap_pool.touch([hit_snaps[g]])
                    snap_tables[g].extend([None] * (start // self.unit - 1) + [hit_snaps[g]])
                new = total // self.unit - len(snap_tables[g])
                if new > 0:
                    snap_tables[g].extend(snap_pool.allocate(new))
        self.req_end[rid] = total
        return True

    def _fits(self, tables: list[Table], snap_tables: list[Table] | None, hit_blocks: list[Table],
              hit_snaps: list[Block | None], start: int, total: int, new_request: bool) -> bool:
        for g, (group, pool) in enumerate(zip(self.groups, self.pools)):
            table = tables[g]
            behind = group.spec.first_needed_block(start, self.block_size)
            released = sum(1 for b in table[:behind] if b is not None and b.ref_cnt == 1)
            new = max(0, group.spec.blocks_for(total, self.block_size) - len(table))
            revived = sum(1 for b in _live(hit_blocks[g]) if b.ref_cnt == 0)  # touched: no longer allocatable
            if new + revived > pool.num_free + released:
                return False
            snap_pool = self.snapshot_pools[g]
            if snap_pool is not None:
                have = len(snap_tables[g]) if snap_tables else (start // self.unit if hit_snaps[g] else 0)
                revived = 1 if hit_snaps[g] is not None and hit_snaps[g].ref_cnt == 0 else 0
                if max(0, total // self.unit - have) + revived > snap_pool.num_free:
                    return False
            state_pool = self.state_pools[g]
            if new_request and state_pool is not None and state_pool.num_free == 0:
                return False
        return True

    def commit(self, req: Request) -> None:
        """Register the request's blocks (and snapshots) that are complete in the prefix cache:
        every token they cover is in the request's token list (accepted: draft tokens never are)
        and written (within `num_computed_tokens`). Called once a step's forward pass ran (or, with
        async scheduling, was launched: a step that reads the blocks runs after it on the device),
        never at allocation, so a failed step or a rejected draft leaves nothing behind a hash."""
        if not self.enable_prefix_caching or req.request_id not in self.req_blocks:
            return
        hashes = self._block_hashes(req, req.num_computed_tokens)
        covered = len(hashes) * self.block_size
        for g, pool in enumerate(self.pools):
            tpb = self.groups[g].spec.tokens_per_block(self.block_size)
            self._cache(pool, self.req_blocks[req.request_id][g], tpb, hashes, covered)
            if self.snapshot_pools[g] is not None:
                self._cache(self.snapshot_pools[g], self.req_snapshots[req.request_id][g], self.unit, hashes, covered)

    def _cache(self, pool: BlockPool, table: Table, tokens_each: int, hashes: list[bytes], covered: int) -> None:
        for j, block in enumerate(table):
            end = (j + 1) * tokens_each
            if end > covered:
                break
            if block is not None:
                pool.cache(block, self._hash_at(hashes, end))

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back what lies past the first `num_tokens` tokens (the slots of rejected draft
        tokens). Those blocks were never registered (see `commit`), so they go back to the free
        queue holding no hash. Exact per kind: full and sliding rewrite the rolled-back positions
        later; a compressed group keeps its entries of windows closed before `num_tokens` and its
        state ring still holds the windows the state at `num_tokens` needs if the rolled-back
        tokens crossed at most one window boundary; past that (or into a sliding window's given-back
        blocks) it raises, changing nothing."""
        rid = req.request_id
        held = self.req_blocks.get(rid)
        if held is None:
            return
        self._check_trim(held, num_tokens, self.req_end.get(rid, num_tokens))
        hashes = self.req_hashes.get(rid)
        if hashes is not None:  # memoised over tokens that may now change (a drafter's rolled-back drafts)
            del hashes[num_tokens // self.block_size :]
        for g, pool in enumerate(self.pools):
            keep = self.groups[g].spec.blocks_for(num_tokens, self.block_size)
            self._drop(pool, held[g], keep)
            if self.snapshot_pools[g] is not None:
                self._drop(self.snapshot_pools[g], self.req_snapshots[rid][g], num_tokens // self.unit)
        self.req_end[rid] = min(self.req_end.get(rid, num_tokens), num_tokens)

    def _check_trim(self, held: list[Table], num_tokens: int, end: int) -> None:
        if num_tokens >= end:
            return
        for g, group in enumerate(self.groups):
            spec = group.spec
            if spec.kind == "compressed":
                crossed = (end - 1) // spec.ratio - num_tokens // spec.ratio
                if crossed > spec.state_ring - (2 if spec.overlap else 1):
                    raise RuntimeError(
                        f"rolling back {end - num_tokens} tokens crosses {crossed} windows of the ratio-"
                        f"{spec.ratio} cache; its state keeps one: verify at most {spec.ratio} tokens a step"
                    )
            first = spec.first_needed_block(num_tokens, self.block_size)
            if any(b is None for b in held[g][first : spec.blocks_for(num_tokens, self.block_size)]):
                raise RuntimeError(
                    f"rolling back to {num_tokens} tokens needs sliding-window blocks already given back; "
                    "roll back only the last step's tokens"
                )

    @staticmethod
    def _drop(pool: BlockPool, table: Table, keep: int) -> None:
        extra = table[keep:]
        del table[keep:]
        pool.free(list(reversed(_live(extra))))

    def free(self, req: Request) -> None:
        rid = req.request_id
        held = self.req_blocks.pop(rid, None)
        self.req_hashes.pop(rid, None)
        self.req_end.pop(rid, None)
        self.req_restore.pop(rid, None)
        snaps = self.req_snapshots.pop(rid, None)
        slots = self.req_state.pop(rid, None)
        if held is None:
            return
        for g, pool in enumerate(self.pools):
            self._drop(pool, held[g], 0)
            if self.snapshot_pools[g] is not None and snaps is not None:
                self._drop(self.snapshot_pools[g], snaps[g], 0)
            if slots and slots[g] is not None:
                self.state_pools[g].free(slots[g])

    def reset_prefix_cache(self) -> None:
        for pool in self.pools + [p for p in self.snapshot_pools if p is not None]:
            pool.reset_prefix_cache()
