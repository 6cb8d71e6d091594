"""The contract every model architecture implements (one file per architecture in this package)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.engine.metadata import StepMetadata
from tandem.kv.spec import KVCacheSpec


class CausalLM(nn.Module):
    """A decoder-only LM run over packed tokens of many requests with a paged KV cache.

    Subclasses are constructed from the checkpoint's parsed `config.json` (a plain dict) and the
    run dtype; parameter names equal the checkpoint's tensor names, so the loader can check a
    checkpoint against `state_dict()` shapes of a meta-device instance before touching memory.
    """

    # False for an architecture `tandem plan` can size but the engine cannot run yet: loading it
    # for serving is refused with a one-line CheckpointError.
    servable = True

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

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per attention layer, in layer order."""
        raise NotImplementedError

    def bind_kv_caches(self, caches: list[torch.Tensor], groups: list[int]) -> None:
        """Give attention layer i its cache tensor ([2, num_blocks, block_size, Hkv, D]) and the
        index of its cache group (which block table / slot mapping of the step it reads)."""
        raise NotImplementedError

    @classmethod
    def ignored_checkpoint_keys(cls) -> tuple[str, ...]:
        """Substrings of checkpoint tensor names that are legitimately unused (e.g. rotary caches)."""
        return ("rotary_emb.inv_freq",)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 4096))
