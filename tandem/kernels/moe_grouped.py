"""The "grouped" MoE executor: routed experts as two grouped GEMMs (`torch._grouped_mm`), with no
host sync and no data-dependent shape, so a decode step that runs it can be captured in a CUDA graph.

    hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H]

1. Sort the T*k (token, slot) pairs by expert on the device; `offs[e]` (int32) is the end row of
   expert e's group in the sorted order. The sorted buffer has exactly T*k rows whatever the routing.
2. `h = x_sorted @ w13[e]^T` per group -> [T*k, 2I]; `a = silu(gate) * up` -> [T*k, I];
   `y = a @ w2[e]^T` per group -> [T*k, H].
3. Un-sort y to (token, slot) order, view it as [T, k, H] and reduce over k with the routing weights
   as one batched matmul (fp32 accumulation, no atomics: deterministic, run to run).

Weights: the factory stacks a layer's expert weights into `w13 [E, 2I, H]` (gate rows then up rows)
and `w2 [E, H, I]`, and re-points every expert Linear's `weight` at a view of the stack. Parameter
names, shapes and `state_dict` keys are unchanged and the model holds each weight once; the only
transient is one layer's experts while that layer is restacked (install layer by layer).

Small batches (T * k <= the executor's `small_max_pairs`: decode and short verify steps) on CUDA go
to the Triton GEMV kernels of `moe_small` instead, which read the same stacks (switch: the fused-ops
setting, `tandem.kernels.fused.set_fused_ops`). The limit starts at moe_small.SMALL_MAX_PAIRS; the
runner measures where the two paths cross on this GPU and layer shape before it captures graphs
(`tandem.kernels.moe_crossover`). The choice is made on the host from the static shape, so each
captured graph holds one path.

`torch._grouped_mm` wants 16-byte-aligned strides; on CUDA it is the fast path only in bf16 on
sm90+ (H100/H200). Anything else is refused with an error naming the dtype and device: the
"torch" reference executor is the slow path, chosen by the caller, never silently here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ALIGN_BYTES = 16


def check_grouped_support(dtype: torch.dtype, device: torch.device, hidden_size: int, intermediate_size: int) -> None:
    """Raise ValueError (saying what to use instead) unless `torch._grouped_mm` serves this layer."""
    where = f"{dtype} on {device}"
    if device.type == "meta":
        raise ValueError(
            "the 'grouped' MoE executor packs loaded weights; the experts are on the meta device. "
            "Install it after loading (install_moe_executor(model, 'grouped'))"
        )
    if not hasattr(torch, "_grouped_mm"):
        raise ValueError(
            f"the 'grouped' MoE executor needs torch._grouped_mm (torch >= 2.8); torch {torch.__version__} lacks it"
        )
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            raise ValueError(
                f"the 'grouped' MoE executor runs bf16 on CUDA; got {where}. Use --dtype bfloat16, "
                "or the 'torch' MoE executor for other dtypes"
            )
        cap = torch.cuda.get_device_capability(device)
        if cap < (9, 0):
            raise ValueError(
                f"the 'grouped' MoE executor needs an sm90+ GPU (H100/H200) for torch._grouped_mm; "
                f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}. Use the 'torch' MoE executor"
            )
    elif device.type != "cpu":
        raise ValueError(f"the 'grouped' MoE executor runs on CUDA (bf16) or CPU; got {where}")
    elif dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the 'grouped' MoE executor runs float32 or bfloat16 on CPU; got {where}")
    elem = torch.empty((), dtype=dtype).element_size()
    for name, n in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size)):
        if n * elem % _ALIGN_BYTES:
            raise ValueError(
                f"the 'grouped' MoE executor needs {_ALIGN_BYTES}-byte-aligned rows for torch._grouped_mm; "
                f"{name}={n} in {dtype} is {n * elem} bytes. Use the 'torch' MoE executor"
            )


def _packed_views(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (w13, w2) stack a previous packing left, if every expert weight still views into it."""
    packed = getattr(experts, "_tandem_packed", None)
    if packed is None:
        return None
    w13, w2 = packed
    inter = w13.shape[1] // 2
    for e, mlp in enumerate(experts):
        if not (
            mlp.gate_proj.weight.data_ptr() == w13[e, :inter].data_ptr()
            and mlp.up_proj.weight.data_ptr() == w13[e, inter:].data_ptr()
            and mlp.down_proj.weight.data_ptr() == w2[e].data_ptr()
            and mlp.gate_proj.weight.dtype == w13.dtype
            and mlp.down_proj.weight.dtype == w2.dtype
        ):
            return None
    return w13, w2


