"""Projections that read the same input stacked into one weight, so that a step computes them in
one GEMM (q/k/v: `Attention.stack_qkv`; a dense layer's gate/up: `SwiGLUMLP.stack_gate_up`). At
decode each projection is a GEMV bound by its launch more than by its bytes (on the H100, 4.7 us
for a 4 MB k or v against 13.6 us for a 33 MB q: issue 16's profile of the V4 shape)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


Stacked = tuple[torch.Tensor, torch.Tensor | None]  # (weight [sum of out_features, in], bias or None)


def stack_linears(linears: Sequence[nn.Linear], previous: Stacked | None) -> Stacked:
    """The linears' weights (and biases) stacked in order, each linear's weight and bias re-pointed
    at its rows (new Parameters aliasing the stack: no copy, names and `state_dict` keys unchanged,
    each weight held once). `previous`: what an earlier call returned, given back while the first
    linear's weight still starts it (an engine built again on the same model asks again)."""
    first = linears[0]
    if previous is not None and first.weight.data_ptr() == previous[0].data_ptr():
        return previous
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if first.bias is not None else None
    at = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[at : at + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[at : at + rows], requires_grad=False)
        at += rows
    return weight, bias
