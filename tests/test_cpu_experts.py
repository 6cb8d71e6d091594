"""The CPU expert kernel (tandem/offload/cpu_experts.py) against its torch reference, on every ISA
this CPU runs (scalar and avx2 always; avx512 / avx512bf16 / amx where present; amx also built
with its tile operations emulated, where avx512bf16 is present) and every format.

Tolerances, as a share of max|reference| unless said otherwise:
- fp32 hidden: 1e-5 (fp32 math, only the summation order differs);
- bf16 hidden, fp32 intermediate: the output's bf16 rounding, 2^-8 of each element, + 1e-5;
- bf16 hidden on avx512bf16 / amx with bf16 / int4 / mxfp4 weights (bf16 intermediate): 1e-2;
- int8 activations against the int8 reference: 1e-5, plus one int8 step of the intermediate
  wherever it sits at a rounding boundary (test_int8_activations_match_reference says why).
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.offload import cpu_build
from tandem.offload import cpu_experts as ce

ALL_ISAS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")
BF16_ISAS = ("avx512bf16", "amx")  # bf16 activations with bf16 / int4 / mxfp4 weights: a bf16 intermediate


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    if request.param not in ce.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    ce.set_isa(request.param)
    yield request.param
    ce.set_isa(None)


@pytest.fixture
def threads():
    before = ce.num_threads()
    yield ce.set_threads
    ce.set_threads(before)


def _weights(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g) / 4)


def _routing(t: int, k: int, e: int, seed: int, ids_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (t, k), generator=g)  # few experts: many shared across tokens
    if t > 1 and k > 1:
        ids[1, :] = ids[1, 0]  # one token picking the same expert twice
    return ids.to(ids_dtype), torch.rand(t, k, generator=g)


def _assert_close(y: torch.Tensor, ref: torch.Tensor, bf16_out: bool, bf16_intermediate: bool) -> None:
    scale = ref.abs().max().item()
    err = (y.float() - ref).abs()
    if bf16_intermediate:
        bound = torch.full_like(ref, 1e-2 * scale)
    elif bf16_out:
        bound = 2**-8 * ref.abs() + 1e-5 * scale
    else:
        bound = torch.full_like(ref, 1e-5 * scale)
    assert (err <= bound).all(), f"max error {err.max().item():.3g} (max |ref| {scale:.3g})"


# Shapes with remainders everywhere: H not a multiple of 16 or 32, I not of 8 (mxfp4 needs 32s).
SHAPES = {"mxfp4": [(5, 96, 64), (4, 64, 96)], "other": [(5, 96, 64), (6, 72, 44)]}


@pytest.mark.parametrize("fmt", ce.WEIGHT_FORMATS)
def test_matches_reference(isa, fmt):
    for e, h, i in SHAPES["mxfp4" if fmt == "mxfp4" else "other"]:
        layer = ce.CpuExpertLayer.from_dense(*_weights(e, h, i), fmt)
        dq = layer.dequantized()
        for n, (t, k, dtype) in enumerate([(t, k, d) for t in (1, 3, 17) for k in (1, 4)
                                             for d in (torch.float32, torch.bfloat16)]):
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(n)).to(dtype)
            ids, w = _routing(t, k, e, seed=n, ids_dtype=torch.int32 if n % 2 else torch.int64)
            if n % 3 == 0:
                w = w.to(dtype)
            y = layer(x, ids, w)
            assert y.dtype == dtype and y.shape == (t, h)
            bf16 = dtype == torch.bfloat16
            _assert_close(y, ce.reference_moe(x, ids, w, *dq), bf16_out=bf16,
                          bf16_intermediate=bf16 and isa in BF16_ISAS and fmt in ("bf16", "int4", "mxfp4"))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "mxfp4"])
def test_expert_id_minus_one_skips_the_pair(isa, fmt):
    """-1 in topk_ids: the pair is computed elsewhere (a hot expert on the GPU); the others are
    what a call with that pair's weight at zero gives, and a token with every pair skipped is 0."""
    e, h, i = SHAPES["mxfp4" if fmt == "mxfp4" else "other"][0]
    layer = ce.CpuExpertLayer.from_dense(*_weights(e, h, i), fmt)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(4))
    ids, w = _routing(9, 4, e, seed=4)
    skip = torch.rand(9, 4, generator=torch.Generator().manual_seed(5)) < 0.4
    skip[2] = True
    y = layer(x, ids.masked_fill(skip, -1), w)
    _assert_close(y, ce.reference_moe(x, ids, w.masked_fill(skip, 0), *layer.dequantized()), bf16_out=False,
                  bf16_intermediate=isa in BF16_ISAS and fmt != "fp32")
    assert torch.equal(y[2], torch.zeros(h))
    with pytest.raises(ValueError, match=f"outside 0..{e - 1} \\(-1: skip\\)"):
        layer(x, ids.masked_fill(skip, -2), w)


