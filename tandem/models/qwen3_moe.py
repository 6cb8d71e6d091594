"""Qwen3-MoE: Qwen3 with sparse MoE feed-forward blocks on the layers that
`num_experts > 0`, not in `mlp_only_layers`, and `(idx + 1) % decoder_sparse_step == 0` select;
the other layers keep a dense SwiGLU MLP of `intermediate_size`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.models.layers.mlp import SwiGLUMLP
from tandem.models.layers.moe import SparseMoeBlock
from tandem.models.qwen3 import Qwen3Args, Qwen3ForCausalLM, require


@dataclass(frozen=True)
class Qwen3MoeArgs(Qwen3Args):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3MoeArgs:
        base = Qwen3Args.from_hf(cfg)
        # Real Qwen3 checkpoints write num_experts; transformers v5 writes num_local_experts.
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(require(cfg, "num_experts_per_tok")) if num_experts else 0,
            moe_intermediate_size=int(require(cfg, "moe_intermediate_size")) if num_experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )
        return cls(**base.__dict__, **moe)

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    args_class = Qwen3MoeArgs

    def make_mlp(self, layer_idx: int) -> nn.Module:
        a = self.args
        if not a.is_sparse(layer_idx):
            return SwiGLUMLP(a.hidden_size, a.intermediate_size, a.hidden_act)
        return SparseMoeBlock(
            a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, a.hidden_act
        )

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """Layer index -> its MoE block: where the offload planner sets per-layer executors."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}
