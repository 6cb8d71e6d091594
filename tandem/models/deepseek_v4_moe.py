"""DeepSeek-V4's feed-forward block: a routed MoE (score-routed or hash-routed) plus one shared expert.

Routing, per token:

    scores = score_fn(x @ gate.weight.T)                         # [T, E]; sqrtsoftplus or sigmoid
    ids    = topk(scores + e_score_correction_bias)  (score-routed)  |  tid2eid[input_ids]  (hash-routed)
    w      = scores[ids] / sum(scores[ids]) * routed_scaling_factor

Selection uses the bias-corrected scores but the weights use the raw scores. Every expert (routed and
shared) is a SwiGLU whose pre-activations are clamped: gate <= limit, |up| <= limit.

The routed experts are per-expert modules (`experts.{e}.gate_proj/up_proj/down_proj`, the layout
Tandem's loader and MoE executors read) run through the `MoEExecutor` contract of
`tandem/models/layers/moe.py`: `executor(hidden [T, H], topk_ids [T, k], topk_weights [T, k])`.
The torch reference executor applies the clamp (it calls the expert modules), and so do the CPU
expert kernel (`CpuExpertLayer(swiglu_limit=...)`, set by the offload loader from the experts'
`limit`) and the grouped GPU executor with its small-batch kernel (they read `limit` too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers.moe import MoEExecutor, RoutedExperts, make_moe_executor, submit_experts

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


class ClampedSwiGLU(nn.Module):
    """down(silu(min(gate(x), limit)) * clamp(up(x), -limit, limit)); names match HF checkpoints.

    `SwiGLUMLP` in layers/mlp.py has no clamp, hence this variant."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate = self.gate_proj(x).clamp(max=self.limit)  # [T, I]
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)  # [T, I]
        return self.down_proj(F.silu(gate) * up)


def routing_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Router logits [T, E] -> non-negative per-expert scores [T, E] float32."""
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"scoring_func {scoring_func!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")


class Router(nn.Module):
    """Gate of one MoE layer. Score-routed layers hold `e_score_correction_bias` [E] (the selection
    bias); hash-routed ones hold `tid2eid` [V, k] (token id -> its k experts, fixed in the checkpoint)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str,
                 routed_scaling_factor: float, hash_vocab_size: int | None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..n_routed_experts ({num_experts})")
        routing_scores(torch.zeros(1, 1), scoring_func)  # refuse an unknown scoring_func at build time
        self.top_k, self.scoring_func, self.scale = top_k, scoring_func, routed_scaling_factor
        self.is_hash = hash_vocab_size is not None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab_size, top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], input_ids [T] -> (topk_ids [T, k] int64, topk_weights [T, k] in hidden's dtype)."""
        scores = routing_scores(F.linear(hidden, self.weight), self.scoring_func)  # [T, E] float32
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()  # [T, k]
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        # Always renormalised over the chosen k (transformers ignores norm_topk_prob for V4, as do we).
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        return ids, weights.to(hidden.dtype)


class DeepseekV4MoE(RoutedExperts, nn.Module):
    """routed experts (through the executor) + one always-on shared expert; [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 scoring_func: str, routed_scaling_factor: float, swiglu_limit: float,
                 hash_vocab_size: int | None, executor: str = "torch") -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k  # what the offload planner reads
        self.gate = Router(hidden_size, num_experts, top_k, scoring_func, routed_scaling_factor, hash_vocab_size)
        self.experts = nn.ModuleList(
            ClampedSwiGLU(hidden_size, intermediate_size, swiglu_limit) for _ in range(num_experts)
        )
        self.shared_experts = ClampedSwiGLU(hidden_size, intermediate_size, swiglu_limit)
        # A plain attribute (not a submodule): parameters keep their checkpoint names.
        self.executor: MoEExecutor = make_moe_executor(executor, self.experts)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], input_ids [T] (hash routing reads them) -> [T, H]."""
        routed, shared = self.parts(hidden, input_ids)
        return routed + shared

    def parts(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` before its sum: (routed experts' output, shared expert's output), [T, H] each
        (the decode path adds them inside the mHC merge kernel)."""
        ids, weights = self.gate(hidden, input_ids)
        routed = submit_experts(self.executor, hidden, ids, weights)
        shared = self.shared_experts(hidden)  # queued while the routed experts run (CPU experts: on the CPU)
        return routed(), shared