# ---- the SwiGLU clamp (DeepSeek-V4's ClampedSwiGLU) ----------------------------------------------

# With randn weights and inputs gate / up x have a std of sqrt(H) (~10 at H = 96): a limit of 4
# clamps about a third of the gate and two thirds of the up elements.
LIMIT = 4.0
CLAMP_FORMATS = ("fp32", "bf16", "mxfp4")


def _clamp_layer(fmt: str, e: int, h: int, i: int, swiglu_limit=LIMIT) -> ce.CpuExpertLayer:
    weights = _weights(e, h, i)
    if fmt == "mxfp4":  # the checkpoint path
        return ce.CpuExpertLayer.from_mxfp4(*[ce.quantize_mxfp4(w) for w in weights], swiglu_limit=swiglu_limit)
    return ce.CpuExpertLayer.from_dense(*weights, fmt, swiglu_limit=swiglu_limit)


def _clamped_share(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float) -> float:
    """The share of the gate / up elements [E, T, I] of every token under every expert that the clamp changes."""
    g, u = x.float() @ gate.transpose(1, 2), x.float() @ up.transpose(1, 2)
    return ((g > limit).sum() + (u.abs() > limit).sum()).item() / (g.numel() + u.numel())


@pytest.mark.parametrize("fmt", CLAMP_FORMATS)
def test_swiglu_clamp_matches_reference(isa, fmt):
    e, h, i = 5, 96, 64
    layer = _clamp_layer(fmt, e, h, i)
    assert layer.swiglu_limit == LIMIT
    dq = layer.dequantized()
    cases = [(t, k, d) for t in (1, 17) for k in (1, 4) for d in (torch.float32, torch.bfloat16)]
    for n, (t, k, dtype) in enumerate(cases):
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(n)).to(dtype)
        ids, w = _routing(t, k, e, seed=n)
        assert _clamped_share(x, dq[0], dq[1], LIMIT) > 0.2
        ref = ce.reference_moe(x, ids, w, *dq, swiglu_limit=LIMIT)
        unclamped = ce.reference_moe(x, ids, w, *dq)
        scale = ref.abs().max().item()
        assert (ref - unclamped).abs().max().item() > 0.1 * scale  # far above the tolerance below
        y = layer(x, ids, w)
        bf16 = dtype == torch.bfloat16
        bf16_intermediate = bf16 and isa in BF16_ISAS and fmt in ("bf16", "mxfp4")
        _assert_close(y, ref, bf16_out=bf16, bf16_intermediate=bf16_intermediate)


@pytest.mark.parametrize("fmt", CLAMP_FORMATS)
def test_swiglu_clamp_matches_clamped_swiglu(isa, fmt):
    """The kernel against DeepSeek-V4's own expert module holding the same (dequantized) weights."""
    from tandem.models.deepseek_v4_moe import ClampedSwiGLU

    e, h, i = 4, 64, 96
    layer = _clamp_layer(fmt, e, h, i)
    gate, up, down = layer.dequantized()
    experts = [ClampedSwiGLU(h, i, LIMIT) for _ in range(e)]
    with torch.no_grad():
        for m, g, u, d in zip(experts, gate, up, down):
            m.gate_proj.weight.copy_(g), m.up_proj.weight.copy_(u), m.down_proj.weight.copy_(d)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(11))
    ids, w = _routing(9, 3, e, seed=12)
    assert _clamped_share(x, gate, up, LIMIT) > 0.2
    with torch.no_grad():
        want = torch.stack([sum(w[t, j] * experts[ids[t, j]](x[t : t + 1])[0] for j in range(ids.shape[1]))
                            for t in range(x.shape[0])])  # [T, H]
    _assert_close(layer(x, ids, w), want, bf16_out=False, bf16_intermediate=False)


@pytest.mark.parametrize("off", [None, 0, 0.0, math.inf])
def test_no_swiglu_limit_is_the_plain_kernel(off):
    """None, 0 and inf all mean no clamp: bit for bit the layer built without a limit."""
    plain = _clamp_layer("bf16", 5, 96, 64, swiglu_limit=None)
    layer = _clamp_layer("bf16", 5, 96, 64, swiglu_limit=off)
    assert layer.swiglu_limit is None
    x = torch.randn(7, 96).bfloat16()
    ids, w = _routing(7, 4, 5, seed=13)
    assert torch.equal(layer(x, ids, w), plain(x, ids, w))
    dq = plain.dequantized()
    assert torch.equal(ce.reference_moe(x, ids, w, *dq, swiglu_limit=off), ce.reference_moe(x, ids, w, *dq))


def test_host_job_applies_the_layer_limit(isa):
    layer = _clamp_layer("mxfp4", 5, 96, 64)
    x = torch.randn(6, 96)
    ids, w = _routing(6, 4, 5, seed=14)
    out = torch.empty(6, 96)
    job = layer.host_job(x, ids, w, out, torch.tensor([6], dtype=torch.int32))
    job.run()
    assert torch.equal(out, layer(x, ids, w))
    _assert_close(out, ce.reference_moe(x, ids, w, *layer.dequantized(), swiglu_limit=LIMIT), False, False)


