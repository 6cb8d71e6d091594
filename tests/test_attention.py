"""The Triton paged-attention backend against the torch reference.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, exact but slow: tiny
shapes only). Triton 3.6 decides interpreter-or-compiler when a kernel is *decorated*, i.e. when
`tandem.attention.triton_paged` is imported, so the variable is set here, before that import.
"""

import os
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.attention import get_attention_backend  # noqa: E402
from tandem.kv.tensors import FP8_MAX, quantize_fp8  # noqa: E402
from triton_interp import interpreted_module  # noqa: E402
from tandem.core import StepMetadata  # noqa: E402

# Small cases run on the interpreter without CUDA and as compiled kernels with it.
SMALL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def triton_paged():
    yield from interpreted_module("tandem.attention.triton_paged", "_paged_attention_kernel")


def make_case(q_lens, seq_lens, *, hq, hkv, d, block_size=16, dtype=torch.float32, device="cpu", seed=0,
              extra_blocks=3):
    """Random paged-cache case: each request's blocks are scattered in reverse order over the pool
    (non-contiguous), the cache already holds its first seq_len - q_len tokens, and the step writes
    the remaining q_len. Returns (q, k, v, kv_cache, step)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(n_blocks) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for n, s, ql in zip(n_blocks, seq_lens, q_lens):
        ids = sorted(perm[:n], reverse=True)
        perm = perm[n:]
        tables.append(ids)
        slots.extend(ids[p // block_size] * block_size + p % block_size for p in range(s - ql, s))
    width = max(n_blocks) + 2
    table = torch.tensor([t + [perm[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
    T = sum(q_lens)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    step = StepMetadata(
        request_ids=tuple(f"r{i}" for i in range(len(q_lens))),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=(table.to(device),),
        slot_mappings=(torch.tensor(slots, dtype=torch.int64, device=device),),
        logits_indices=torch.tensor(qsl[1:], dtype=torch.int64, device=device) - 1,
        query_start_loc_cpu=tuple(qsl),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
        max_query_len=max(q_lens),
    )
    return q.to(device), k.to(device), v.to(device), cache.to(device), step


def run_both(backend, q, k, v, cache, step, scale=None):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    ref_cache = cache.clone()
    ref = get_attention_backend("torch").forward(q, k, v, ref_cache, step, 0, scale)
    out = backend.forward(q, k, v, cache, step, 0, scale)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # both wrote the same slots
    return out, ref


# (q_lens, seq_lens): decode at different lengths; verify (1+K = 3); a request decoding next to one
# prefilling a chunk after cached tokens; a request whose whole prompt is this step's chunk.
CPU_CASES = {
    "decode": ([1, 1, 1], [5, 140, 17]),
    "verify": ([3, 3], [3, 135]),
    "mixed": ([1, 80], [133, 180]),
    "prefill": ([100, 1], [100, 16]),
}


@pytest.mark.parametrize("heads", [(4, 2), (8, 1)], ids=["gqa4:2", "gqa8:1"])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_triton_matches_torch_cpu(triton_paged, case, heads):
    hq, hkv = heads
    q_lens, seq_lens = CPU_CASES[case]
    q, k, v, cache, step = make_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=64, device=SMALL_DEVICE)
    out, ref = run_both(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv_matches_torch_cpu(triton_paged, splits):
    # Split-KV decode (flash-decoding) and its merge; 4 splits of a 5-token cache leave some empty.
    q, k, v, cache, step = make_case([1, 1, 2], [5, 70, 41], hq=4, hkv=2, d=64, device=SMALL_DEVICE)
    out, ref = run_both(triton_paged.TritonPagedAttention(num_kv_splits=splits), q, k, v, cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_q_k_v_as_views_of_one_projection_cpu(triton_paged):
    """q, k and v as column views of one [T, (Hq + 2 Hkv) D] output (`Attention.stack_qkv`):
    rows strided past Hq D, written and attended as the contiguous tensors are."""
    q, k, v, cache, step = make_case([1, 3, 20], [9, 40, 20], hq=4, hkv=2, d=64, device=SMALL_DEVICE)
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    q2, k2, v2 = (x.view(T, -1, 64) for x in qkv.split((4 * 64, 2 * 64, 2 * 64), dim=1))
    assert not k2.is_contiguous() and not v2.is_contiguous()
    want_cache = cache.clone()
    want = triton_paged.TritonPagedAttention().forward(q, k, v, want_cache, step, 0, 64**-0.5)
    out, ref = run_both(triton_paged.TritonPagedAttention(), q2, k2, v2, cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0)


def test_head_dim_128_and_block_size_32_cpu(triton_paged):
    q, k, v, cache, step = make_case([2, 1], [40, 9], hq=2, hkv=1, d=128, block_size=32, device=SMALL_DEVICE)
    out, ref = run_both(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_fp16_cpu(triton_paged):
    q, k, v, cache, step = make_case([1, 3], [70, 90], hq=4, hkv=2, d=64, dtype=torch.float16, device=SMALL_DEVICE)
    out, ref = run_both(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


def test_zero_length_request_outputs_zeros_cpu(triton_paged):
    # Not produced by the runner, but must not read out of range or emit NaN.
    q, k, v, cache, step = make_case([1, 1], [9, 1], hq=4, hkv=2, d=64, device=SMALL_DEVICE)
    step = StepMetadata(**{**step.__dict__, "seq_lens": torch.tensor([9, 0], dtype=torch.int32, device=SMALL_DEVICE)})
    out = triton_paged.TritonPagedAttention().forward(q, k, v, cache, step, 0, 0.125)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()


def test_unsupported_head_dim_is_refused(triton_paged):
    q, k, v, cache, step = make_case([1], [3], hq=2, hkv=1, d=48, device=SMALL_DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        triton_paged.TritonPagedAttention().forward(q, k, v, cache, step, 0, 0.1)


def test_max_query_len_prefers_the_step_field(triton_paged):
    assert triton_paged._max_query_len(SimpleNamespace(max_query_len=7, query_start_loc_cpu=(0, 1))) == 7
    assert triton_paged._max_query_len(SimpleNamespace(query_start_loc_cpu=(0, 1, 4, 6))) == 3


# --- real CUDA, bf16, model-sized shapes ---------------------------------------------------------

GPU_CASES = {
    "decode": ([1] * 8, [3000, 1, 17, 512, 2999, 64, 1000, 3000]),
    "verify": ([4] * 8, [3000, 4, 17, 512, 2999, 64, 1000, 3000]),
    "mixed": ([1, 1, 700, 1, 1, 300, 1, 1], [3000, 5, 700, 200, 3000, 2800, 1, 99]),
    "prefill": ([2048], [3000]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.gpu
@needs_cuda
def test_triton_matches_torch_cuda(triton_paged, case, dtype):
    q_lens, seq_lens = GPU_CASES[case]
    q, k, v, cache, step = make_case(q_lens, seq_lens, hq=32, hkv=4, d=128, dtype=dtype, device="cuda", seed=1)
    out, ref = run_both(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_matches_eager(triton_paged, splits):
    """Capture once with fixed buffers, then change lengths, block tables and slots in place."""
    B, q_len, hq, hkv, d = 8, 3, 32, 4, 128
    backend = triton_paged.TritonPagedAttention(num_kv_splits=splits)
    first = make_case([q_len] * B, [q_len + 7 * i for i in range(B)], hq=hq, hkv=hkv, d=d,
                      dtype=torch.bfloat16, device="cuda", seed=2, extra_blocks=1000)
    q, k, v, cache, step = (t.clone() if torch.is_tensor(t) else t for t in first)
    # The graph reads these buffers; each replay refills them.
    table = torch.zeros(B, 256, dtype=torch.int32, device="cuda")
    table[:, : step.block_tables[0].shape[1]] = step.block_tables[0]
    static = StepMetadata(**{**step.__dict__, "block_tables": (table,), "seq_lens": step.seq_lens.clone(),
                             "slot_mappings": (step.slot_mappings[0].clone(),)})
    scale = d**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # JIT outside the graph
            backend.forward(q, k, v, cache, static, 0, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, static, 0, scale)

    for seed, lens in ((3, [3000, 4, 2000, 1500, 3, 700, 2999, 64]), (4, [5, 3000, 3, 40, 1024, 1025, 17, 2500])):
        q2, k2, v2, cache2, step2 = make_case([q_len] * B, lens, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16,
                                              device="cuda", seed=seed, extra_blocks=3)
        assert cache2.shape[1] <= cache.shape[1]
        cache.zero_()
        cache[:, : cache2.shape[1]].copy_(cache2)
        for dst, src in ((q, q2), (k, k2), (v, v2), (static.seq_lens, step2.seq_lens),
                         (static.slot_mappings[0], step2.slot_mappings[0])):
            dst.copy_(src)
        table.zero_()
        table[:, : step2.block_tables[0].shape[1]] = step2.block_tables[0]
        graph.replay()
        eager_cache = cache2.clone()
        eager = backend.forward(q2, k2, v2, eager_cache, step2, 0, scale)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        _, ref = run_both(get_attention_backend("torch"), q2, k2, v2, cache2.clone(), step2)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


# --- fp8 pages (--kv-cache-dtype fp8): one float32 scale per token and KV head ----------------------


@contextmanager
def exact_interpreted_fp8_cast():
    """Triton 3.6's interpreter rounds fp32 -> float8e4nv without carrying a rounded-up mantissa into
    the exponent (127.7 becomes 64, not 128); while open, cast through torch's round-to-nearest-even,
    as the GPU's cvt.rn does. Upcasts from fp8 are exact in the interpreter and left alone."""
    if torch.cuda.is_available():
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_fp_to_fp = InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp_exact(self, src, dst_type, rounding_mode):  # noqa: ANN001
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32:
            return create_fp_to_fp(self, src, dst_type, rounding_mode)
        data = torch.from_numpy(src.data).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return TensorHandle(data, dst_type.scalar)

    InterpreterBuilder.create_fp_to_fp = create_fp_to_fp_exact
    try:
        yield
    finally:
        InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def run_fp8(backend, q, k, v, cache, step, scale=None):
    """`backend` and the torch reference on the fp8 form of `cache`, and the torch reference on
    `cache` itself -> (out, ref, exact, (pages, scales) as `backend` left them)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    torch_ref = get_attention_backend("torch")
    exact = torch_ref.forward(q, k, v, cache.clone(), step, 0, scale)
    pages, scales = quantize_fp8(cache)  # the cache's earlier tokens as fp8 pages and their scales
    ref_pages, ref_scales = pages.clone(), scales.clone()
    ref = torch_ref.forward(q, k, v, ref_pages, step, 0, scale, kv_scales=ref_scales)
    with exact_interpreted_fp8_cast():
        out = backend.forward(q, k, v, pages, step, 0, scale, kv_scales=scales)
    # Both wrote the same bytes and scales into the same slots. On CUDA torch divides amax by 448 as
    # a multiplication by its reciprocal (1 ulp off an IEEE division, which the kernel does), so a
    # scale may differ by that ulp there, and a byte by one code where x / s sits on a rounding edge.
    if q.is_cuda:
        torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
        codes = (pages.view(torch.uint8).int() - ref_pages.view(torch.uint8).int()).abs()
        assert codes.max() <= 1 and (codes > 0).float().mean() < 1e-3
    else:
        assert torch.equal(pages.view(torch.uint8), ref_pages.view(torch.uint8))
        torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    return out, ref, exact, (pages, scales)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_written(pages, scales, k, v, slots):
    """The step's K/V sit at `slots` as fp8 with scale amax / 448 per (token, head) vector."""
    assert pages.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    hkv, d = pages.shape[-2:]
    for i, x in enumerate((k, v)):
        stored = pages[i].view(torch.uint8).reshape(-1, hkv, d)[slots].view(pages.dtype)  # [T, Hkv, D]
        scale = scales[i].reshape(-1, hkv)[slots]  # [T, Hkv]
        x = x.float()
        amax = x.abs().amax(dim=-1)
        # One ulp: torch's float division on CUDA is not always IEEE-rounded, the kernel's is.
        torch.testing.assert_close(scale, amax.clamp(min=1e-12) / FP8_MAX, rtol=2**-23, atol=0)
        # The largest element of each (nonzero) vector lands on fp8's max, and all round to within
        # half an ulp (3 mantissa bits: 2^-4 relative; the fixed floor covers the subnormals).
        assert torch.equal(stored.float().abs().amax(dim=-1), torch.where(amax > 0, FP8_MAX, 0.0))
        err = (stored.float() * scale[..., None] - x).abs()
        assert (err <= x.abs() * 2**-4 + scale[..., None] * 2**-10).all()


