"""Qwen3 (dense): pre-norm decoder with GQA attention, per-head q/k RMSNorm and a SwiGLU MLP.

Parameter names equal HF checkpoint names (`model.embed_tokens.weight`, `model.layers.N...`,
`model.norm.weight`, `lm_head.weight`). `qwen3_moe.py` reuses everything here and swaps the MLP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core import StepMetadata
from tandem.kv.spec import KVCacheSpec
from tandem.kv.tensors import LayerCache
from tandem.models.base import CausalLM
from tandem.models.layers.attention import Attention
from tandem.models.layers.mlp import SwiGLUMLP, check_activation
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import RopeConfig, RotaryEmbedding


def require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config has no {key!r}")
    return cfg[key]


@dataclass(frozen=True)
class Qwen3Args:
    """The fields of an HF Qwen3 config.json this implementation reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    hidden_act: str
    rope: RopeConfig

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3Args:
        hidden, heads = int(require(cfg, "hidden_size")), int(require(cfg, "num_attention_heads"))
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported (no released Qwen3 checkpoint uses it)")
        args = cls(
            vocab_size=int(require(cfg, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(require(cfg, "intermediate_size")),
            num_hidden_layers=int(require(cfg, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            rope=RopeConfig.from_hf(cfg),
        )
        check_activation(args.hidden_act)
        return args


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            bias=args.attention_bias,
            qk_norm=True,
            rms_norm_eps=args.rms_norm_eps,
        )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]: the previous layer's block output (not yet added)
        residual: torch.Tensor | None,  # [T, H]: the residual stream; None before the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, args: Qwen3Args, mlps: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(args, mlp) for mlp in mlps)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """-> (final hidden states [T, H], {layer: that layer's output [T, H]} for `aux_layers`).
        A layer's output is the residual stream after it (its block output plus its residual),
        before the final norm even for the last layer."""
        hidden = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # [T, D] each, shared by all layers
        residual = None
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin, step)
            if i in aux_layers:
                aux[i] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, aux


class Qwen3ForCausalLM(CausalLM):
    args_class = Qwen3Args

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        self.args = args = self.args_class.from_hf(hf_config)
        self.model = Qwen3Model(args, [self.make_mlp(i) for i in range(args.num_hidden_layers)])
        # Tied: logits use the embedding matrix and the checkpoint has no lm_head.weight.
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.to(dtype)  # parameters only matter here; rotary keeps its float32 buffer

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return SwiGLUMLP(self.args.hidden_size, self.args.intermediate_size, self.args.hidden_act)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, step)[0]

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, aux = self.model(input_ids, positions, step, layers)
        return hidden, torch.cat([aux[i] for i in layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()  # [S, V] float32

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def dense_mlps(self) -> list[SwiGLUMLP]:
        """The layers' dense feed-forward blocks (every layer of a dense model; a MoE's
        `mlp_only_layers`)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SwiGLUMLP)]

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        a = self.args
        return [KVCacheSpec("full", a.num_key_value_heads, a.head_dim, self.dtype) for _ in range(a.num_hidden_layers)]

    def bind_kv_caches(self, caches: Sequence[tuple[LayerCache, ...]]) -> None:
        layers = self.attention_layers()
        if len(caches) != len(layers) or any(len(c) != 1 for c in caches):
            raise ValueError(f"expected one full-attention cache for each of {len(layers)} layers, got {len(caches)}")
        for attn, (cache,) in zip(layers, caches):
            attn.bind_kv_cache(cache.pages, cache.group, cache.scales)
