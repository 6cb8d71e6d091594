"""A pool of fixed-size KV blocks with reference counts and a prefix cache.

Blocks with ref_cnt 0 sit in an LRU free queue. A free block that still holds a cached prefix
(it has a hash) can be revived by a prefix-cache hit until it is evicted, which happens only when
a new block is needed and it is at the front of the free queue.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and its tokens are known


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = least recently freed). Dict keeps O(1) removal.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        """Blocks available for allocation, including evictable cached ones."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")  # caller checks first
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference to blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference to each block. Callers pass a request's blocks tail-first, so the
        tail of a sequence (least likely to be shared) is evicted before its prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: Block, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # same content computed twice (e.g. two identical prompts)
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None


class SlotPool:
    """Fixed per-request slots (a compressed group's state): a free list, no sharing, no caching."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.num_slots} state slots are taken")  # caller checks first
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        assert slot not in self.free_slots, f"state slot {slot} freed twice"
        self.free_slots.append(slot)
