"""Small-batch MoE in Triton: the routed experts and the router for decode and short verify steps,
where the expert GEMMs are matrix-vector products and the time is the expert weights' bytes.

    fused_moe_small(hidden [T, H], topk_ids [T, k], topk_weights [T, k], w13 [E, 2I, H], w2 [E, H, I]) -> [T, H]
    route_topk(logits [T, E], k, norm_topk_prob) -> (topk_ids [T, k] int64, topk_weights [T, k])

Experts (two kernels, no sort, no gather, no host sync):
  A. one program per ((token, slot) pair, tile of I rows): reads its expert's gate and up rows of
     `w13` straight through `topk_ids`, `a = silu(x @ gate^T) * (x @ up^T) * routing weight`
     -> `act [T*k, I]` fp32. The routing weight is folded in here so that B is one flat reduction.
  B. one program per (token, tile of H rows): `y[t] = sum over slots j, in order, of act[t, j] @ w2[e_j]^T`
     -> `[T, H]`. The combine over k is part of the reduction: no atomics and a fixed summation
     order, so results are deterministic and a token's row does not depend on the batch around it.
Accumulation is fp32 throughout; only the output is rounded to hidden's dtype.

Tiles are picked from the static shape so both grids have at least ~2 programs per SM (T=1 on the
Qwen3-30B-A3B shape: A 8 x 48 = 384 programs, B 256), enough weight streams to keep HBM busy.
Everything depends only on host ints fixed for a captured shape: CUDA-graph capturable.

The switch is the process-wide fused-ops setting (`tandem.kernels.fused.set_fused_ops`): it gates
the grouped executor's small-T dispatch and `SparseMoeBlock.route` on CUDA. On CPU these kernels
run only when asked for explicitly, under TRITON_INTERPRET=1, in tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fused import fused_ops_enabled
from tandem.kernels.device import sm_count

# The grouped executor sends a step here when T * k is at most this; larger batches reuse each
# expert's weights across enough rows for the grouped GEMMs to win.
SMALL_MAX_PAIRS = 64


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, wts_ptr, w13_ptr, act_ptr,  # x [T, H]; ids, wts [T*k]; w13 [E, 2I, H]; act [T*k, I] fp32
    K, H, I, limit,
    stride_xt, stride_we, stride_wn, stride_at,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CLAMP: tl.constexpr,
):
    pair = tl.program_id(0)  # token * K + slot
    tile = tl.program_id(1)
    tok = pair // K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of gate (and of up, I rows further on)
    n_ok = offs_n < I
    gate_rows = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + I * stride_wn
    x_row = x_ptr + tok.to(tl.int64) * stride_xt
    # 2-D accumulators, reduced once at the end: the loop body is loads and FMAs only.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_K]
        w_ok = n_ok[:, None] & k_ok[None, :]
        g = tl.load(gate_rows + offs_k[None, :], mask=w_ok, other=0.0)  # [BLOCK_N, BLOCK_K]
        u = tl.load(up_rows + offs_k[None, :], mask=w_ok, other=0.0)
        acc_g += g.to(tl.float32) * x
        acc_u += u.to(tl.float32) * x
    gate = tl.sum(acc_g, 1)  # [BLOCK_N]
    up = tl.sum(acc_u, 1)
    weight = tl.load(wts_ptr + pair).to(tl.float32)
    if CLAMP:  # DeepSeek-V4's SwiGLU: gate <= limit, |up| <= limit
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate / (1.0 + tl.exp(-gate)) * up * weight  # silu(gate) * up, times the routing weight
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + offs_n, act, mask=n_ok)


@triton.jit
def _down_combine_kernel(
    act_ptr, ids_ptr, w2_ptr, out_ptr,  # act [T*k, I] fp32; ids [T*k]; w2 [E, H, I]; out [T, H]
    K, H, I,
    stride_at, stride_we, stride_wn, stride_ot,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_KB: tl.constexpr,
):
    tok = tl.program_id(0)
    tile = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    n_ok = offs_n < H
    row_offs = offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # One flat loop over (slot, block of I) in a fixed order: the weighted sum over slots is the
    # same reduction as the dot product, so the combine costs nothing and is deterministic.
    for it in range(0, K * NUM_KB):
        slot = it // NUM_KB
        offs_k = (it % NUM_KB) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        pair = (tok * K + slot).to(tl.int64)
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a = tl.load(act_ptr + pair * stride_at + offs_k, mask=k_ok, other=0.0)  # [BLOCK_K] fp32
        w = tl.load(w2_ptr + expert * stride_we + row_offs + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, 1)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


# Weight-tile elements per program and loop step: with 8 warps, 32 fp32 accumulator registers per
# thread per tile (kernel A holds two), so nothing spills.
_MAX_TILE = 8192

def _target_programs(device: torch.device) -> int:
    """~2 programs per SM: enough independent weight streams to saturate HBM on a GEMV. The
    interpreter (CPU) is sized as an H200 (132 SMs) so tests tile as the GPU does."""
    return 2 * (sm_count(device) or 132)


def _pick_block_n(rows: int, programs_per_tile: int, target: int) -> int:
    """The largest row tile that still gives `target` programs (else the smallest, 8)."""
    for block in (32, 16, 8):
        if programs_per_tile * triton.cdiv(rows, block) >= target:
            return block
    return 8


def fused_moe_small(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """Routed experts for a small batch, the same contract as a MoE executor:
    hidden [T, H], topk_ids [T, k] (int), topk_weights [T, k], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    in hidden's dtype; `limit` clamps the pre-activations as DeepSeek-V4's experts do. Meant for T * k <= SMALL_MAX_PAIRS: each (token, slot) reads its expert's
    weights itself, so an expert shared by several tokens is read once per token (L2 helps)."""
    num_tokens, k = topk_ids.shape
    inter, hidden_size = w13.shape[1] // 2, w13.shape[2]
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)  # [T, H]
    if num_tokens == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe_small needs the packed expert stacks with contiguous rows (pack_expert_weights)")
    ids = topk_ids.reshape(-1)  # [T*k]
    wts = topk_weights.reshape(-1)  # [T*k]
    pairs = num_tokens * k
    target = _target_programs(hidden.device)

    act = torch.empty(pairs, inter, dtype=torch.float32, device=hidden.device)  # [T*k, I]
    block_n = _pick_block_n(inter, pairs, target)
    block_k = min(_MAX_TILE // block_n, 512, triton.next_power_of_2(hidden_size))
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_n))](
        hidden, ids, wts, w13, act, k, hidden_size, inter, 0.0 if limit is None else float(limit),
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, CLAMP=limit is not None, num_warps=8 if block_n * block_k >= _MAX_TILE else 4,
    )

    # At T=1 one block spans all of I (I=768 -> 1024 lanes, 768 live): a whole slot's rows per
    # load keeps many bytes in flight per program.
    block_n = _pick_block_n(hidden_size, num_tokens, target)
    block_k = min(_MAX_TILE // block_n, triton.next_power_of_2(inter))
    _down_combine_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
        act, ids, w2, out, k, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_KB=triton.cdiv(inter, block_k),
        num_warps=8 if block_n * block_k >= _MAX_TILE else 4,
    )
    return out


@triton.jit
def _route_kernel(
    logits_ptr, ids_ptr, wts_ptr,  # logits [T, E]; ids [T, K] int64; wts [T, K]
    E, stride_lt, stride_it, stride_wt,
    K: tl.constexpr, K_P: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    live = offs < E
    logits = tl.load(logits_ptr + tok * stride_lt + offs, mask=live, other=float("-inf")).to(tl.float32)
    top = tl.max(logits, 0)
    total = tl.sum(tl.where(live, tl.exp(logits - top), 0.0), 0)  # softmax denominator
    # Rank by logit: softmax is monotonic, so for distinct probabilities the order is torch.topk's;
    # ties go to the lowest expert id.
    cand = tl.where(live, logits, float("-inf"))
    offs_k = tl.arange(0, K_P)
    sel_w = tl.zeros([K_P], dtype=tl.float32)
    sel_i = tl.zeros([K_P], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(cand, 0)
        idx = tl.min(tl.where(cand == best, offs, BLOCK_E), 0)
        idx = tl.minimum(idx, E - 1)  # NaN logits match nothing: keep the id a valid expert
        sel_w = tl.where(offs_k == j, tl.exp(best - top) / total, sel_w)
        sel_i = tl.where(offs_k == j, idx.to(tl.int64), sel_i)
        cand = tl.where(offs == idx, float("-inf"), cand)
    if NORM:
        sel_w = sel_w / tl.sum(sel_w, 0)  # lanes >= K hold 0
    k_ok = offs_k < K
    tl.store(ids_ptr + tok * stride_it + offs_k, sel_i, mask=k_ok)
    tl.store(wts_ptr + tok * stride_wt + offs_k, sel_w.to(wts_ptr.dtype.element_ty), mask=k_ok)


def route_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) + top-k (+ renormalise over the k when `norm_topk_prob`) in one kernel, one
    program per token: logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] in `out_dtype`,
    default logits' dtype). Same result as SparseMoeBlock's torch routing (ids equal for distinct
    probabilities, weights to fp32 rounding)."""
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)  # [T, k]
    wts = torch.empty(num_tokens, top_k, dtype=out_dtype or logits.dtype, device=logits.device)  # [T, k]
    if num_tokens == 0:
        return ids, wts
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits, ids, wts, num_experts, logits.stride(0), ids.stride(0), wts.stride(0),
        K=top_k, K_P=triton.next_power_of_2(top_k), BLOCK_E=block_e, NORM=bool(norm_topk_prob),
        num_warps=4 if block_e >= 512 else 1,
    )
    return ids, wts


__all__ = ["SMALL_MAX_PAIRS", "fused_moe_small", "fused_ops_enabled", "route_topk"]
