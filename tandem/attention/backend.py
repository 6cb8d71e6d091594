"""The attention backend interface and its registry."""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.core import StepMetadata


class AttentionBackend(Protocol):
    """Paged attention for the *full* cache-group kind.

    `forward` writes this step's K/V into the cache at `slot_mapping`, then attends each request's
    query tokens causally to all of its cached tokens.
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
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


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
