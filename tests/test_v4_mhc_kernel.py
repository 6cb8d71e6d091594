"""The DeepSeek-V4 mHC kernels (tandem/kernels/deepseek_v4_mhc.py) against `HyperConnection`'s torch
reference (tandem/models/deepseek_v4.py): the norm + linear map as split-K partials, the collapsed
block input, post, the Sinkhorn-projected comb, `HyperHead`'s collapse, and the merge (with the
MoE's two parts summed in it), at float32 and bfloat16, with N a power of two and not, a broadcast (stride-0)
view of the streams, one Sinkhorn pass and many. Without CUDA the kernels run in Triton's
interpreter on tiny shapes; with CUDA (`-m gpu`) on V4-Flash's shape, also replayed from a graph.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpret_without_cuda, interpreted_module, kernel_test_setup  # noqa: F401 (autouse)

interpret_without_cuda()  # before anything imports Triton

from tandem.models.deepseek_v4 import HyperConnection  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def mhc():
    yield from interpreted_module("tandem.kernels.deepseek_v4_mhc", "_hc_pre_kernel", language=True)


def make_hc(n: int, hidden: int, iters: int, dtype: torch.dtype, device: str, seed: int = 0) -> HyperConnection:
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(hidden, n, iters, 1e-6, 1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * (n * hidden) ** -0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return hc.to(device=device, dtype=dtype)


def streams_of(tokens: int, n: int, hidden: int, dtype: torch.dtype, device: str, broadcast: bool,
               seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if broadcast:  # the first layer's input: N copies of the embedding, a stride-0 view
        return torch.randn(tokens, hidden, generator=g).to(device, dtype).unsqueeze(1).expand(-1, n, -1)
    return torch.randn(tokens, n, hidden, generator=g).to(device, dtype)


def check(mhc, n: int, hidden: int, tokens: int, iters: int, dtype: torch.dtype, device: str, broadcast: bool) -> None:
    hc = make_hc(n, hidden, iters, dtype, device)
    streams = streams_of(tokens, n, hidden, dtype, device, broadcast)
    ref = hc(streams)
    got = hc(streams, kernel=True)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    fp32 = dtype == torch.float32
    # float32: the same operations up to summation order and exp's rounding; bfloat16: the
    # collapsed input is rounded once, one ulp (2^-8 relative) either side.
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5 if fp32 else 2**-7, atol=1e-5 if fp32 else 1e-2)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-4, atol=1e-6)
    sums = ref[2].sum(dim=-2)  # the columns sum to ~1 after the last (column) pass: a real Sinkhorn
    torch.testing.assert_close(got[2].sum(dim=-2), sums, rtol=1e-5, atol=1e-5)
    assert (sums - 1).abs().max() < 1e-3
    g = torch.Generator().manual_seed(2)
    block_out = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    merged_ref = HyperConnection.merge(streams, block_out, ref[1], ref[2])
    merged = HyperConnection.merge(streams, block_out, ref[1], ref[2], kernel=True)
    assert merged.shape == (tokens, n, hidden) and merged.dtype == dtype
    if fp32:
        torch.testing.assert_close(merged, merged_ref, rtol=1e-5, atol=1e-5)
    else:  # bfloat16: both round twice (the mix, then the sum); measured against float64 on the same
        # rounded inputs, the kernel is as close as the reference.
        truth = (ref[1].to(dtype).double()[..., None] * block_out.double()[:, None]
                 + torch.einsum("tjk,tjh->tkh", ref[2].to(dtype).double(), streams.double()))
        err, ref_err = (merged.double() - truth).abs().max(), (merged_ref.double() - truth).abs().max()
        if device == "cuda":  # (cuBLAS's bf16 batched matmul under the reference rounds differently: ~27% of
            assert err <= 1.5 * ref_err + 1e-3, (err, ref_err)  # the values differ by an ulp on the H200)
        else:  # Triton 3.6's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest)
            assert err <= 4 * ref_err + 1e-3, (err, ref_err)


@pytest.mark.parametrize("n,hidden,tokens,iters,dtype,broadcast", [
    (4, 40, 3, 20, torch.float32, False),  # V4's N and iterations; H not a multiple of the tile
    (4, 24, 2, 20, torch.float32, True),
    (3, 16, 2, 5, torch.float32, False),  # N not a power of two: padded lanes
    (4, 16, 1, 1, torch.float32, False),  # one Sinkhorn pass (the row softmax and one column pass)
    (4, 32, 4, 20, torch.bfloat16, False),
])
def test_hc_kernels_match_the_reference(mhc, n, hidden, tokens, iters, dtype, broadcast) -> None:
    check(mhc, n, hidden, tokens, iters, dtype, "cpu", broadcast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_mix_partials_sum_to_the_linear_map(mhc, dtype, broadcast) -> None:
    """N*H = 1200: three split-K partials (the last one partial), their sum the norm + linear map."""
    n, hidden, tokens = 4, 300, 3
    hc = make_hc(n, hidden, 20, dtype, "cpu")
    streams = streams_of(tokens, n, hidden, dtype, "cpu", broadcast)
    parts = mhc.deepseek_v4_hc_mix(streams, hc.fn, hc.norm_eps)
    assert parts.shape == (tokens, 3, (2 + n) * n) and parts.dtype == torch.float32
    flat = streams.flatten(-2).float()
    want = torch.nn.functional.linear(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + hc.norm_eps),
                                      hc.fn.float())
    torch.testing.assert_close(parts.sum(dim=1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_and_summed_merge_match_the_reference(mhc, dtype) -> None:
    from tandem.models.deepseek_v4 import HyperHead

    n, hidden, tokens = 4, 200, 2
    g = torch.Generator().manual_seed(4)
    head = HyperHead(hidden, n, 1e-6, 1e-6)
    with torch.no_grad():
        head.hc_fn.copy_(torch.randn(head.hc_fn.shape, generator=g) * (n * hidden) ** -0.5)
        head.hc_base.copy_(torch.randn(n, generator=g))
        head.hc_scale.fill_(0.7)
    head = head.to(dtype=dtype)
    streams = streams_of(tokens, n, hidden, dtype, "cpu", False)
    fp32 = dtype == torch.float32
    torch.testing.assert_close(head(streams, kernel=True), head(streams), rtol=1e-5 if fp32 else 2**-7,
                               atol=1e-5 if fp32 else 1e-2)
    hc = make_hc(n, hidden, 20, dtype, "cpu")
    _, post, comb = hc(streams)
    a, b = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    got = HyperConnection.merge(streams, a, post, comb, kernel=True, block_out2=b)
    if fp32:
        torch.testing.assert_close(got, HyperConnection.merge(streams, a + b, post, comb), rtol=1e-5, atol=1e-5)
    else:  # the sum rounded as torch rounds it: the merge of the rounded sum (the interpreter truncates)
        torch.testing.assert_close(got.float(), HyperConnection.merge(streams, a + b, post, comb, kernel=True).float(),
                                   rtol=2**-6, atol=2**-5)


def test_hc_kernels_refuse_bad_shapes(mhc) -> None:
    streams = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="mixes must be float32"):
        mhc.deepseek_v4_hc_pre(streams, torch.randn(2, 23), torch.zeros(24), torch.ones(3), 1e-6, 20)
    with pytest.raises(ValueError, match="iters"):
        mhc.deepseek_v4_hc_pre(streams, torch.randn(2, 24), torch.zeros(24), torch.ones(3), 1e-6, 0)
    with pytest.raises(ValueError, match="block_out"):
        mhc.deepseek_v4_hc_merge(streams, torch.randn(2, 9), torch.rand(2, 4), torch.rand(2, 4, 4))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("broadcast", [False, True])
def test_on_cuda_v4_flash_shape(mhc, tokens, broadcast) -> None:
    check(mhc, 4, 4096, tokens, 20, torch.bfloat16, "cuda", broadcast)
    check(mhc, 4, 4096, tokens, 20, torch.float32, "cuda", broadcast)
    hc = make_hc(4, 4096, 20, torch.bfloat16, "cuda")
    streams = streams_of(tokens, 4, 4096, torch.bfloat16, "cuda", broadcast)
    parts = mhc.deepseek_v4_hc_mix(streams, hc.fn, hc.norm_eps)  # [T, 32, 24]
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + hc.norm_eps)
    torch.testing.assert_close(parts.sum(dim=1), torch.nn.functional.linear(flat, hc.fn.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_graph_replay_matches_eager(mhc) -> None:
    hc = make_hc(4, 4096, 20, torch.bfloat16, "cuda")
    streams = streams_of(4, 4, 4096, torch.bfloat16, "cuda", False)
    block_out = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)

    def run():
        collapsed, post, comb = hc(streams, kernel=True)
        return collapsed, HyperConnection.merge(streams, block_out, post, comb, kernel=True)

    want = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        got = run()
    streams.copy_(streams_of(4, 4, 4096, torch.bfloat16, "cuda", False, seed=5))
    graph.replay()
    want = run()
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
