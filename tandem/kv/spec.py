"""Per-layer KV cache specs, their page geometry and growth rule, and their grouping into cache groups.

A cache group is a set of layers whose caches grow by the same rule and therefore share one block
table per request (and, for compressed kinds, one state slot). Kinds:

- `full`: K and V of every token; block i holds tokens [i*bs, (i+1)*bs).
- `sliding_window` (`window` W): a query sees the last W tokens, its own included, so the cache
  keeps the W-1 before it. Same geometry as `full`; blocks that fall entirely behind every future
  query's window are given back (the block table keeps a placeholder so indices stay positional).
- `compressed` (`ratio` m): one entry per m tokens (entry n summarises tokens [n*m, (n+1)*m) and
  exists once token (n+1)*m - 1 is computed); a block holds `block_size` entries, so it covers
  block_size * m tokens. `index_head_dim` > 0 adds the lightning indexer's key beside each entry
  (same geometry, a second tensor); `overlap` marks CSA's overlapping windows (entry n also pools
  the first half, "Ca", of window n-1's projections).

A compressed group also has a per-request **state slot**: the compressor's (and indexer's) raw
projections (kv | gate) of the last `state_ring` windows, row `p % (state_ring * m)` for token p.
The partial window of a request at `t` computed tokens is rows of window t // m up to t % m (the
count is derived from t, never stored), and CSA's overlap is window t // m - 1. One window more than
needed is kept so a speculative rollback across one window boundary finds its rows intact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

KINDS = ("full", "sliding_window", "compressed")


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str
    num_kv_heads: int
    head_dim: int  # compressed: the entry's width per head
    dtype: torch.dtype
    window: int = 0  # sliding_window: keys a query sees, its own included
    ratio: int = 1  # compressed: tokens per entry
    index_head_dim: int = 0  # compressed: the indexer key stored beside each entry (0: none)
    overlap: bool = False  # compressed: CSA's overlapping windows (needs the previous window's Ca)
    k_is_v: bool = False  # full / sliding_window: one vector serves as K and V (DeepSeek-V4)
    # How pages are stored (--kv-cache-dtype): None keeps `dtype`; float8_e4m3fn stores each vector
    # (a token's K or V or K=V, an entry, an index key) with one float32 scale. The compressed
    # state (the raw projections) stays in `dtype`: pooling from it must equal the reference.
    page_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KV cache kind {self.kind!r} is not supported yet; supported: {KINDS}")
        if self.kind == "sliding_window" and self.window < 1:
            raise ValueError("a sliding_window cache needs window >= 1 (keys a query sees, its own included)")
        if self.kind == "compressed" and self.ratio < 1:
            raise ValueError("a compressed cache needs ratio >= 1 (tokens per entry)")
        if self.kind != "compressed" and (self.ratio != 1 or self.index_head_dim or self.overlap):
            raise ValueError(f"ratio, index_head_dim and overlap are for compressed caches, not {self.kind!r}")
        if self.page_dtype not in (None, self.dtype, torch.float8_e4m3fn):
            raise ValueError(f"KV pages are stored in the model's dtype or float8_e4m3fn, not {self.page_dtype}")

    @property
    def elem(self) -> int:
        """Bytes of one element of the state (and of the pages, unless `page_dtype` says otherwise)."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.page_dtype or self.dtype

    @property
    def scaled(self) -> bool:
        """Whether each stored vector carries a float32 scale (fp8 pages)."""
        return self.stored_dtype.itemsize == 1

    def bytes_per_token(self) -> float:
        """Bytes one token of context costs in one layer: K and V (or the shared K=V vector) for
        full and sliding (sliding only while the token is inside the window), one entry (plus its
        indexer key) per `ratio` tokens for compressed."""
        return self.bytes_per_slot() / (self.ratio if self.kind == "compressed" else 1)

    def bytes_per_slot(self) -> int:
        """One slot of a page in one layer: a token's K/V, or one compressed entry (+ indexer key)."""
        elem, scale = self.stored_dtype.itemsize, 4 if self.scaled else 0
        if self.kind == "compressed":
            vectors = 1 + int(self.index_head_dim > 0)
            return (self.num_kv_heads * self.head_dim + self.index_head_dim) * elem + vectors * scale
        return (1 if self.k_is_v else 2) * self.num_kv_heads * (self.head_dim * elem + scale)

    # -- geometry and growth -------------------------------------------------------------------
    def tokens_per_block(self, block_size: int) -> int:
        return block_size * (self.ratio if self.kind == "compressed" else 1)

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Positional length of the block table once `num_tokens` tokens are written (placeholders
        of freed sliding blocks included). Compressed: only closed windows have entries."""
        slots = num_tokens // self.ratio if self.kind == "compressed" else num_tokens
        return -(-slots // block_size)

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """Index of the first block a query at position `num_tokens` (or later) still reads; blocks
        before it may be given back. Only a sliding window ever leaves blocks behind."""
        if self.kind != "sliding_window":
            return 0
        return max(0, num_tokens - self.window + 1) // block_size

    def max_blocks_held(self, num_tokens: int, block_size: int, step_tokens: int = 1) -> int:
        """The most live blocks a request of `num_tokens` holds when it runs `step_tokens` query
        tokens a step (a sliding window holds W-1 keys plus the step, however long the context)."""
        n = self.blocks_for(num_tokens, block_size)
        if self.kind == "sliding_window":
            n = min(n, -(-(self.window - 1 + step_tokens) // block_size) + 1)
        return n

    # -- per-request state (compressed) ----------------------------------------------------------
    @property
    def has_state(self) -> bool:
        return self.kind == "compressed"

    @property
    def state_ring(self) -> int:
        """Windows of projections the state slot keeps: those the state at any t needs (the partial
        window, plus the previous one for CSA's overlap) and one more for rollback."""
        return 3 if self.overlap else 2

    def state_shapes(self) -> dict[str, tuple[int, int]]:
        """Per layer, per state slot: name -> (rows, cols) in `dtype` (the projections' dtype, so
        pooling from the state is bitwise what the cache-free reference computes). cols = kv | gate,
        each the projection's width (2*D with overlap: Ca | Cb)."""
        if not self.has_state:
            return {}
        rows, proj = self.state_ring * self.ratio, (2 if self.overlap else 1) * self.num_kv_heads * self.head_dim
        shapes = {"compressor": (rows, 2 * proj)}
        if self.index_head_dim:
            shapes["indexer"] = (rows, 2 * 2 * self.index_head_dim)  # the indexer always overlaps
        return shapes

    def snapshot_shapes(self) -> dict[str, tuple[int, int]]:
        """Per layer, per snapshot: one window of state rows (name -> (ratio, cols)), kept at prefix
        boundaries so a prefix hit can restore CSA's overlap. Empty without overlap (at a boundary
        that is a multiple of the ratio, the partial window is empty and nothing else is needed)."""
        if not self.overlap:
            return {}
        return {name: (self.ratio, cols) for name, (_, cols) in self.state_shapes().items()}

    def state_bytes(self) -> int:
        return sum(r * c for r, c in self.state_shapes().values()) * self.elem

    def snapshot_bytes(self) -> int:
        return sum(r * c for r, c in self.snapshot_shapes().values()) * self.elem


@dataclass(frozen=True)
class CacheGroup:
    spec: KVCacheSpec
    layer_indices: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * block_size * self.spec.bytes_per_slot()

    def state_bytes(self) -> int:
        """One request's state slot over the group's layers."""
        return self.num_layers * self.spec.state_bytes()

    def snapshot_bytes(self) -> int:
        return self.num_layers * self.spec.snapshot_bytes()


def prefix_unit(groups: Sequence[CacheGroup], block_size: int) -> int:
    """Granularity of exact prefix reuse: every group's blocks end there (a hit shares whole blocks
    only) and so does every compressed window (no partial window to carry). One full group: the
    block size, as before."""
    return math.lcm(*(g.spec.tokens_per_block(block_size) for g in groups))


def group_layers(specs: Sequence[KVCacheSpec | tuple[KVCacheSpec, ...]]) -> tuple[CacheGroup, ...]:
    """Group layers with identical specs, in order of first appearance. A layer may hold several
    caches (DeepSeek-V4: a sliding window and a compressed cache): pass a tuple of specs for it."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for i, layer_specs in enumerate(specs):
        for spec in layer_specs if isinstance(layer_specs, tuple) else (layer_specs,):
            groups.setdefault(spec, []).append(i)
    return tuple(CacheGroup(spec, tuple(layers)) for spec, layers in groups.items())


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # --kv-cache-dtype, vLLM's names ("fp8" is e4m3)


def page_dtype_of(kv_cache_dtype: str) -> torch.dtype | None:
    """--kv-cache-dtype -> `KVCacheSpec.page_dtype` (None: the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return None if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def with_page_dtype(groups: Sequence[CacheGroup], page_dtype: torch.dtype | None) -> tuple[CacheGroup, ...]:
    """The groups with their pages stored in `page_dtype` (None: unchanged)."""
    if page_dtype is None:
        return tuple(groups)
    return tuple(CacheGroup(replace(g.spec, page_dtype=page_dtype), g.layer_indices) for g in groups)
