"""Sparse MoE block: a softmax top-k router plus routed experts run by a pluggable executor.

Experts are stored as per-expert modules (`experts.{i}.gate_proj/up_proj/down_proj`), exactly the
HF checkpoint layout. Who computes them is an executor behind a small registry:

    executor(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]

"torch" is the reference (a loop over the experts hit); "grouped" the fused GPU executor
(tandem/kernels/moe_grouped.py, imported on first use: kernels are leaves and import nothing from
the models). The CPU executor and the hot experts (tandem/offload/) are set per layer by the
loader with `set_executor`, so model files never know which one runs.

An executor may also have `submit(hidden, topk_ids, topk_weights) -> collect`, which starts the work
and returns a function giving the output: a block with GPU work of its own that does not depend on
the routed experts (DeepSeek-V4's shared expert) queues it between the two, so it overlaps work
done elsewhere (the CPU experts with `--cpu-moe-handoff poll`). `submit_experts` falls back to
the plain call for executors without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.fused import use_fused
from tandem.models.layers.mlp import SwiGLUMLP


class MoEExecutor(Protocol):
    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] (hidden's dtype) -> [T, H]."""
        ...


def submit_experts(executor: MoEExecutor, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`executor.submit(...)` where it has one (see the module doc), else the call made now."""
    submit = getattr(executor, "submit", None)
    if submit is not None:
        return submit(hidden, topk_ids, topk_weights)
    out = executor(hidden, topk_ids, topk_weights)
    return lambda: out


# Name -> the executor class, "module:attr", imported on first use. A class takes the layer's
# expert modules (it reads their weights when called, or repacks them once) and is the callable.
_EXECUTORS = {
    "torch": "tandem.models.layers.moe:TorchMoEExecutor",
    "grouped": "tandem.kernels.moe_grouped:GroupedMoEExecutor",
}


def make_moe_executor(name: str, experts: nn.ModuleList) -> MoEExecutor:
    if name not in _EXECUTORS:
        raise ValueError(f"unknown MoE executor {name!r}; known: {', '.join(sorted(_EXECUTORS))}")
    module, attr = _EXECUTORS[name].split(":")
    return getattr(importlib.import_module(module), attr)(experts)


def moe_executor_names() -> tuple[str, ...]:
    return tuple(sorted(_EXECUTORS))


def install_moe_executor(model: nn.Module, name: str) -> int:
    """Give every MoE block of `model` whose experts are on it a fresh `name` executor, layer by
    layer (call after the weights are loaded). Returns the number of blocks changed; 0 for a
    model without MoE blocks."""
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else {}
    blocks = {i: b for i, b in blocks.items() if not b.offloaded}  # offloaded layers keep their executor
    for block in blocks.values():
        block.set_executor(make_moe_executor(name, block.experts))
    return len(blocks)


class TorchMoEExecutor:
    """Reference: for each expert hit, run it on its tokens and index_add the weighted result.

    Holds the expert ModuleList, not its tensors, so it keeps working after the loader replaces
    parameters (`to_empty`). Syncs with the host once per call (expert counts); fine for a
    reference, not for CUDA graphs.
    """

    def __init__(self, experts: nn.ModuleList) -> None:
        self.experts = experts

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        flat_weights = topk_weights.reshape(-1)
        out = torch.zeros_like(hidden)
        start = 0
        for e, n in enumerate(counts):  # ascending expert order, so sums are reproducible
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // k  # [n]
            y = self.experts[e](hidden[tokens]) * flat_weights[pairs, None]  # [n, H]
            out.index_add_(0, tokens, y)
        return out


def _detached(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this MoE block's experts were detached for offloading but no executor was installed")


class RoutedExperts:
    """What an MoE block offers the offload planner and loader: its `experts` ModuleList, the
    `executor` that runs them, and a way to detach them (a mixin for nn.Module blocks)."""

    experts: nn.ModuleList
    executor: MoEExecutor

    def set_executor(self, executor: MoEExecutor) -> None:
        self.executor = executor

    @property
    def offloaded(self) -> bool:
        """Whether the routed experts live elsewhere (RAM: see tandem/offload/), out of this module."""
        return len(self.experts) == 0

    def detach_experts(self) -> None:
        """Drop the expert modules (call on the meta model, before it is materialised): their weights
        are loaded into an offloaded executor instead, so they take no device memory and no
        state_dict entries. Until `set_executor` installs that executor the block cannot run."""
        self.experts = nn.ModuleList()
        self.executor = _detached


class SparseMoeBlock(RoutedExperts, nn.Module):
    """Router `gate` (Linear H -> E, no bias) -> softmax (float32) -> top-k, renormalised over the
    chosen k when `norm_topk_prob`; then the routed experts through the executor."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        hidden_act: str = "silu",
        executor: str = "torch",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLUMLP(hidden_size, moe_intermediate_size, hidden_act) for _ in range(num_experts)
        )
        # A plain attribute (not a submodule): parameters keep their checkpoint names.
        self.executor: MoEExecutor = make_moe_executor(executor, self.experts)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in hidden's dtype)."""
        logits = self.gate(hidden)  # [T, E]
        if use_fused(logits):  # CUDA with the fused ops on: softmax + top-k + renormalise, one launch
            from tandem.kernels.moe_small import route_topk

            return route_topk(logits, self.top_k, self.norm_topk_prob, out_dtype=hidden.dtype)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(hidden.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        ids, weights = self.route(hidden)
        return self.executor(hidden, ids, weights)
