"""Per-layer KV cache specs and their grouping into cache groups.

A cache group is a set of layers whose caches grow by the same rule and therefore share one block
table per request. Qwen3 has one `full` group; DeepSeek-V4 will add sliding-window and compressed
groups (one entry per `compress_ratio` tokens) without changing the block manager's interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("full",)  # "sliding_window" and "compressed" arrive with DeepSeek-V4


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KV cache kind {self.kind!r} is not supported yet; supported: {KINDS}")

    def bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class CacheGroup:
    spec: KVCacheSpec
    layer_indices: tuple[int, ...]

    def bytes_per_block(self, block_size: int) -> int:
        return len(self.layer_indices) * block_size * self.spec.bytes_per_token()


def group_layers(specs: list[KVCacheSpec]) -> tuple[CacheGroup, ...]:
    """Group layers with identical specs, in order of first appearance."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    return tuple(CacheGroup(spec, tuple(layers)) for spec, layers in groups.items())
