"""The attention backend interface and its registry."""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.core import StepMetadata


class AttentionBackend(Protocol):
    """Paged attention for the *full* cache-group kind.

    `forward` writes this step's K/V into the cache at `slot_mapping`, then attends each request's
    query tokens causally to all of its cached tokens.

    `kv_scales` (the layer's `LayerCache.scales`) comes with float8_e4m3fn pages (--kv-cache-dtype
    fp8): one float32 scale per stored vector, i.e. per token and KV head, for K and for V. The
    write stores x / s with s = max(amax(|x|) over D, 1e-12) / 448 and s beside it; attention reads
    stored * s. None: the pages hold K/V in the model's dtype, unscaled.
    """

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        step: StepMetadata,
        group: int,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # fp8 pages: [2, num_blocks, block_size, Hkv] float32
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """fp8 pages come with their scales, and only fp8 pages do."""
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if kv_scales is None:
        if fp8:
            raise ValueError("float8_e4m3fn KV pages need their scales (LayerCache.scales, [2, N, bs, Hkv] "
                             "float32): bind them with the pages")
        return
    if not fp8:
        raise ValueError(f"KV scales go with float8_e4m3fn pages, not {kv_cache.dtype} ones")
    if kv_scales.shape != kv_cache.shape[:-1] or kv_scales.dtype != torch.float32:
        raise ValueError(f"KV scales {tuple(kv_scales.shape)} {kv_scales.dtype} must be float32 "
                         f"{tuple(kv_cache.shape[:-1])}: one per stored vector of the pages")


_BACKENDS: dict[str, type] = {}
_UNAVAILABLE: dict[str, str] = {}  # name -> why its module failed to import


def register_attention_backend(name: str):
    def wrap(cls: type) -> type:
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    # Import for registration side effects.
    from tandem.attention import torch_ref  # noqa: F401

    try:
        if name == "triton":  # imported on demand: CPU-only installs need no Triton
            from tandem.attention import triton_paged  # noqa: F401
    except ImportError as e:  # asking for "triton" must then fail loudly, never fall back to torch
        _UNAVAILABLE.setdefault("triton", f"attention backend 'triton' needs Triton, which failed to import ({e}); "
                                          "install triton or pass --attention-backend torch")

    if name in _UNAVAILABLE and name not in _BACKENDS:
        raise RuntimeError(_UNAVAILABLE[name])
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
