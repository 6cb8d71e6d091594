"""The fused Triton kernels (`tandem.kernels.fused`) against the torch code in the layers, which is
their reference: RMSNorm (+ residual add), per-head q/k RMSNorm + rotary, SiLU*up.

Without CUDA the kernels run in Triton's interpreter on tiny shapes (see tests/triton_interp.py), and
a whole tiny model runs with the layers forced onto the fused path. With CUDA (`-m gpu`) they run
compiled, in bf16/fp16/fp32, and a tiny fp32 model with fused ops must give transformers' tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interp import (check_interpreted, interpret_without_cuda, interpreted_language,  # noqa: F401
                           kernel_test_setup, numpy24_scalar_index)  # kernel_test_setup: an autouse fixture

interpret_without_cuda()  # before anything imports Triton

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.kernels import fused as fused_module  # noqa: E402
from tandem.models.layers.norm import RMSNorm  # noqa: E402
from tandem.models.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gpu = [pytest.mark.gpu, needs_cuda]
ATOL = 1e-5


@pytest.fixture(scope="module")
def fused():
    check_interpreted(fused_module._jit(fused_module._rms_norm_kernel))
    if torch.cuda.is_available():
        yield fused_module
        return
    with numpy24_scalar_index(), interpreted_language():
        yield fused_module


def _norm(dim: int, seed: int, dtype=torch.float32, device="cpu", eps: float = 1e-6) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    m = RMSNorm(dim, eps)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.3 * torch.randn(dim, generator=g))
    return m.to(device=device, dtype=dtype)


def _randn(*shape, seed: int, dtype=torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)


def _cos_sin(T: int, d: int, dtype=torch.float32, device="cpu", rope: RopeConfig | None = None):
    emb = RotaryEmbedding(d, rope or RopeConfig(theta=10000.0)).to(device)
    positions = torch.arange(3, 3 + 5 * T, 5, device=device)  # [T] int64, not starting at 0
    return emb(positions, dtype)


def _ref_qk(q, k, qn: RMSNorm | None, kn: RMSNorm | None, cos, sin):
    """The torch path of layers.attention.Attention._norm_rope."""
    if qn is not None:
        q, k = qn._norm(q), kn._norm(k)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = lambda x: torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), -1)  # noqa: E731
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


# --- CPU: the interpreter, fp32 (and fp16 rounding) ---------------------------------------------


@pytest.mark.parametrize("shape", [(5, 64), (3, 48), (2, 3, 16), (0, 32)])
def test_rms_norm_matches_torch_cpu(fused, shape):
    norm = _norm(shape[-1], seed=1)
    x = _randn(*shape, seed=2, scale=3.0)
    torch.testing.assert_close(fused.rms_norm(x, norm.weight, norm.eps), norm._norm(x), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 64), (4, 40)])
def test_add_rms_norm_matches_torch_cpu(fused, shape):
    norm = _norm(shape[-1], seed=3, eps=1e-5)
    x, res = _randn(*shape, seed=4), _randn(*shape, seed=5, scale=4.0)
    ref_out, ref_res = norm._norm(x + res), x + res
    out, new_res = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=1e-5)
    assert torch.equal(res, _randn(*shape, seed=5, scale=4.0))  # inputs untouched


def test_rms_norm_rounds_like_torch_fp16_cpu(fused):
    """The weight multiply happens after the cast to the model dtype, as in the reference."""
    norm = _norm(64, seed=6, dtype=torch.float16)
    x, res = _randn(6, 64, seed=7, dtype=torch.float16), _randn(6, 64, seed=8, dtype=torch.float16)
    out, new_res = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(new_res, x + res)
    ulp = torch.finfo(torch.float16).eps * norm._norm(x + res).float().abs().clamp_min(2**-14)
    assert ((out.float() - norm._norm(x + res).float()).abs() <= ulp).all()


@pytest.mark.parametrize("d", [16, 24])  # 24: the half head (12) is not a power of two
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)])
def test_qk_norm_rope_matches_torch_cpu(fused, d, heads):
    hq, hkv = heads
    T = 5
    qn, kn = _norm(d, seed=9), _norm(d, seed=10)
    q, k = _randn(T, hq, d, seed=11, scale=2.0), _randn(T, hkv, d, seed=12)
    cos, sin = _cos_sin(T, d)
    ref_q, ref_k = _ref_qk(q, k, qn, kn, cos, sin)
    out_q, out_k = fused.qk_norm_rope(q, k, qn.weight, kn.weight, cos, sin, qn.eps)
    torch.testing.assert_close(out_q, ref_q, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=ATOL, rtol=1e-5)


def test_rope_only_matches_apply_rotary_cpu(fused):
    T, d = 4, 16
    q, k = _randn(T, 4, d, seed=13), _randn(T, 2, d, seed=14)
    cos, sin = _cos_sin(T, d, rope=RopeConfig(theta=1e6, rope_type="yarn", factor=4.0,
                                              original_max_position_embeddings=32))
    ref_q, ref_k = apply_rotary(q, k, cos, sin)  # CPU tensors: the torch path
    out_q, out_k = fused.rope(q, k, cos, sin)
    torch.testing.assert_close(out_q, ref_q, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=ATOL, rtol=1e-5)


def test_qk_norm_rope_reads_strided_heads_cpu(fused):
    """q/k as views into one fused qkv projection output (row stride > Hq*D)."""
    T, d, hq, hkv = 3, 16, 4, 2
    qkv = _randn(T, (hq + 2 * hkv) * d, seed=15)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    qn, kn = _norm(d, seed=16), _norm(d, seed=17)
    cos, sin = _cos_sin(T, d)
    for out, ref in zip(fused.qk_norm_rope(q, k, qn.weight, kn.weight, cos, sin, 1e-6),
                        _ref_qk(q, k, qn, kn, cos, sin)):
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 2 * 40), (2, 2 * 1500), (0, 8)])  # 1500 > one block
def test_silu_mul_matches_torch_cpu(fused, shape):
    gate_up = _randn(*shape, seed=18, scale=3.0)
    inter = shape[-1] // 2
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(fused.silu_mul(gate_up), ref, atol=ATOL, rtol=1e-5)
    gate, up = gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous()
    torch.testing.assert_close(fused.silu_mul_split(gate, up), ref, atol=ATOL, rtol=1e-5)


def test_switch_gates_on_device_setting_and_dtype(fused):
    x = torch.zeros(2, 4)
    assert not fused.use_fused(x)  # CPU tensors always take the torch path
    assert fused.fused_ops_enabled()
    with fused.fused_ops(False):
        assert not fused.fused_ops_enabled()
    assert fused.fused_ops_enabled()
    if torch.cuda.is_available():
        xc = x.cuda()
        assert fused.use_fused(xc, xc)
        assert not fused.use_fused(xc, xc.bfloat16())  # mixed dtypes: torch promotes, kernels don't
        with fused.fused_ops(False):
            assert not fused.use_fused(xc)


def _count_fused_calls(monkeypatch, fused) -> dict[str, int]:
    calls = dict.fromkeys(("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul_split"), 0)
    for name in calls:
        original = getattr(fused, name)

        def counted(*args, _name=name, _fn=original, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(fused, name, counted)
    return calls


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_model_on_fused_path_gives_torch_tokens_cpu(fused, monkeypatch, tmp_path, kind):
    """The layers' dispatch end to end: force the fused path on CPU (interpreter) and compare greedy
    tokens with the plain torch run."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the GPU test below covers CUDA")
    save_tiny_model(tmp_path, kind, seed=7)
    prompts = [[11, 250, 1300, 42, 7], [900, 901, 17]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kwargs = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB")
    ref = [o.token_ids for o in LLM(str(tmp_path), **kwargs).generate(prompts, params)]
    real_use_fused = fused.use_fused
    monkeypatch.setattr(fused, "use_fused", lambda x, *others: real_use_fused(_FakeCuda(x), *others))
    calls = _count_fused_calls(monkeypatch, fused)
    out = [o.token_ids for o in LLM(str(tmp_path), fused_ops=True, **kwargs).generate(prompts, params)]
    assert out == ref
    assert all(n > 0 for n in calls.values()), calls


class _FakeCuda:
    """Lets `use_fused` accept a CPU tensor (the interpreter runs the kernels on CPU)."""

    is_cuda = True

    def __init__(self, x: torch.Tensor) -> None:
        self.dtype = x.dtype


# --- CUDA: compiled kernels -----------------------------------------------------------------------


def _assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float, floor: float,
                        bitwise_min: float = 0.95) -> None:
    """|out - ref| <= ulps * eps(dtype) * max(|ref|, floor): a couple of ulps of the value, with an
    absolute floor for results that cancel to near zero. fp32 gets eps 1e-6 (reduction order and
    rsqrt/exp differ from torch's by a few fp32 ulps). In bf16/fp16 the kernels repeat torch's
    roundings, so nearly all elements must also be bitwise equal."""
    eps = 1e-6 if ref.dtype == torch.float32 else torch.finfo(ref.dtype).eps
    diff = (out.float() - ref.float()).abs()
    bound = ulps * eps * ref.float().abs().clamp_min(floor)
    assert (diff <= bound).all(), f"max diff {diff.max().item():.3g}, {(diff > bound).sum().item()} elements over"
    if ref.dtype != torch.float32 and ref.numel():
        same = (out == ref).float().mean().item()
        assert same >= bitwise_min, f"only {same:.1%} of elements equal the torch path bitwise"


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 300])
def test_norms_match_torch_cuda(fused, dtype, T):
    H = 2048
    norm = _norm(H, seed=20, dtype=dtype, device="cuda")
    x = _randn(T, H, seed=21, dtype=dtype, device="cuda", scale=2.0)
    res = _randn(T, H, seed=22, dtype=dtype, device="cuda", scale=8.0)
    with fused.fused_ops(False):
        ref, (ref_add, ref_res) = norm(x), norm(x, res)
    _assert_within_ulps(fused.rms_norm(x, norm.weight, norm.eps), ref, 2, 1.0)
    out, new_res = fused.add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(new_res, ref_res)  # the add rounds exactly like torch's
    _assert_within_ulps(out, ref_add, 2, 1.0)
    # The layer dispatches to the kernels on CUDA.
    _assert_within_ulps(norm(x, res)[0], ref_add, 2, 1.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 257])
