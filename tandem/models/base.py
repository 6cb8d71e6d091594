"""The contract every model architecture implements (one file per architecture in this package)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tandem.core import StepMetadata
from tandem.kv.spec import KVCacheSpec
from tandem.kv.tensors import LayerCache


class CausalLM(nn.Module):
    """A decoder-only LM run over packed tokens of many requests with a paged KV cache.

    Subclasses are constructed from the checkpoint's parsed `config.json` (a plain dict) and the
    run dtype; parameter names equal the checkpoint's tensor names, so the loader can check a
    checkpoint against `state_dict()` shapes of a meta-device instance before touching memory.
    """

    # Attention backends and MoE executors the architecture can run (None: every registered one).
    # The engine refuses a flag outside them and resolves "auto" within them.
    attention_backends: tuple[str, ...] | None = None
    moe_executors: tuple[str, ...] | None = None

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden states [T, H]."""
        raise NotImplementedError

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the outputs of decoder layers `layers` (0-based; the residual
        stream after each, before the final norm), concatenated in that order: (hidden [T, H],
        aux [T, len(layers) * H]). A drafter that reads the target's hidden states (DSpark) needs it."""
        raise NotImplementedError(f"{type(self).__name__} cannot give a drafter its layers' hidden states")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] float32."""
        raise NotImplementedError

    def kv_cache_specs(self) -> list[KVCacheSpec | tuple[KVCacheSpec, ...]]:
        """Per attention layer, in layer order, its cache spec (a tuple when a layer holds caches
        of several kinds, as DeepSeek-V4's do)."""
        raise NotImplementedError

    def bind_kv_caches(self, caches: Sequence[tuple[LayerCache, ...]]) -> None:
        """Give attention layer i its caches, one per group it belongs to, in the order of its
        `kv_cache_specs` entry (tandem/kv/tensors.py: the tensors and the group index, which
        says which block table / slot mapping of the step it reads)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_name(cls, key: str) -> str:
        """The parameter name of checkpoint tensor `key` (the loader reads the file's tensors under
        these names); the identity where a checkpoint uses the model's names."""
        return key

    @classmethod
    def ignored_checkpoint_keys(cls) -> tuple[str, ...]:
        """Substrings of checkpoint tensor names that are legitimately unused (e.g. rotary caches)."""
        return ("rotary_emb.inv_freq",)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 4096))