@pytest.mark.parametrize("heads", [(4, 2), (8, 1)], ids=["gqa4:2", "gqa8:1"])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_fp8_pages_match_torch_cpu(triton_paged, case, heads):
    hq, hkv = heads
    q_lens, seq_lens = CPU_CASES[case]
    q, k, v, cache, step = make_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=64, device=SMALL_DEVICE)
    out, ref, exact, (pages, scales) = run_fp8(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    # (a) the kernel dequantizes to the same values the reference does (fp32 on both sides)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # (b) both are near the unquantized attention, and not equal to it: quantization happened
    for got in (out, ref):
        assert 1e-3 < rel_err(got, exact) < 0.1
    # (c) the step's K/V were written as fp8 with their scales
    check_written(pages, scales, k, v, step.slot_mappings[0])


@pytest.mark.parametrize("splits", [2, 4])
def test_fp8_split_kv_matches_torch_cpu(triton_paged, splits):
    q, k, v, cache, step = make_case([1, 1, 2], [5, 70, 41], hq=4, hkv=2, d=64, device=SMALL_DEVICE)
    out, ref, exact, _ = run_fp8(triton_paged.TritonPagedAttention(num_kv_splits=splits), q, k, v, cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert 1e-3 < rel_err(out, exact) < 0.1


def test_fp8_pages_fp16_queries_cpu(triton_paged):
    # Small V values: their scales (~1e-4) never enter an fp16 dot, the dequantized tile does.
    q, k, v, cache, step = make_case([1, 3], [70, 90], hq=4, hkv=2, d=64, dtype=torch.float16, device=SMALL_DEVICE)
    cache[1] *= 0.05
    v = v * 0.05
    out, ref, exact, _ = run_fp8(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-4)
    assert 1e-3 < rel_err(out, exact) < 0.1


def test_fp8_zero_vectors_and_extreme_scales_cpu(triton_paged):
    # An all-zero vector takes the 1e-12 floor (and stays zero); huge and tiny ones keep their scale.
    q, k, v, cache, step = make_case([2, 1], [20, 9], hq=4, hkv=2, d=64, device=SMALL_DEVICE)
    k[0] = 0.0
    v[1, 0] *= 1e4
    k[2, 1] *= 1e-6
    out, ref, _, (pages, scales) = run_fp8(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    check_written(pages, scales, k, v, step.slot_mappings[0])
    assert (scales[0].reshape(-1, 2)[step.slot_mappings[0][0]] == 1e-12 / FP8_MAX).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_pages_need_their_scales(triton_paged, backend):
    impl = triton_paged.TritonPagedAttention() if backend == "triton" else get_attention_backend("torch")
    q, k, v, cache, step = make_case([1], [3], hq=2, hkv=1, d=64, device=SMALL_DEVICE)
    pages, scales = quantize_fp8(cache)
    with pytest.raises(ValueError, match="need their scales"):
        impl.forward(q, k, v, pages, step, 0, 0.1)
    with pytest.raises(ValueError, match="float8_e4m3fn pages"):
        impl.forward(q, k, v, cache, step, 0, 0.1, kv_scales=scales)
    with pytest.raises(ValueError, match="one per stored vector"):
        impl.forward(q, k, v, pages, step, 0, 0.1, kv_scales=scales[:, 1:].contiguous())


@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.gpu
@needs_cuda
def test_fp8_pages_match_torch_cuda(triton_paged, case):
    q_lens, seq_lens = GPU_CASES[case]
    q, k, v, cache, step = make_case(q_lens, seq_lens, hq=32, hkv=4, d=128, dtype=torch.bfloat16, device="cuda",
                                     seed=1)
    out, ref, exact, (pages, scales) = run_fp8(triton_paged.TritonPagedAttention(), q, k, v, cache, step)
    # The two wrote the step's tokens with a byte one code apart on < 1e-3 of them (run_fp8), and
    # a code is 1/8 of a value: a few outputs move by more than bf16's tolerance (114 of 4.1M
    # in the mixed case on the H200, by at most 0.094), the rest agree.
    diff = (out.float() - ref.float()).abs()
    assert (diff > 2e-2 + 2e-2 * ref.float().abs()).float().mean() < 1e-4 and diff.max() < 0.25
    assert rel_err(out, exact) < 0.1
    check_written(pages, scales, k, v, step.slot_mappings[0])


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.gpu
@needs_cuda
def test_fp8_cuda_graph_replay_matches_eager(triton_paged, splits):
    """fp8 pages and scales under a captured graph: refilled in place, replay equals eager."""
    B, q_len, hq, hkv, d = 8, 3, 32, 4, 128
    backend = triton_paged.TritonPagedAttention(num_kv_splits=splits)
    q, k, v, cache, step = make_case([q_len] * B, [q_len + 7 * i for i in range(B)], hq=hq, hkv=hkv, d=d,
                                     dtype=torch.bfloat16, device="cuda", seed=2, extra_blocks=1000)
    pages, scales = quantize_fp8(cache)
    table = torch.zeros(B, 256, dtype=torch.int32, device="cuda")
    table[:, : step.block_tables[0].shape[1]] = step.block_tables[0]
    static = StepMetadata(**{**step.__dict__, "block_tables": (table,), "seq_lens": step.seq_lens.clone(),
                             "slot_mappings": (step.slot_mappings[0].clone(),)})
    scale = d**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # JIT outside the graph
            backend.forward(q, k, v, pages, static, 0, scale, kv_scales=scales)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, pages, static, 0, scale, kv_scales=scales)

    lens = [3000, 4, 2000, 1500, 3, 700, 2999, 64]
    q2, k2, v2, cache2, step2 = make_case([q_len] * B, lens, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16,
                                          device="cuda", seed=3, extra_blocks=3)
    pages2, scales2 = quantize_fp8(cache2)
    pages.view(torch.uint8).zero_()
    scales.zero_()
    pages[:, : pages2.shape[1]].copy_(pages2)
    scales[:, : scales2.shape[1]].copy_(scales2)
    for dst, src in ((q, q2), (k, k2), (v, v2), (static.seq_lens, step2.seq_lens),
                     (static.slot_mappings[0], step2.slot_mappings[0])):
        dst.copy_(src)
    table.zero_()
    table[:, : step2.block_tables[0].shape[1]] = step2.block_tables[0]
    graph.replay()
    eager = backend.forward(q2, k2, v2, pages2, step2, 0, scale, kv_scales=scales2)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert torch.equal(pages[:, : pages2.shape[1]].view(torch.uint8), pages2.view(torch.uint8))