def test_qk_norm_rope_matches_torch_cuda(fused, dtype, T):
    d, hq, hkv = 128, 32, 4
    qn, kn = _norm(d, seed=23, dtype=dtype, device="cuda"), _norm(d, seed=24, dtype=dtype, device="cuda")
    q = _randn(T, hq, d, seed=25, dtype=dtype, device="cuda", scale=3.0)
    k = _randn(T, hkv, d, seed=26, dtype=dtype, device="cuda")
    cos, sin = _cos_sin(T, d, dtype=dtype, device="cuda")
    ref_q, ref_k = _ref_qk(q, k, qn, kn, cos, sin)
    out_q, out_k = fused.qk_norm_rope(q, k, qn.weight, kn.weight, cos, sin, qn.eps)
    # A one-ulp difference in the normed value can survive x*cos - y*sin's cancellation: the floor
    # is the scale of the normed inputs (weights ~1), not of the (possibly tiny) result. The norm's
    # compiled rsqrt differs from torch's in the last bit, so after rotary only most elements are
    # bitwise equal (H200, 2026-11-29, all within 3 ulps: 88.6% at T=5 in bf16, 76.7% / 75.3% at
    # T=257 in bf16 / fp16): the ulp bound is the contract here; the bitwise floor only catches a
    # kernel that rounds at different points from torch's.
    _assert_within_ulps(out_q, ref_q, 3, 8.0, bitwise_min=0.6)
    _assert_within_ulps(out_k, ref_k, 3, 8.0, bitwise_min=0.6)
    # Rotary alone repeats torch's roundings exactly in bf16/fp16 (fp32 may contract to FMA).
    with fused.fused_ops(False):
        ref_q, ref_k = apply_rotary(q, k, cos, sin)
    out_q, out_k = fused.rope(q, k, cos, sin)
    _assert_within_ulps(out_q, ref_q, 1, 1.0)
    _assert_within_ulps(out_k, ref_k, 1, 1.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 16, 130])
