"""KV cache manager: which blocks each request holds, per cache group, and prefix-cache lookups.

This is the only owner of block tables. The scheduler asks it for slots; the runner reads
`block_ids(request_id)` to build the step's block tables and slot mappings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from tandem.core import Request
from tandem.kv.block_pool import Block, BlockPool
from tandem.kv.spec import CacheGroup


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Chained block hash: a block's identity is its tokens *and* everything before them."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class PrefixHit:
    """Blocks found in the prefix cache for a request, per group, and the tokens they cover."""

    blocks: list[list[Block]]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        groups: tuple[CacheGroup, ...],
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        min_compute: int = 1,
    ) -> None:
        """min_compute: prompt tokens a prefix hit leaves to compute (at least 1: the last token's
        logits are needed; a drafter that reads the target's hidden states of the last W positions
        needs W)."""
        if not groups:
            raise ValueError("a model needs at least one KV cache group")
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.min_compute = max(1, min_compute)
        # Every group here is a `full` group: one pool each, all growing at the same rate.
        self.pools = [BlockPool(num_blocks, enable_prefix_caching) for _ in groups]
        self.req_blocks: dict[str, list[list[Block]]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        # Stats since start (read by metrics).
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    @property
    def usage(self) -> float:
        return max(pool.usage for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return min(pool.num_free for pool in self.pools)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [[]] * len(self.groups))[group]]

    def _block_hashes(self, req: Request, upto_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks within its first `upto_tokens` tokens (memoised)."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        n_full = max(0, min(upto_tokens, len(tokens))) // self.block_size
        while len(hashes) < n_full:
            i = len(hashes)
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block(hashes[-1] if hashes else None, chunk))
        return hashes[:n_full]

    def find_prefix(self, req: Request) -> PrefixHit:
        """Longest cached prefix of the request, leaving at least `min_compute` tokens to compute."""
        if not self.enable_prefix_caching:
            return PrefixHit([[] for _ in self.groups], 0)
        hashes = self._block_hashes(req, req.num_tokens - self.min_compute)
        hit: list[list[Block]] = [[] for _ in self.groups]
        for h in hashes:
            found = [pool.lookup(h) for pool in self.pools]
            if any(b is None for b in found):
                break
            for g, b in enumerate(found):
                hit[g].append(b)
        num_tokens = len(hit[0]) * self.block_size
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_tokens
        return PrefixHit(hit, num_tokens)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever be held (by an otherwise empty cache)."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` tokens after the request's computed ones (plus a prefix
        hit, for a request being scheduled for the first time). False, changing nothing, when
        there are not enough free blocks."""
        held = self.req_blocks.get(req.request_id)
        hit_blocks = hit.blocks if hit else [[] for _ in self.groups]
        start = hit.num_tokens if hit else req.num_computed_tokens
        total_tokens = start + num_new_tokens
        for g, pool in enumerate(self.pools):
            have = len(held[g]) if held else 0
            new = self.blocks_needed(total_tokens) - have - len(hit_blocks[g])
            # Hit blocks sitting in the free queue stop being allocatable once touched.
            revived = sum(1 for b in hit_blocks[g] if b.ref_cnt == 0)
            if new + revived > pool.num_free:
                return False
        if held is None:
            held = self.req_blocks[req.request_id] = [[] for _ in self.groups]
        for g, pool in enumerate(self.pools):
            pool.touch(hit_blocks[g])
            held[g].extend(hit_blocks[g])
            new = self.blocks_needed(total_tokens) - len(held[g])
            if new > 0:
                held[g].extend(pool.allocate(new))
        return True

    def commit(self, req: Request) -> None:
        """Register the request's blocks that are complete in the prefix cache: every token of the
        block is in the request's token list (accepted: draft tokens never are) and its K/V is
        written (within `num_computed_tokens`). Called once a step's forward pass ran, never at
        allocation, so a failed step or a rejected draft leaves nothing behind a hash."""
        if not self.enable_prefix_caching or req.request_id not in self.req_blocks:
            return
        hashes = self._block_hashes(req, req.num_computed_tokens)
        for g, pool in enumerate(self.pools):
            for block, h in zip(self.req_blocks[req.request_id][g], hashes):
                pool.cache(block, h)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (the slots of rejected draft
        tokens). Those blocks were never registered (see `commit`), so they go back to the free
        queue holding no hash."""
        held = self.req_blocks.get(req.request_id)
        if held is None:
            return
        hashes = self.req_hashes.get(req.request_id)
        if hashes is not None:  # memoised over tokens that may now change (a drafter's rolled-back drafts)
            del hashes[num_tokens // self.block_size :]
        keep = self.blocks_needed(num_tokens)
        for g, pool in enumerate(self.pools):
            extra = held[g][keep:]
            if extra:
                del held[g][keep:]
                pool.free(list(reversed(extra)))

    def free(self, req: Request) -> None:
        held = self.req_blocks.pop(req.request_id, None)
        self.req_hashes.pop(req.request_id, None)
        if held is None:
            return
        for g, pool in enumerate(self.pools):
            pool.free(list(reversed(held[g])))

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