@torch.no_grad()
def pack_expert_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the experts' weights into (w13 [E, 2I, H], w2 [E, H, I]) and make each expert's
    Linear weights views into them; the old per-expert tensors are dropped (freed unless something
    else holds them). Idempotent: a layer already packed returns its existing stacks.

    Transient memory: the new stacks are allocated before the old tensors go, so peak use is the
    model plus one layer's experts.
    """
    again = _packed_views(experts)
    if again is not None:
        return again
    first = experts[0]
    inter, hidden = first.gate_proj.weight.shape
    dtype, device = first.gate_proj.weight.dtype, first.gate_proj.weight.device
    num = len(experts)
    w13 = torch.empty(num, 2 * inter, hidden, dtype=dtype, device=device)  # [E, 2I, H]
    w2 = torch.empty(num, hidden, inter, dtype=dtype, device=device)  # [E, H, I]
    for e, mlp in enumerate(experts):
        w13[e, :inter].copy_(mlp.gate_proj.weight)
        w13[e, inter:].copy_(mlp.up_proj.weight)
        w2[e].copy_(mlp.down_proj.weight)
    for e, mlp in enumerate(experts):
        # New Parameters alias the stack (no copy); assigning them drops the old tensors.
        mlp.gate_proj.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
        mlp.up_proj.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
        mlp.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
    # A plain attribute (not a buffer): state_dict keeps exactly the checkpoint names.
    object.__setattr__(experts, "_tandem_packed", (w13, w2))
    return w13, w2


class GroupedMoEExecutor:
    """Sort-by-expert + two `torch._grouped_mm` calls; sync-free and CUDA-graph capturable.

    `small_batch`: send steps with T * k <= `small_max_pairs` (moe_small.SMALL_MAX_PAIRS until
    `moe_crossover.tune_small_batch` measures it) to `moe_small.fused_moe_small` (default: on CUDA,
    while the fused ops are on; True on CPU runs it under TRITON_INTERPRET=1).
    """

    def __init__(self, experts: nn.ModuleList, small_batch: bool | None = None) -> None:
        w = experts[0].gate_proj.weight
        inter, hidden = w.shape
        for mlp in experts:
            for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                if lin.bias is not None:
                    raise ValueError("the 'grouped' MoE executor supports bias-free expert Linears only")
        check_grouped_support(w.dtype, w.device, hidden, inter)
        self.experts = experts
        # DeepSeek-V4's experts clamp their pre-activations (ClampedSwiGLU.limit): gate <= limit,
        # |up| <= limit; None for a plain SwiGLU.
        self.limit: float | None = getattr(experts[0], "limit", None)
        self.w13, self.w2 = pack_expert_weights(experts)
        self.num_experts, self.inter = len(experts), inter
        # For each expert e, a probe for searchsorted: offs[e] = number of sorted ids <= e.
        self.expert_range = torch.arange(self.num_experts, device=w.device)  # [E] int64
        self.small = None  # the moe_small module when the small-batch path may run (imports Triton)
        self.small_max_pairs = 0  # the most (token, slot) pairs a step may have to take the small path
        if small_batch is None:
            small_batch = w.device.type == "cuda"
        if small_batch:
            from tandem.kernels import moe_small

            self.small, self.small_max_pairs = moe_small, moe_small.SMALL_MAX_PAIRS

    def _check_weights(self) -> None:
        # Host-side pointer compare, no device sync: catches weights replaced after packing
        # (a `.to()`, `to_empty`, reload), which would make the stack stale.
        if self.experts[0].gate_proj.weight.data_ptr() != self.w13.data_ptr():
            raise RuntimeError(
                "the expert weights were replaced after the 'grouped' MoE executor packed them; "
                "re-install it after loading or moving the model (install_moe_executor)"
            )

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self._check_weights()
        num_tokens, k = topk_ids.shape
        if num_tokens == 0:
            return torch.zeros_like(hidden)
        if self.takes_small(num_tokens * k):
            return self.small.fused_moe_small(hidden, topk_ids, topk_weights, self.w13, self.w2, self.limit)
        return self.grouped(hidden, topk_ids, topk_weights)

    def takes_small(self, pairs: int) -> bool:
        """Whether a step of `pairs` (token, slot) pairs runs the small-batch kernels."""
        return self.small is not None and pairs <= self.small_max_pairs and self.small.fused_ops_enabled()

    def grouped(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The grouped-GEMM path (steps 1-3 of the module docstring) whatever the batch size."""
        x, order, offs = sort_by_expert(hidden, topk_ids, self.expert_range)
        return combine_slots(expert_rows(x, self.w13, self.w2, offs, self.limit), order, topk_weights)


def sort_by_expert(hidden: torch.Tensor, topk_ids: torch.Tensor, expert_range: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring: (x [T*k, H] rows in expert order, order [T*k] (the pair
    each row is), offs [E] int32: the end row of each expert's group), on the device, no sync."""
    k = topk_ids.shape[1]
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)  # [T*k]; order: pair index, grouped by expert
    offs = torch.searchsorted(sorted_ids, expert_range, right=True, out_int32=True)  # [E] int32 group ends
    return hidden[order // k], order, offs


def expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                limit: float | None) -> torch.Tensor:
    """Step 2: rows x [N, H] grouped by expert (offs [E] int32 group ends, E = len(w13)) through
    their expert's SwiGLU MLP (clamped by `limit` as DeepSeek-V4's) -> [N, H]."""
    inter = w13.shape[1] // 2
    h = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [N, 2I]
    gate, up = h[:, :inter], h[:, inter:]
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [N, H]


def combine_slots(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Step 3: rows in expert order -> [T, H], each token's slots summed with its routing weights."""
    num_tokens, k = topk_weights.shape
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # back to (token, slot) order; a permutation, so no accumulation
    # [T, 1, k] @ [T, k, H]: the weighted sum over slots with fp32 accumulation, deterministic.
    return torch.bmm(topk_weights.to(y.dtype).unsqueeze(1), y.view(num_tokens, k, -1)).squeeze(1)  # [T, H]


__all__ = ["GroupedMoEExecutor", "check_grouped_support", "combine_slots", "expert_rows", "pack_expert_weights",
           "sort_by_expert"]