def test_silu_mul_matches_torch_cuda(fused, dtype, T):
    inter = 768
    gate_up = _randn(T, 2 * inter, seed=27, dtype=dtype, device="cuda", scale=3.0)
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    _assert_within_ulps(fused.silu_mul(gate_up), ref, 2, 2**-6)
    _assert_within_ulps(fused.silu_mul_split(gate_up[:, :inter], gate_up[:, inter:]), ref, 2, 2**-6)


@pytest.mark.gpu
@needs_cuda
def test_kernels_capture_in_a_cuda_graph(fused):
    T, H, d = 4, 256, 64
    on = dict(dtype=torch.bfloat16, device="cuda")
    norm, qn, kn = _norm(H, seed=28, **on), _norm(d, seed=29, **on), _norm(d, seed=30, **on)
    x, res = _randn(T, H, seed=31, **on), _randn(T, H, seed=32, **on)
    q, k = _randn(T, 4, d, seed=33, **on), _randn(T, 2, d, seed=34, **on)
    cos, sin = _cos_sin(T, d, **on)

    def step():
        a, r = fused.add_rms_norm(x, res, norm.weight, norm.eps)
        qq, kk = fused.qk_norm_rope(q, k, qn.weight, kn.weight, cos, sin, 1e-6)
        return a, r, qq, kk, fused.silu_mul(torch.cat((a, r), -1))

    eager = step()  # also compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_cuda_fp32_fused_greedy_matches_transformers(fused, monkeypatch, tmp_path, kind):
    hf = save_tiny_model(tmp_path, kind, seed=3).cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (7, 50, 130)]
    calls = _count_fused_calls(monkeypatch, fused)
    with fused.fused_ops(True):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_memory="256MiB", fused_ops=True)
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert all(n > 0 for n in calls.values()), calls  # the layers took the fused path
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=64, min_new_tokens=64,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref
