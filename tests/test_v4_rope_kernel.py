"""The DeepSeek-V4 norm + rotary-tail kernel (tandem/kernels/deepseek_v4_rope.py) against the torch
path it replaces in decode steps (`unweighted_rms_norm` / `RMSNorm` then `apply_rope_tail`, and the
window write of deepseek_v4_decode.py): the attention's q (unweighted norm), its K=V row (kv_norm,
stored to the window's pages), the indexer's q (rotary only) and the output's rotation back, at
float32 and bfloat16. Without CUDA the kernel runs in Triton's interpreter on tiny shapes; with CUDA
(`-m gpu`) on V4-Flash's shapes, also replayed from a graph."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpret_without_cuda, interpreted_module, kernel_test_setup  # noqa: F401 (autouse)

interpret_without_cuda()  # before anything imports Triton

from tandem.models.deepseek_v4_attention import (  # noqa: E402
    InterleavedRotary,
    apply_rope_tail,
    unweighted_rms_norm,
)
from tandem.models.layers.norm import RMSNorm  # noqa: E402
from tandem.models.layers.rotary import RopeConfig  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPS = 1e-6


@pytest.fixture(scope="module")
def rope():
    yield from interpreted_module("tandem.kernels.deepseek_v4_rope", "_rope_tail_kernel", language=True)


def inputs(tokens: int, heads: int, head_dim: int, rope_dim: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, heads, head_dim, generator=g) * 3).to(device, dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=g).to(device)
    rotary = InterleavedRotary(rope_dim, RopeConfig(theta=160000.0)).to(device)
    cos, sin = rotary(positions, dtype)  # [T, rope_dim / 2]
    return x, cos, sin


def close(got: torch.Tensor, want: torch.Tensor, exact: bool, device: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:  # the same float32 operations in the same order
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    elif got.dtype == torch.float32:  # the norm's statistic summed in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16: that statistic can move a rounding by an ulp (and the interpreter truncates)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-5 if device == "cpu" else 2**-7)
        if device == "cuda":
            assert (got != want).float().mean() < 0.01


def check_all(rope, tokens: int, heads: int, head_dim: int, rope_dim: int, index_dim: int, dtype: torch.dtype,
              device: str) -> None:
    x, cos, sin = inputs(tokens, heads, head_dim, rope_dim, dtype, device)
    # the attention's q: per-head unweighted norm, then the rotary tail
    want = apply_rope_tail(unweighted_rms_norm(x, EPS), cos[:, None], sin[:, None])
    close(rope.deepseek_v4_rope_tail(x, cos, sin, norm="unweighted", eps=EPS), want, False, device)
    # the output's rotation back: no norm, sin negated (bit for bit: elementwise only)
    want = apply_rope_tail(x, cos[:, None], -sin[:, None])
    exact = dtype == torch.float32 or device == "cuda"
    close(rope.deepseek_v4_rope_tail(x, cos, sin, inverse=True), want, exact, device)
    # the indexer's q: rotary only, at its own head dim
    xi, _, _ = inputs(tokens, heads, index_dim, rope_dim, dtype, device, seed=1)
    close(rope.deepseek_v4_rope_tail(xi, cos, sin), apply_rope_tail(xi, cos[:, None], sin[:, None]), exact, device)
    # the K=V row: kv_norm (weighted RMSNorm), the rotary tail, and the window write
    norm = RMSNorm(head_dim, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(head_dim, generator=torch.Generator().manual_seed(2)) + 0.5)
    norm = norm.to(device, dtype)
    kv = x[:, :1]  # [T, 1, D]
    want = apply_rope_tail(norm(kv[:, 0]), cos, sin)  # [T, D]
    pages = torch.zeros(1, 5, 4, 1, head_dim, dtype=dtype, device=device)  # [1, N + 1, bs, 1, D]
    slots = torch.randperm(20, generator=torch.Generator().manual_seed(3))[:tokens].to(device)
    got = rope.deepseek_v4_rope_tail(kv, cos, sin, norm=norm.weight, eps=EPS, pages=pages, slots=slots)
    close(got[:, 0], want, False, device)
    flat = pages.view(-1, head_dim)
    assert torch.equal(flat[slots], got[:, 0])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched[slots] = False
    assert not flat[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,heads", [(1, 4), (3, 5)])  # 5 heads: a partial head tile
def test_rope_tail_matches_the_torch_path(rope, dtype, tokens, heads) -> None:
    check_all(rope, tokens, heads, head_dim=32, rope_dim=8, index_dim=16, dtype=dtype, device="cpu")


def test_the_whole_head_rotated(rope) -> None:
    """rope_dim == head_dim: no pass-through channels."""
    x, cos, sin = inputs(2, 3, 16, 16, torch.float32, "cpu")
    torch.testing.assert_close(rope.deepseek_v4_rope_tail(x, cos, sin), apply_rope_tail(x, cos[:, None], sin[:, None]),
                               rtol=0, atol=0)


def test_bad_shapes_are_refused(rope) -> None:
    x, cos, sin = inputs(2, 3, 16, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        rope.deepseek_v4_rope_tail(x, cos[:1], sin[:1])
    with pytest.raises(ValueError, match="norm weight"):
        rope.deepseek_v4_rope_tail(x, cos, sin, norm=torch.ones(8))
    with pytest.raises(ValueError, match="one head"):
        rope.deepseek_v4_rope_tail(x, cos, sin, pages=torch.zeros(4, 16), slots=torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 5])
def test_on_cuda_v4_flash_shapes(rope, tokens) -> None:
    check_all(rope, tokens, heads=64, head_dim=512, rope_dim=64, index_dim=128, dtype=torch.bfloat16, device="cuda")
    check_all(rope, tokens, heads=64, head_dim=512, rope_dim=64, index_dim=128, dtype=torch.float32, device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_graph_replay_matches_eager(rope) -> None:
    x, cos, sin = inputs(4, 64, 512, 64, torch.bfloat16, "cuda")

    def run():
        return rope.deepseek_v4_rope_tail(x, cos, sin, norm="unweighted", eps=EPS)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    x.copy_(inputs(4, 64, 512, 64, torch.bfloat16, "cuda", seed=5)[0])
    graph.replay()
    torch.testing.assert_close(got, run(), rtol=0, atol=0)