def test_bad_swiglu_limit_raises():
    layer = ce.CpuExpertLayer.from_dense(*_weights(2, 32, 32), "fp32")
    x, ids, w = torch.randn(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="swiglu_limit must be a positive number"):
            ce.CpuExpertLayer.empty(2, 32, 32, "fp32", swiglu_limit=bad)
        with pytest.raises(ValueError, match="swiglu_limit"):
            ce.reference_moe(x, ids, w, *layer.dequantized(), swiglu_limit=bad)
    call = layer._call(x, ids, w, torch.empty(1, 32), None)
    call.swiglu_limit = -1.0  # the kernel refuses it too, should a caller bypass the layer
    with pytest.raises(ValueError, match="rejected its arguments"):
        layer._run(call)


def test_long_batch_is_chunked(isa):
    """More tokens than one pass takes (512): the passes add up to the whole."""
    layer = ce.CpuExpertLayer.from_dense(*_weights(4, 32, 32), "fp32")
    x = torch.randn(700, 32)
    ids, w = _routing(700, 2, 4, seed=1)
    _assert_close(layer(x, ids, w), ce.reference_moe(x, ids, w, *layer.dequantized()), False, False)


def test_zero_tokens():
    layer = ce.CpuExpertLayer.from_dense(*_weights(2, 32, 32), "bf16")
    y = layer(torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert y.shape == (0, 32)


def test_bf16_is_the_rounding_of_the_input():
    gate, up, down = _weights(3, 72, 44)
    dq = ce.CpuExpertLayer.from_dense(gate, up, down, "bf16").dequantized()
    for got, want in zip(dq, (gate, up, down)):
        assert torch.equal(got, want.bfloat16().float())


def test_fp32_is_exact():
    gate, up, down = _weights(3, 72, 44)
    for got, want in zip(ce.CpuExpertLayer.from_dense(gate, up, down, "fp32").dequantized(), (gate, up, down)):
        assert torch.equal(got, want)


def test_int8_error_bound():
    """Symmetric per output row: error <= half a step, step = max|row| / 127."""
    gate, up, down = _weights(3, 72, 44)
    for got, want in zip(ce.CpuExpertLayer.from_dense(gate, up, down, "int8").dequantized(), (gate, up, down)):
        step = want.abs().amax(-1, keepdim=True) / 127
        assert ((got - want).abs() <= 0.5 * step * (1 + 1e-5)).all()


def test_int4_error_bound():
    """Groups of 32 inputs, bf16 scale = max|group| / 7: error <= ~half a step (0.55 with the
    scale's bf16 rounding)."""
    gate, up, down = _weights(3, 72, 44)
    for got, want in zip(ce.CpuExpertLayer.from_dense(gate, up, down, "int4").dequantized(), (gate, up, down)):
        k = want.shape[-1]
        groups = torch.nn.functional.pad(want, (0, -k % 32)).unflatten(-1, (-1, 32))
        step = (groups.abs().amax(-1, keepdim=True) / 7).expand_as(groups).flatten(-2)[..., :k]
        assert ((got - want).abs() <= 0.55 * step).all()


def _decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent E2M1 + E8M0 decode: [..., out, in/2], [..., out, in/32] -> fp32 [..., out, in]."""
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    scale = torch.tensor([2.0 ** (s - 127) for s in range(256)], dtype=torch.float64).float()  # 2^-127 is exact
    scale[255] = math.inf  # the kernel's reading of the NaN code (never written by a quantiser)
    return values[codes] * scale[scales.long()].repeat_interleave(32, dim=-1)


def test_mxfp4_keeps_the_checkpoint_values():
    gate, up, down = _weights(3, 64, 96)
    packed = [ce.quantize_mxfp4(w) for w in (gate, up, down)]
    dq = ce.CpuExpertLayer.from_mxfp4(*packed).dequantized()
    for got, (blocks, scales), w in zip(dq, packed, (gate, up, down)):
        want = _decode_mxfp4(blocks, scales)
        assert torch.equal(got, want)
        step = 2.0 ** (scales.float() - 127)  # nearest value: within a step (the 4 -> 6 gap is 2 steps)
        assert ((want - w).abs() <= step.repeat_interleave(32, dim=-1)).all()
        block_max = w.abs().unflatten(-1, (-1, 32)).amax(-1) / step  # the smallest scale that fits
        assert ((block_max > 3) & (block_max <= 6)).all()


def test_mxfp4_raw_bytes(isa):
    """Any codes and scales (0 = the subnormal 2^-127 included) decode as stored; the kernel
    matches the reference on scales in a normal range."""
    g = torch.Generator().manual_seed(3)
    e, h, i = 4, 64, 96

    def raw(rows, cols, lo=0, hi=255):
        return (torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.uint8),
                torch.randint(lo, hi, (e, rows, cols // 32), generator=g, dtype=torch.uint8))
    any_bytes = [raw(i, h), raw(i, h), raw(h, i)]
    dq = ce.CpuExpertLayer.from_mxfp4(*any_bytes).dequantized()
    for got, (blocks, scales) in zip(dq, any_bytes):
        assert torch.equal(got, _decode_mxfp4(blocks, scales))
    normal = [raw(i, h, 120, 128), raw(i, h, 120, 128), raw(h, i, 118, 124)]
    layer = ce.CpuExpertLayer.from_mxfp4(*normal)
    x = torch.randn(5, h, generator=g)
    ids, w = _routing(5, 3, e, seed=4)
    _assert_close(layer(x, ids, w), ce.reference_moe(x, ids, w, *layer.dequantized()), False, False)


def test_forward_into_leaves_other_rows(isa):
    layer = ce.CpuExpertLayer.from_dense(*_weights(5, 96, 64), "bf16")
    x = torch.randn(8, 96).bfloat16()
    ids, w = _routing(8, 4, 5, seed=5)
    out = torch.full((8, 96), 7.0, dtype=torch.bfloat16)
    layer.forward_into(x, ids, w, out, num_tokens=3)
    assert torch.equal(out[:3], layer(x[:3], ids[:3], w[:3]))
    assert (out[3:] == 7).all()


def test_host_job_reads_the_count_at_run_time(isa):
    layer = ce.CpuExpertLayer.from_dense(*_weights(5, 96, 64), "mxfp4")
    x = torch.randn(6, 96)
    ids, w = _routing(6, 4, 5, seed=6)
    out = torch.full((6, 96), 7.0)
    count = torch.tensor([2], dtype=torch.int32)
    job = layer.host_job(x, ids, w, out, count)
    assert job.fn_ptr and job.arg_ptr
    job.run()
    assert torch.equal(out[:2], layer(x[:2], ids[:2], w[:2])) and (out[2:] == 7).all()
    count.fill_(6)
    x.mul_(-1)  # the job reads the buffers when it runs, too
    job.run()
    assert torch.equal(out, layer(x, ids, w))
    count.fill_(7)
    with pytest.raises(ValueError, match="num_tokens is 7"):
        job.run()
    assert job.status != 0
    count.fill_(6)
    ids[0, 0] = 99
    before = out.clone()
    with pytest.raises(ValueError, match="expert 99"):
        job.run()
    assert torch.equal(out, before)


@pytest.mark.parametrize("fmt, act_dtype", [("bf16", "auto"), ("int4", "auto"), ("mxfp4", "auto"), ("int4", "int8"),
                                             ("mxfp4", "int8")])
def test_thread_count_does_not_change_results(threads, fmt, act_dtype):
    layer = ce.CpuExpertLayer.from_dense(*_weights(6, 96, 64), fmt, act_dtype=act_dtype)
    x = torch.randn(17, 96).bfloat16()
    ids, w = _routing(17, 4, 6, seed=7)
    results = []
    for n in (1, 2, 3):
        threads(n)
        assert ce.num_threads() == n
        results.append(layer(x, ids, w))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("fmt", ["bf16", "int4", "mxfp4"])
def test_prefetch_switches_do_not_change_results(fmt):
    layer = ce.CpuExpertLayer.from_dense(*_weights(6, 96, 64), fmt)
    x = torch.randn(9, 96).bfloat16()
    ids, w = _routing(9, 4, 6, seed=3)
    want = layer(x, ids, w)
    lib = ce._lib()
    try:
        for l1, l2 in ((0, 0), (64, 0), (0, 8192), (4096, 16384)):
            lib.tandem_set_prefetch(l1, l2)
            assert torch.equal(layer(x, ids, w), want), (l1, l2)
    finally:
        lib.tandem_set_prefetch(4096, 16384)  # the kernel's defaults (moe.h Tuning)


@pytest.mark.parametrize("fmt, act_dtype", [("bf16", "auto"), ("mxfp4", "auto"), ("mxfp4", "int8")])
def test_claimed_chunks_do_not_change_results(threads, fmt, act_dtype):
    # Each phase hands a share of its tiles out as threads finish (tandem_set_balance): who
    # computes a tile or an output row never changes it, at any share and thread count, and an
    # expert skipped by every token (-1) still leaves zeros.
    layer = ce.CpuExpertLayer.from_dense(*_weights(6, 96, 64), fmt, act_dtype=act_dtype)
    x = torch.randn(13, 96).bfloat16()
    ids, w = _routing(13, 4, 6, seed=5)
    skipped = torch.full_like(ids, -1)
    try:
        ce.set_balance(0)
        threads(1)
        want = layer(x, ids, w)
        for n in (2, 3):
            threads(n)
            for pct in (0, 25, 60, 100):
                ce.set_balance(pct)
                assert torch.equal(layer(x, ids, w), want), (n, pct)
                assert not layer(x, skipped, w).any(), (n, pct)
    finally:
        ce.set_balance(25)  # the kernel's default (moe.h Tuning)
    with pytest.raises(ValueError, match="percentage"):
        ce.set_balance(101)


@pytest.mark.parametrize("fmt, act_dtype", [("bf16", "auto"), ("mxfp4", "auto"), ("mxfp4", "int8")])
def test_work_stealing_takes_a_stalled_threads_stretch_and_changes_no_result(threads, fmt, act_dtype):
    # With work stealing each phase is split whole up front; a thread done with its stretch takes
    # from the back of the fullest other one. Thread N-1 sleeping 50 ms before its gate/up tiles
    # (tandem_debug_stall) leaves its stretch to the others: they must take it (steals counted),
    # and who computed a tile or an output row changes no bit. 6 threads on a 2-core machine
    # steal without the stall too.
    layer = ce.CpuExpertLayer.from_dense(*_weights(6, 96, 64), fmt, act_dtype=act_dtype)
    x = torch.randn(13, 96).bfloat16()
    ids, w = _routing(13, 4, 6, seed=5)
    lib = ce._lib()
    try:
        ce.set_steal(False)
        threads(1)
        want = layer(x, ids, w)
        ce.set_steal(True)
        for n in (2, 3, 6):
            threads(n)
            assert torch.equal(layer(x, ids, w), want), n
            assert not layer(x, torch.full_like(ids, -1), w).any(), n
        threads(2)
        ce.take_steals()
        lib.tandem_debug_stall(50_000_000)
        got = layer(x, ids, w)
        lib.tandem_debug_stall(0)
        assert torch.equal(got, want)
        assert ce.take_steals() > 0  # thread 0 took thread 1's gate/up tiles while it slept
        assert ce.take_steals() == 0  # a read resets the count
    finally:
        lib.tandem_debug_stall(0)
        ce.set_steal(False)  # the kernel's default (moe.h Tuning)
    with pytest.raises(ValueError, match="True or False"):
        ce.set_steal(1)


def test_balance_env_value(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_DYNAMIC_PCT", "40")
    assert ce._env_percent("TANDEM_CPU_DYNAMIC_PCT") == 40
    monkeypatch.setenv("TANDEM_CPU_DYNAMIC_PCT", "half")
    with pytest.raises(ValueError, match="TANDEM_CPU_DYNAMIC_PCT"):
        ce._env_percent("TANDEM_CPU_DYNAMIC_PCT")
    monkeypatch.delenv("TANDEM_CPU_DYNAMIC_PCT")
    assert ce._env_percent("TANDEM_CPU_DYNAMIC_PCT") == -1
    monkeypatch.setenv("TANDEM_CPU_STEAL", "yes")
    with pytest.raises(ValueError, match="TANDEM_CPU_STEAL"):
        ce._env_switch("TANDEM_CPU_STEAL")
    monkeypatch.setenv("TANDEM_CPU_STEAL", "1")
    assert ce._env_switch("TANDEM_CPU_STEAL") == 1
    monkeypatch.delenv("TANDEM_CPU_STEAL")
    assert ce._env_switch("TANDEM_CPU_STEAL") == -1


@pytest.mark.parametrize("act_dtype", ["auto", "int8"])
def test_the_profile_times_every_call_and_its_parts_add_up(threads, act_dtype):
    # Per thread, the parts of a pass run from the pool's start to the call's end, so every
    # thread's parts add up to the same total, within the call's wall time; a read clears the sums,
    # and nothing is summed while the profile is off.
    threads(3)
    layer = ce.CpuExpertLayer.from_dense(*_weights(6, 96, 64), "mxfp4", act_dtype=act_dtype)
    x = torch.randn(5, 96).bfloat16()
    ids, w = _routing(5, 4, 6, seed=2)
    ce.set_profile(True)
    try:
        for _ in range(3):
            layer(x, ids, w)
        prof = ce.read_profile()
        assert prof.calls == 3 and len(prof.seconds) == 3
        totals = [sum(row) for row in prof.seconds]
        assert all(v >= 0 for row in prof.seconds for v in row)
        assert max(totals) - min(totals) < 1e-6 and 0 < totals[0] <= prof.call_seconds
        assert 0 <= prof.route_seconds <= prof.call_seconds - totals[0] + 1e-6
        mean, most = prof.per_call_ms("gate_up")
        assert 0 < mean <= most
        assert ce.read_profile().calls == 0  # read: cleared
    finally:
        ce.set_profile(False)
    layer(x, ids, w)
    assert ce.read_profile().calls == 0  # off: nothing summed


def test_prefetch_env_values(monkeypatch):
    for raw, want in (("", -1), ("0", 0), ("2048", 2048), ("2k", 2048)):
        monkeypatch.setenv("TANDEM_CPU_PREFETCH_L1", raw)
        assert ce._env_bytes("TANDEM_CPU_PREFETCH_L1") == want
    monkeypatch.setenv("TANDEM_CPU_PREFETCH_L1", "far")
    with pytest.raises(ValueError, match="TANDEM_CPU_PREFETCH_L1"):
        ce._env_bytes("TANDEM_CPU_PREFETCH_L1")


def test_bad_inputs_raise_value_errors():
    layer = ce.CpuExpertLayer.from_dense(*_weights(4, 32, 32), "fp32")
    x, ids, w = torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    bad_calls = {
        "columns": (torch.randn(3, 16), ids, w),
        "float32 or bfloat16": (x.half(), ids, w),
        "int32 or int64": (x, ids.float(), w),
        "topk_weights must be": (x, ids, w.double()),
        "2-D": (x[0], ids, w),
        "must both be": (x, ids, w[:, :1]),
        "outside 0..3": (x, ids + 4, w),
        "CPU tensors": (x.to("meta"), ids, w),
    }
    for message, args in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            layer(*args)
    with pytest.raises(ValueError, match="out must be"):
        layer.forward_into(x, ids, w, torch.empty(3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        layer.forward_into(x, ids, w, torch.empty(32, 3).T)
    with pytest.raises(ValueError, match="num_tokens 4"):
        layer.forward_into(x, ids, w, torch.empty(3, 32), num_tokens=4)
    with pytest.raises(ValueError, match="int32 tensor"):
        layer.host_job(x, ids, w, torch.empty(3, 32), torch.tensor([1]))
    with pytest.raises(ValueError, match="shape"):
        layer.set_expert(0, torch.randn(32, 16), torch.randn(32, 32), torch.randn(32, 32))
    with pytest.raises(ValueError, match="outside"):
        layer.set_expert(4, torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32))
    with pytest.raises(ValueError, match="mxfp4 layer"):
        layer.set_expert_mxfp4(0, *[(torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(32, 1, dtype=torch.uint8))] * 3)
    with pytest.raises(ValueError, match="unknown CPU expert format"):
        ce.CpuExpertLayer.empty(4, 32, 32, "fp8")
    with pytest.raises(ValueError, match="multiples of 32"):
        ce.CpuExpertLayer.empty(4, 48, 32, "mxfp4")
    with pytest.raises(ValueError, match="unknown ISA"):
        ce.set_isa("sse4")
    with pytest.raises(ValueError, match="positive"):
        ce.set_threads(0)


def test_sizes():
    layer = ce.CpuExpertLayer.empty(3, 2048, 768, "bf16")
    assert layer.bytes_per_expert == 3 * 2048 * 768 * 2  # no padding at real shapes
    assert layer.nbytes == 3 * layer.bytes_per_expert
    mx = ce.CpuExpertLayer.empty(2, 4096, 2048, "mxfp4")
    assert mx.bytes_per_expert == 3 * 4096 * 2048 * 17 // 32  # codes plus one scale byte per 32
    assert ce.kernel_isa() in ALL_ISAS


def test_missing_compiler_is_one_clear_error(tmp_path):
    with pytest.raises(ce.CpuKernelBuildError) as info:
        cpu_build.library_path(cxx=str(tmp_path / "no-such-dir" / "g++"), cache_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message and "not found" in message and "install gcc/g++" in message


def test_compile_failure_shows_the_compiler_output(tmp_path):
    with pytest.raises(ce.CpuKernelBuildError, match="no-such-option"):
        cpu_build.library_path(cache_dir=tmp_path, extra_flags=("-fno-such-option",))
    assert not list(tmp_path.glob("*/libtandem_moe.so"))  # nothing half-built left to load


def test_measure_read_bandwidth():
    bw = ce.measure_read_bandwidth(8 << 20, repeats=2)
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError, match="positive repeats"):
        ce.measure_read_bandwidth(8 << 20, repeats=0)


def test_a_read_probe_measures_again_on_its_buffer_with_the_threads_it_was_given():
    pool = ce.num_threads()
    probe = ce.ReadProbe(8 << 20, threads=1)
    assert probe.nbytes == 8 << 20 and probe.threads == 1
    readings = [probe.measure(1) for _ in range(3)]
    assert all(math.isfinite(r) and r > 0 for r in readings)
    assert ce.num_threads() == pool  # the pool is given its size back after each measurement
    distances = ce.prefetch()
    try:  # the AVX-512 probe streams with the kernels' prefetch; it reads with it off too
        ce.set_prefetch(0, 0)
        assert ce.prefetch() == (0, 0) and probe.measure(1) > 0
    finally:
        ce.set_prefetch(*distances)
    assert ce.prefetch() == distances
    with pytest.raises(ValueError, match="positive nbytes and threads"):
        ce.ReadProbe(0)


# ---- int8 activations (act_dtype "int8": int4 / mxfp4 weights) ---------------------------------

# Hidden states with exact rounding ties in block 0: max 127/64 makes d = 1/64 exactly, and
# (k + 1/2) / 64 divides to k + 1/2 (exact in bf16 too), so q must round half to even as torch does.
TIES = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 4.5, 10.5, -11.5]) / 64
# The kernel's and torch's fp32 intermediates differ in summation order, ~1e-6 relatively: an
# element whose |a| / d lies this close to a rounding boundary may round to the other neighbour.
NEAR_TIE = 5e-4


def _with_ties(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, : len(TIES)] = TIES.to(x.dtype)
    return x


def _int8_flip_slack(x, ids, w, gate, up, down, limit=None) -> torch.Tensor:
    """[T, H]: what a flip of one int8 step at each near-tie element of the SwiGLU intermediate
    (|a| / d within NEAR_TIE of k + 1/2) may add to each output: w * |down| @ (d at those elements)."""
    q, d = ce.quantize_int8_activations(x)
    xq = (q * d).flatten(-2)[:, : x.shape[1]]
    slack = torch.zeros(x.shape[0], down.shape[1])
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = xq[tok] @ gate[e].T, xq[tok] @ up[e].T  # [n, I]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        a = torch.nn.functional.silu(g) * u
        _, da = ce.quantize_int8_activations(a)  # [n, nb, 1]
        blocks = torch.nn.functional.pad(a, (0, -a.shape[1] % 32)).unflatten(-1, (-1, 32))
        r = (blocks / da).abs()
        near = ((r - r.floor() - 0.5).abs() < NEAR_TIE).float()
        step = (near * da).flatten(-2)[:, : a.shape[1]]  # [n, I]
        slack.index_add_(0, tok, (step @ down[e].abs().T) * w[tok, slot, None].float())
    return slack


INT8_SHAPES = {"mxfp4": [(5, 96, 64), (4, 64, 96)], "int4": [(5, 96, 64), (6, 72, 44)]}


@pytest.mark.parametrize("fmt", ce.INT8_ACT_FORMATS)
def test_int8_activations_match_reference(isa, fmt):
    """The kernel's int8 mode against reference_moe(act_dtype="int8"): the quantised hidden state
    is the same on both sides (ties included), so the integer dot products are the reference's
    up to fp32 summation order: 1e-5 of max|ref| (plus the bf16 output's rounding). The SwiGLU
    intermediate is quantised from fp32 values that differ by that order, so an element sitting
    at a rounding boundary may round one step apart: `_int8_flip_slack` allows exactly that."""
    for e, h, i in INT8_SHAPES[fmt]:
        layer = ce.CpuExpertLayer.from_dense(*_weights(e, h, i), fmt, act_dtype="int8")
        assert layer.act_dtype == "int8"
        dq = layer.dequantized()
        cases = [(t, k, d) for t in (1, 3, 8, 17, 40) for k in (1, 4) for d in (torch.float32, torch.bfloat16)]
        for n, (t, k, dtype) in enumerate(cases + [(600, 2, torch.float32)]):  # 600: two passes of 512
            x = _with_ties(torch.randn(t, h, generator=torch.Generator().manual_seed(n))).to(dtype)
            ids, w = _routing(t, k, e, seed=n, ids_dtype=torch.int32 if n % 2 else torch.int64)
            y = layer(x, ids, w)
            assert y.dtype == dtype and y.shape == (t, h)
            ref = ce.reference_moe(x, ids, w, *dq, act_dtype="int8")
            slack = _int8_flip_slack(x.float(), ids, w, *dq)
            bound = 1e-5 * ref.abs().max() + slack + (2**-8 * (ref.abs() + slack) if dtype == torch.bfloat16 else 0)
            err = (y.float() - ref).abs()
            assert (err <= bound).all(), f"{fmt} {(e, h, i)} {(t, k, dtype)}: max error {err.max().item():.3g}"


@pytest.mark.parametrize("fmt", ce.INT8_ACT_FORMATS)
def test_int8_activations_are_the_same_bits_on_every_isa(fmt):
    """Integer sums, then one rounded product and one fma per block on every ISA (scalar, AVX2
    vpmaddubsw, AVX-512 vpdpbusd): identical outputs, through host_job as well."""
    layer = ce.CpuExpertLayer.from_dense(*_weights(6, 96, 64), fmt, swiglu_limit=LIMIT, act_dtype="int8")
    x = _with_ties(torch.randn(19, 96, generator=torch.Generator().manual_seed(21)))
    ids, w = _routing(19, 4, 6, seed=21)
    try:
        results = {}
        for isa in ce.supported_isas():
            ce.set_isa(isa)
            out = torch.empty(19, 96)
            layer.host_job(x, ids, w, out, torch.tensor([19], dtype=torch.int32)).run()
            assert torch.equal(out, layer(x, ids, w))
            results[isa] = out
    finally:
        ce.set_isa(None)
    assert len(results) >= 2  # scalar and avx2 at least (CI)
    for isa, out in results.items():
        assert torch.equal(out, results["scalar"]), isa
    ref = ce.reference_moe(x, ids, w, *layer.dequantized(), swiglu_limit=LIMIT, act_dtype="int8")
    slack = _int8_flip_slack(x, ids, w, *layer.dequantized(), limit=LIMIT)
    assert ((results["scalar"] - ref).abs() <= 1e-5 * ref.abs().max() + slack).all()


@pytest.mark.parametrize("fmt", ce.INT8_ACT_FORMATS)
def test_int8_activations_are_close_to_exact(fmt):
    """The lossy mode stays near the exact one (8-bit activations: ~1% here), yet is not it."""
    weights = _weights(6, 96, 64)
    exact = ce.CpuExpertLayer.from_dense(*weights, fmt)
    int8 = ce.CpuExpertLayer.from_dense(*weights, fmt, act_dtype="int8")
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(22))
    ids, w = _routing(32, 4, 6, seed=22)
    want, got = exact(x, ids, w), int8(x, ids, w)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.03, rel


def test_int8_activations_are_refused_for_other_formats():
    for fmt in ("fp32", "bf16", "int8"):
        with pytest.raises(ValueError, match="int8 activations .* cover int4 and mxfp4 expert weights, not " + fmt):
            ce.CpuExpertLayer.empty(2, 32, 32, fmt, act_dtype="int8")
    with pytest.raises(ValueError, match="unknown activation mode 'fp8'; known: auto, int8"):
        ce.CpuExpertLayer.empty(2, 32, 32, "int4", act_dtype="fp8")
    layer = ce.CpuExpertLayer.from_dense(*_weights(2, 32, 32), "int4")
    x, ids, w = torch.randn(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="unknown activation mode"):
        ce.reference_moe(x, ids, w, *layer.dequantized(), act_dtype="int4")


def test_int8_activations_keep_a_nan_in_its_token():
    """A NaN in a token's hidden state makes that token's output NaN (as in the exact mode), not
    a finite value from a garbage scale; the other tokens are untouched."""
    layer = ce.CpuExpertLayer.from_dense(*_weights(4, 64, 64), "mxfp4", act_dtype="int8")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(23))
    ids, w = _routing(3, 2, 4, seed=23)
    want = layer(x, ids, w)
    x[1, 5] = math.nan
    y = layer(x, ids, w)
    assert y[1].isnan().all()
    assert torch.equal(y[0], want[0]) and torch.equal(y[2], want[2])


def test_int8_quantisation_rounds_half_to_even():
    q, d = ce.quantize_int8_activations(TIES[None])
    assert d.item() == 1 / 64
    assert q[0, 0, : len(TIES)].tolist() == [127, 0, 2, 2, -0, -2, -2, 4, -4, 4, 10, -12]
    assert (q[0, 0, len(TIES):] == 0).all()  # the padding
    q, d = ce.quantize_int8_activations(torch.zeros(1, 40))
    assert (d == 0).all() and (q == 0).all()


# ---- AMX's data layout, on any CPU with avx512bf16 ------------------------------------------------

@pytest.fixture
def emulated_amx(monkeypatch):
    """cpu_experts on the library built with TANDEM_AMX_EMULATE (the tile operations in plain C++,
    the rest of the AMX path as it is: the decode into tiles, the token-major activations), ISA amx;
    the real library again after."""
    if "avx512bf16" not in ce.supported_isas():
        pytest.skip("the AMX path decodes with avx512bf16, which this CPU lacks")
    monkeypatch.setattr(ce, "load_library", lambda: cpu_build.load_library(extra_flags=("-DTANDEM_AMX_EMULATE",)))
    ce._lib.cache_clear()
    try:
        ce.set_isa("amx")
        yield
    finally:
        ce._lib.cache_clear()


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_emulated_amx_matches_reference(emulated_amx, fmt, threads):
    """The AMX kernels' tiles and token-major activations against the torch reference: 1 to 40
    tokens an expert (one token takes vdpbf16ps; 16 at a time take the tiles, then the rest), block
    counts that leave a partial group of four, 1-3 threads with claimed chunks."""
    assert ce.kernel_isa() == "amx"
    for e, h, i in [(3, 160, 96), (2, 96, 64)]:
        layer = ce.CpuExpertLayer.from_dense(*_weights(e, h, i), fmt)
        dq = layer.dequantized()
        for n, (t, nthreads) in enumerate([(1, 1), (2, 2), (3, 1), (9, 3), (20, 2), (60, 3)]):
            threads(nthreads)
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(n)).bfloat16()
            ids, w = _routing(t, 2, e, seed=n)
            y = layer(x, ids, w)
            _assert_close(y, ce.reference_moe(x, ids, w, *dq), bf16_out=True, bf16_intermediate=True)
