"""The device tensors behind each cache group, per layer: what the runner allocates from the KV
manager's pool sizes and binds to the model (`CausalLM.bind_kv_caches`).

Layouts (N: the group's pool size; row N of every paged tensor is the sink that placeholders and
graph padding point at, so it is never handed out):

- full / sliding_window: `pages` [2, N + 1, block_size, Hkv, D] (K then V), or [1, ...] when one
  vector serves as K and V (`k_is_v`, DeepSeek-V4).
- compressed: `pages` [N + 1, block_size, Hkv * D], one entry per slot; `index_pages`
  [N + 1, block_size, Di] beside them when the group has an indexer; `state[name]`
  [num_state_slots + 1, rows, cols] per request slot (`KVCacheSpec.state_shapes`: the compressor's
  and the indexer's raw projections, kv | gate); `snapshots[name]` [num_snapshots + 1, ratio, cols]
  for CSA groups with prefix caching (`KVCacheSpec.snapshot_shapes`).

Pages are stored in `KVCacheSpec.stored_dtype`; fp8 pages have `scales` (and `index_scales`)
beside them, one float32 per stored vector: the page tensor's shape without its last dimension.
The state and the snapshots stay in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kv.manager import KVCacheManager

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of fp8 pages: x [..., D] -> (x / s as float8_e4m3fn [..., D], s float32 [...]),
    one scale per vector, s = max(amax(|x|), 1e-12) / 448. Reading back is stored.float() * s."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


@dataclass(frozen=True)
class LayerCache:
    """One layer's tensors in one cache group (see the module docstring for their shapes)."""

    group: int
    pages: torch.Tensor
    index_pages: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    snapshots: dict[str, torch.Tensor] = field(default_factory=dict)
    scales: torch.Tensor | None = None  # fp8 pages: float32 [pages.shape[:-1]]
    index_scales: torch.Tensor | None = None

    def nbytes(self) -> int:
        tensors = [self.pages, self.index_pages, self.scales, self.index_scales, *self.state.values(),
                   *self.snapshots.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def allocate_layer_caches(kv: KVCacheManager, num_layers: int, device: torch.device | str
                          ) -> list[tuple[LayerCache, ...]]:
    """Per layer, zeroed tensors of every group it belongs to, in group order, sized by the
    manager's pools (blocks, state slots, snapshots of each group)."""
    per_layer: list[list[LayerCache]] = [[] for _ in range(num_layers)]
    bs = kv.block_size
    for g, group in enumerate(kv.groups):
        spec, n = group.spec, kv.pools[g].num_blocks + 1

        def zeros(*shape: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        def paged(*shape: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            pages = zeros(*shape, dtype=spec.stored_dtype)
            return pages, zeros(*shape[:-1], dtype=torch.float32) if spec.scaled else None

        for layer in group.layer_indices:
            if spec.kind == "compressed":
                snaps = kv.snapshot_pools[g]
                pages, scales = paged(n, bs, spec.num_kv_heads * spec.head_dim)
                index_pages, index_scales = paged(n, bs, spec.index_head_dim) if spec.index_head_dim else (None, None)
                cache = LayerCache(
                    group=g, pages=pages, index_pages=index_pages, scales=scales, index_scales=index_scales,
                    state={name: zeros(kv.num_state_slots + 1, r, c) for name, (r, c) in spec.state_shapes().items()},
                    snapshots={} if snaps is None else
                    {name: zeros(snaps.num_blocks + 1, r, c) for name, (r, c) in spec.snapshot_shapes().items()},
                )
            else:
                pages, scales = paged(1 if spec.k_is_v else 2, n, bs, spec.num_kv_heads, spec.head_dim)
                cache = LayerCache(g, pages, scales=scales)
            per_layer[layer].append(cache)
    return [tuple(caches) for caches in per_layer]
