"""Routed experts of one MoE layer in RAM, computed by Tandem's CPU expert kernel.

`CpuExpertLayer` holds every expert of a layer packed once (at load) into the kernel's blocked
layout (tandem/offload/cpu_kernels/moe.h) inside one torch uint8 tensor, and is a MoEExecutor:
`layer(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]`. Decode is bound by RAM
bandwidth: each distinct expert of a call is streamed once, whatever the number of its tokens.

Formats: fp32 (exact; what CI checks), bf16 (Qwen3's checkpoint dtype), int8 (per output row) and
int4 (groups of 32 inputs, bf16 scales) — both lossy conversions of a bf16 checkpoint, opt-in —
and mxfp4 (E2M1 codes with E8M0 scales per 32 inputs: DeepSeek-V4-Flash's own expert format,
kept as stored). Math is fp32: activations are widened, weights decoded in registers, the SwiGLU
intermediate fp32 — except on ISAs "avx512bf16" and "amx" with a bf16 hidden state and bf16 / int4 /
mxfp4 weights, where vdpbf16ps (and for int4 / mxfp4 with two or more tokens an expert, AMX's
tdpbf16ps) takes the bf16 activations as they are and the intermediate is rounded to bf16 (as the
bf16 model on the GPU rounds it); `set_isa("avx512")` keeps that path fp32.

Activations: `act_dtype="auto"` (the default) is the math above. `act_dtype="int8"` (int4 and
mxfp4 weights only) is a LOSSY mode that trades activation precision for decode speed: the hidden
state, and the SwiGLU intermediate before the down projection, are quantised per token and block
of 32 inputs to int8 with one fp32 scale (max|x| / 127, round half to even), and each block's dot
product is done in integers (vpdpbusd with avx512vnni, vpmaddubsw on AVX2; scalar alike), which
halves the table lookups and products per weight. The weights are not changed. The error is that
of 8-bit activations: up to half a step, max|block| / 254, per element (`reference_moe` models it
exactly). Every ISA gives the same bits in this mode.

A layer built with `swiglu_limit` (DeepSeek-V4) computes ClampedSwiGLU (models/deepseek_v4_moe.py),
silu(min(gate, limit)) * clamp(up, -limit, limit), on every ISA; without one the plain SwiGLU.

The kernel library is compiled on first use (tandem/offload/cpu_build.py). Debugging switches,
read once when it loads (results do not depend on the prefetch ones):
  TANDEM_CPU_ISA          scalar | avx2 | avx512 | avx512bf16 | amx: force an ISA (amx is only ever
                          chosen this way or by `set_isa`: it has not run on an AMX CPU yet);
  TANDEM_CPU_PREFETCH_L1  bytes ahead of the weight stream the AVX-512 kernels prefetch into L1
                          (default 4096; 0 off);
  TANDEM_CPU_PREFETCH_L2  bytes ahead they prefetch into L2 only (default 16384; 0 off).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.config import usable_cpus
from tandem.offload.cpu_build import CpuKernelBuildError, load_library

__all__ = [
    "WEIGHT_FORMATS", "LOSSY_FORMATS", "CpuKernelBuildError", "CpuExpertLayer", "HostJob", "kernel_isa",
    "supported_isas", "set_isa", "set_threads", "prefetch", "set_prefetch", "num_threads", "measure_read_bandwidth",
    "ReadProbe", "reference_moe",
    "quantize_mxfp4", "ACT_DTYPES", "INT8_ACT_FORMATS", "quantize_int8_activations",
]

WEIGHT_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "mxfp4")
LOSSY_FORMATS: frozenset[str] = frozenset({"int8", "int4"})  # conversions that change a bf16 checkpoint's weights
ISAS: tuple[str, ...] = ("scalar", "avx2", "avx512", "avx512bf16", "amx")  # the kernel's ISA codes, in order
ACT_DTYPES: tuple[str, ...] = ("auto", "int8")  # activation modes, in the kernel's code order (ActDtype)
INT8_ACT_FORMATS: tuple[str, ...] = ("int4", "mxfp4")  # the weight formats act_dtype "int8" covers

_FMT_CODE = {name: i for i, name in enumerate(WEIGHT_FORMATS)}
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.int32: 2, torch.int64: 3}


class _Call(ctypes.Structure):
    """Mirror of `struct tandem_call` (moe_common.cpp)."""

    _fields_ = [
        ("data", ctypes.c_void_p), ("expert_bytes", ctypes.c_int64),
        ("num_experts", ctypes.c_int32), ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32), ("fmt", ctypes.c_int32),
        ("swiglu_limit", ctypes.c_float), ("act_dtype", ctypes.c_int32),
        ("x", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("num_tokens", ctypes.c_void_p),
        ("rows", ctypes.c_int32), ("top_k", ctypes.c_int32),
        ("x_dtype", ctypes.c_int32), ("ids_dtype", ctypes.c_int32), ("w_dtype", ctypes.c_int32),
        ("status", ctypes.c_int32), ("bad_value", ctypes.c_int64),
    ]


@functools.cache
def _lib() -> ctypes.CDLL:
    """The kernel library, typed, with the default thread count and any TANDEM_CPU_ISA applied."""
    lib = load_library()
    i, i64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    for name, args, res in [
        ("tandem_isa_supported", [i], i), ("tandem_best_isa", [], i), ("tandem_set_isa", [i], i),
        ("tandem_get_isa", [], i), ("tandem_set_threads", [i], None), ("tandem_num_threads", [], i),
        ("tandem_expert_bytes", [i, i, i], i64), ("tandem_pack_expert", [i, i, i] + [p] * 7, None),
        ("tandem_unpack_expert", [i, i, i, p, p, p, p], None), ("tandem_moe", [ctypes.POINTER(_Call)], i),
        ("tandem_host_fn", [p], None), ("tandem_read_seconds", [p, i64, i, i], ctypes.c_double),
        ("tandem_advise_huge_pages", [p, i64], i), ("tandem_set_prefetch", [i64, i64], None),
        ("tandem_get_prefetch", [p, p], None),
        ("tandem_set_profile", [i], None), ("tandem_set_balance", [i], None), ("tandem_set_steal", [i], None),
        ("tandem_take_steals", [], i64), ("tandem_debug_stall", [i64], None),
        ("tandem_read_profile", [ctypes.POINTER(ctypes.c_double), i], i),
        ("tandem_doorbell_open", [p], p), ("tandem_doorbell_add", [p, p], i), ("tandem_doorbell_close", [p], None),
        ("tandem_doorbell_served", [p], i64), ("tandem_doorbell_error", [p, ctypes.POINTER(ctypes.c_int32)], ctypes.c_int32),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    # One core stays free for the thread that drives the GPU (with every core busy a peer
    # kernel stalled at 8 ms per call).
    lib.tandem_set_threads(max(1, usable_cpus() - 1))
    lib.tandem_set_isa(lib.tandem_best_isa())
    forced = os.environ.get("TANDEM_CPU_ISA")  # debugging switch
    if forced:
        _set_isa(lib, forced, source="TANDEM_CPU_ISA")
    lib.tandem_set_prefetch(_env_bytes("TANDEM_CPU_PREFETCH_L1"), _env_bytes("TANDEM_CPU_PREFETCH_L2"))
    lib.tandem_set_balance(_env_percent("TANDEM_CPU_DYNAMIC_PCT"))
    lib.tandem_set_steal(_env_switch("TANDEM_CPU_STEAL"))
    return lib


def _env_bytes(name: str) -> int:
    """A debugging switch in bytes (plain or with a k suffix: 2048, 2k); -1 (the kernel's default) when unset."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return -1
    try:
        value = int(raw[:-1]) * 1024 if raw.endswith("k") else int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: want a byte count >= 0 (e.g. 1024, 2k; 0 turns it off)")
    return value


def _env_percent(name: str) -> int:
    """A debugging switch in percent (0-100); -1 (the kernel's default) when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return -1
    if not raw.isdigit() or int(raw) > 100:
        raise ValueError(f"{name}={raw!r}: want a percentage 0-100")
    return int(raw)


def _env_switch(name: str) -> int:
    """A debugging on/off switch (1 / 0); -1 (the kernel's default) when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return -1
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: want 1 (on) or 0 (off)")
    return int(raw)


def _supported(lib: ctypes.CDLL) -> tuple[str, ...]:
    return tuple(name for code, name in enumerate(ISAS) if lib.tandem_isa_supported(code))


def _set_isa(lib: ctypes.CDLL, isa: str | None, source: str = "set_isa") -> None:
    supported = _supported(lib)
    if isa is None:
        lib.tandem_set_isa(lib.tandem_best_isa())
        return
    if isa not in ISAS:
        raise ValueError(f"{source}: unknown ISA {isa!r}; known: {', '.join(ISAS)}")
    if isa not in supported:
        raise ValueError(f"{source}: this CPU cannot run the {isa} kernel; it supports {', '.join(supported)}")
    lib.tandem_set_isa(ISAS.index(isa))


def supported_isas() -> tuple[str, ...]:
    """The ISAs this CPU can run, slowest first ("scalar" always)."""
    return _supported(_lib())


def kernel_isa() -> str:
    """The ISA the loaded kernel dispatches to: "amx" | "avx512bf16" | "avx512" | "avx2" | "scalar"."""
    return ISAS[_lib().tandem_get_isa()]


def set_isa(isa: str | None) -> None:
    """Force the kernel's ISA (tests, debugging); None picks the best this CPU has."""
    _set_isa(_lib(), isa)


def set_threads(n: int) -> None:
    """Size the kernel's thread pool: n threads in all, the calling thread being one of them."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"set_threads needs a positive thread count, got {n!r}")
    _lib().tandem_set_threads(n)


def set_prefetch(l1: int, l2: int) -> None:
    """The AVX-512 kernels' software-prefetch distances, in bytes ahead of the weight stream
    (0: off; -1: leave that one as it is). A tuning switch (TANDEM_CPU_PREFETCH_L1 / _L2 set it at
    load; the defaults are moe.h's Tuning)."""
    _lib().tandem_set_prefetch(l1, l2)


def prefetch() -> tuple[int, int]:
    """The AVX-512 kernels' software-prefetch distances in effect (l1, l2 bytes; `set_prefetch`)."""
    l1, l2 = ctypes.c_int64(), ctypes.c_int64()
    _lib().tandem_get_prefetch(ctypes.byref(l1), ctypes.byref(l2))
    return l1.value, l2.value


def set_balance(dynamic_pct: int) -> None:
    """The share of each phase of a call (percent) that the kernel's threads claim in small chunks
    as they finish, the rest being split up front (0: all up front, the split before session 16;
    -1: leave it). A tuning switch (TANDEM_CPU_DYNAMIC_PCT sets it at load; the default is moe.h's
    Tuning). Results do not depend on it."""
    if not isinstance(dynamic_pct, int) or not -1 <= dynamic_pct <= 100:
        raise ValueError(f"set_balance needs a percentage 0-100 (or -1), got {dynamic_pct!r}")
    _lib().tandem_set_balance(dynamic_pct)


def set_steal(on: bool) -> None:
    """Work stealing instead of `set_balance`'s claimed chunks: each phase of a call is split whole
    up front, and a thread done with its stretch takes from the back of the stretch with the most
    left (a thread that falls behind loses the end of its stretch instead of holding the others at
    the barrier). A tuning switch (TANDEM_CPU_STEAL=1 sets it at load; off by default, moe.h's
    Tuning). Results do not depend on it."""
    if not isinstance(on, bool):
        raise ValueError(f"set_steal needs True or False, got {on!r}")
    _lib().tandem_set_steal(int(on))


def take_steals() -> int:
    """Chunks of work the kernel's threads took from another thread's stretch since the last call
    (work stealing), then reset."""
    return int(_lib().tandem_take_steals())


def num_threads() -> int:
    return _lib().tandem_num_threads()


# The parts of a call the kernel's profile times per thread (moe_common.cpp, Profile).
PROFILE_PARTS = ("wake", "gather", "wait", "gate_up", "wait+quant", "down", "tail")


@dataclass(frozen=True)
class CallProfile:
    """Where the kernel's calls spent their time since the last read: `seconds[t][p]`, thread t's
    time in part p of PROFILE_PARTS (summed over the calls); the parts of a thread add up to its
    passes' wall time, so a part's spread over the threads shows imbalance and barrier waits."""

    calls: int
    call_seconds: float  # the calls' wall time, routing included
    route_seconds: float  # grouping the pairs by expert, before the threads start
    seconds: tuple[tuple[float, ...], ...]

    def per_call_ms(self, part: str) -> tuple[float, float]:
        """(mean over threads, max over threads) of one part, in ms per call."""
        i = PROFILE_PARTS.index(part)
        values = [row[i] for row in self.seconds]
        n = max(self.calls, 1)
        return 1e3 * sum(values) / len(values) / n, 1e3 * max(values) / n


def set_profile(on: bool) -> None:
    """Time each part of every MoE call per thread (a debugging and benchmark switch: a few clock
    reads per thread per call); turning it on or off clears the sums."""
    _lib().tandem_set_profile(int(on))


def read_profile() -> CallProfile:
    """The sums since `set_profile(True)` or the last read, which clears them."""
    lib = _lib()
    threads = lib.tandem_num_threads()
    buf = (ctypes.c_double * (3 + threads * len(PROFILE_PARTS)))()
    n = lib.tandem_read_profile(buf, threads)
    parts = len(PROFILE_PARTS)
    rows = tuple(tuple(buf[3 + t * parts: 3 + (t + 1) * parts]) for t in range(n))
    return CallProfile(int(buf[0]), buf[1], buf[2], rows)


class ReadProbe:
    """RAM read bandwidth, measured again and again on one buffer: allocated and faulted in once
    (huge pages advised, as the experts' memory: `CpuExpertLayer.empty`), far larger than the
    caches, read by the kernel's own pool (resized to `threads` while measuring, when given).
    A benchmark interleaves `measure` with the calls it rates, so that the roofline moves with
    the machine (on a shared host it swings within a run)."""

    def __init__(self, nbytes: int = 1 << 30, threads: int | None = None) -> None:
        lib = _lib()
        self.threads = lib.tandem_num_threads() if threads is None else threads
        if self.threads < 1 or nbytes < 1:
            raise ValueError(f"ReadProbe needs positive nbytes and threads; got {nbytes}, {self.threads}")
        self.nbytes = max(4096 * self.threads, nbytes // 4096 * 4096)
        self._buf = torch.empty(self.nbytes + 64, dtype=torch.uint8)
        lib.tandem_advise_huge_pages(self._buf.data_ptr(), self._buf.numel())
        self._buf.fill_(1)  # fault the pages in before timing
        self._start = self._buf.data_ptr() + (-self._buf.data_ptr() % 64)

    def measure(self, repeats: int = 3) -> float:
        """Bytes/s: the best of `repeats` streaming reads of the buffer."""
        if repeats < 1:
            raise ValueError(f"ReadProbe.measure needs positive repeats; got {repeats}")
        lib = _lib()
        pool = lib.tandem_num_threads()
        if self.threads != pool:
            lib.tandem_set_threads(self.threads)
        try:
            seconds = lib.tandem_read_seconds(self._start, self.nbytes, self.threads, repeats)
        finally:
            if self.threads != pool:
                lib.tandem_set_threads(pool)
        return self.nbytes / seconds


def measure_read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 3) -> float:
    """RAM read bandwidth in bytes/s: the best of `repeats` streaming reads of an `nbytes` buffer
    (far larger than the caches) by the kernel's own pool (resized to `threads` for the
    measurement when given); one `ReadProbe`, used once."""
    if repeats < 1:  # before the buffer is allocated
        raise ValueError(f"measure_read_bandwidth needs positive repeats; got {repeats}")
    return ReadProbe(nbytes, threads).measure(repeats)


# ---- weight conversion ---------------------------------------------------------------------------


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., out, in] (in a multiple of 32) -> (blocks uint8 [..., out, in/2], scales uint8
    [..., out, in/32]): per 32 inputs the E8M0 scale is the smallest power of two that brings the
    block's max within 6, each value rounds to the nearest E2M1 value (ties to the even code);
    low nibble = element 2i, high nibble = 2i+1, the code's top bit is the sign."""
    if w.shape[-1] % 32:
        raise ValueError(f"mxfp4 needs the input dimension to be a multiple of 32, got {w.shape[-1]}")
    x = w.detach().to("cpu", torch.float32).reshape(*w.shape[:-1], w.shape[-1] // 32, 32)  # [..., G, 32]
    amax = x.abs().amax(-1)  # [..., G]
    mant, exp = torch.frexp(amax / 6)  # amax / 6 = mant * 2^exp, mant in [0.5, 1)
    shift = exp - (mant == 0.5).to(exp.dtype)  # ceil(log2(amax / 6))
    byte = torch.where(amax > 0, shift + 127, torch.full_like(shift, 127)).clamp(0, 254)
    v = x / torch.ldexp(torch.ones_like(amax), byte - 127)[..., None]  # exact: a power of two
    mag = v.abs()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    code = torch.bucketize(mag, mids)  # a tie goes to the lower code ...
    tie = (code < 7) & (mag == mids[code.clamp(max=6)])
    code = code + (tie & (code % 2 == 1)).to(code.dtype)  # ... unless that one is odd
    code = code | ((v < 0).to(code.dtype) << 3)
    code = code.reshape(*w.shape).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), byte.to(torch.uint8).contiguous()


def _quantize(fmt: str, w: Tensor) -> tuple[Tensor, Tensor | None]:
    """w [out, in] -> the row-major source tandem_pack_expert takes for `fmt` (moe_common.cpp)."""
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    if fmt == "bf16":
        return w.to(torch.bfloat16).contiguous().view(torch.int16), None
    wf = w.to(torch.float32).contiguous()
    if fmt == "fp32":
        return wf, None
    if fmt == "int8":  # symmetric per output row
        scale = wf.abs().amax(1) / 127  # [out]
        q = wf.div(scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).round_().clamp_(-127, 127)
        return q.to(torch.int8), scale.contiguous()
    # int4: symmetric groups of 32 inputs (zero-padded), one bf16 scale each
    out, k = wf.shape
    g = F.pad(wf, (0, -k % 32)).view(out, -1, 32)  # [out, G, 32]
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)  # [out, G]
    s = scale.float().clamp_(min=torch.finfo(torch.float32).tiny)[..., None]  # an all-zero group stays 0
    q = g.div_(s).round_().clamp_(-8, 7).to(torch.int8).view(out, -1)
    return q.contiguous(), scale.view(torch.int16).contiguous()


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _act_dtype(act_dtype: str, fmt: str | None) -> str:
    """An activation mode, checked against the weight format (None: any)."""
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"unknown activation mode {act_dtype!r}; known: {', '.join(ACT_DTYPES)}")
    if act_dtype == "int8" and fmt is not None and fmt not in INT8_ACT_FORMATS:
        raise ValueError(f"int8 activations (--cpu-moe-act-dtype int8) cover {' and '.join(INT8_ACT_FORMATS)} "
                         f"expert weights, not {fmt}: use --cpu-moe-dtype int4 or mxfp4, or activations 'auto'")
    return act_dtype


def _swiglu_limit(limit: float | None) -> float | None:
    """A SwiGLU clamp limit as layers store it: None (no clamp) for None, 0 or inf, else the float."""
    if limit is None:
        return None
    value = float(limit)
    if math.isnan(value) or value < 0:
        raise ValueError(f"swiglu_limit must be a positive number (or None, 0 or inf for no clamp), got {limit!r}")
    return None if value == 0 or math.isinf(value) else value


# ---- the layer ----------------------------------------------------------------------------------------


class CpuExpertLayer:
    """One MoE layer's routed experts in RAM in the kernel layout."""

    def __init__(self, data: Tensor, num_experts: int, hidden_size: int, intermediate_size: int, fmt: str,
                 swiglu_limit: float | None = None, act_dtype: str = "auto") -> None:
        self.data = data  # [E, bytes_per_expert] uint8, the packed experts
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.fmt = fmt
        self.swiglu_limit = _swiglu_limit(swiglu_limit)  # None: plain SwiGLU; every call of the layer uses it
        self.act_dtype = _act_dtype(act_dtype, fmt)  # one of ACT_DTYPES; every call of the layer uses it

    @classmethod
    def empty(cls, num_experts: int, hidden_size: int, intermediate_size: int, fmt: str, *,
              swiglu_limit: float | None = None, act_dtype: str = "auto", pin_memory: bool = False) -> CpuExpertLayer:
        """Room for the experts, to be filled by `set_expert` (an expert not set holds garbage).
        `swiglu_limit` > 0 clamps the SwiGLU as ClampedSwiGLU does; None, 0 or inf: no clamp.
        `act_dtype` "int8" (int4 / mxfp4 only) quantises the activations (module doc; LOSSY)."""
        if fmt not in _FMT_CODE:
            raise ValueError(f"unknown CPU expert format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")
        _act_dtype(act_dtype, fmt)  # before the allocation
        if min(num_experts, hidden_size, intermediate_size) < 1:
            raise ValueError(f"experts, hidden and intermediate sizes must be positive, got "
                             f"{num_experts}, {hidden_size}, {intermediate_size}")
        if fmt == "mxfp4" and (hidden_size % 32 or intermediate_size % 32):
            raise ValueError(f"mxfp4 needs hidden ({hidden_size}) and intermediate ({intermediate_size}) sizes "
                             "that are multiples of 32")
        per_expert = _lib().tandem_expert_bytes(_FMT_CODE[fmt], hidden_size, intermediate_size)
        pin = pin_memory and torch.cuda.is_available()
        data = torch.empty((num_experts, per_expert), dtype=torch.uint8, pin_memory=pin)  # [E, bytes]
        if not pin:
            _lib().tandem_advise_huge_pages(data.data_ptr(), data.numel())  # before the first touch
        return cls(data, num_experts, hidden_size, intermediate_size, fmt, swiglu_limit, act_dtype)

    @classmethod
    def from_dense(cls, gate: Tensor, up: Tensor, down: Tensor, fmt: str, *, swiglu_limit: float | None = None,
                   **kw) -> CpuExpertLayer:
        """gate, up [E, I, H], down [E, H, I], any float dtype."""
        if gate.dim() != 3:
            raise ValueError(f"from_dense wants gate [E, I, H], got shape {tuple(gate.shape)}")
        layer = cls.empty(gate.shape[0], gate.shape[2], gate.shape[1], fmt, swiglu_limit=swiglu_limit, **kw)
        for e in range(layer.num_experts):
            layer.set_expert(e, gate[e], up[e], down[e])
        return layer

    @classmethod
    def from_mxfp4(cls, gate: tuple[Tensor, Tensor], up: tuple[Tensor, Tensor], down: tuple[Tensor, Tensor], *,
                   swiglu_limit: float | None = None, **kw) -> CpuExpertLayer:
        """Each a (blocks uint8 [E, out, in/2], scales uint8 [E, out, in/32]) pair, kept as stored."""
        blocks = gate[0]
        if blocks.dim() != 3:
            raise ValueError(f"from_mxfp4 wants gate blocks [E, I, H/2], got shape {tuple(blocks.shape)}")
        layer = cls.empty(blocks.shape[0], blocks.shape[2] * 2, blocks.shape[1], "mxfp4", swiglu_limit=swiglu_limit,
                          **kw)
        for e in range(layer.num_experts):
            layer.set_expert_mxfp4(e, (gate[0][e], gate[1][e]), (up[0][e], up[1][e]), (down[0][e], down[1][e]))
        return layer

    @property
    def bytes_per_expert(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _shapes(self) -> dict[str, tuple[int, int]]:
        i, h = self.intermediate_size, self.hidden_size
        return {"gate": (i, h), "up": (i, h), "down": (h, i)}

    def _check_expert(self, e: int) -> None:
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} is outside 0..{self.num_experts - 1}")

    def set_expert(self, e: int, gate: Tensor, up: Tensor, down: Tensor) -> None:
        """Pack expert e from dense gate, up [I, H] and down [H, I] (any float dtype), converting
        to this layer's format; in place, one expert's temporaries at a time."""
        self._check_expert(e)
        parts = []
        for name, w in (("gate", gate), ("up", up), ("down", down)):
            if tuple(w.shape) != self._shapes()[name] or not w.is_floating_point():
                raise ValueError(f"expert {e} {name}: want a float tensor of shape {self._shapes()[name]}, "
                                 f"got {w.dtype} {tuple(w.shape)}")
            parts.append(_quantize(self.fmt, w.detach().to("cpu")))
        self._pack(e, parts)

    def set_expert_mxfp4(self, e: int, gate: tuple[Tensor, Tensor], up: tuple[Tensor, Tensor],
                         down: tuple[Tensor, Tensor]) -> None:
        """Pack expert e from checkpoint MXFP4: (blocks uint8 [out, in/2], scales uint8 [out, in/32])."""
        if self.fmt != "mxfp4":
            raise ValueError(f"set_expert_mxfp4 needs an mxfp4 layer; this one is {self.fmt}")
        self._check_expert(e)
        parts = []
        for name, (blocks, scales) in (("gate", gate), ("up", up), ("down", down)):
            rows, cols = self._shapes()[name]
            for what, t, shape in (("blocks", blocks, (rows, cols // 2)), ("scales", scales, (rows, cols // 32))):
                if tuple(t.shape) != shape or t.dtype != torch.uint8:
                    raise ValueError(f"expert {e} {name} {what}: want uint8 {shape}, got {t.dtype} {tuple(t.shape)}")
            parts.append((blocks.detach().to("cpu").contiguous(), scales.detach().to("cpu").contiguous()))
        self._pack(e, parts)

    def _pack(self, e: int, parts: list[tuple[Tensor, Tensor | None]]) -> None:
        (g, ga), (u, ua), (d, da) = parts
        _lib().tandem_pack_expert(_FMT_CODE[self.fmt], self.hidden_size, self.intermediate_size, self.data[e].data_ptr(),
                                  _ptr(g), _ptr(ga), _ptr(u), _ptr(ua), _ptr(d), _ptr(da))

    def dequantized(self) -> tuple[Tensor, Tensor, Tensor]:
        """fp32 gate, up [E, I, H] and down [E, H, I] exactly as the kernel sees them (for tests)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        gate, up, down = torch.empty(e, i, h), torch.empty(e, i, h), torch.empty(e, h, i)
        for x in range(e):
            _lib().tandem_unpack_expert(_FMT_CODE[self.fmt], h, i, self.data[x].data_ptr(),
                                        gate[x].data_ptr(), up[x].data_ptr(), down[x].data_ptr())
        return gate, up, down

    # ---- calls --------------------------------------------------------------------------------------

    def __call__(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """hidden [T, H] f32/bf16, topk_ids [T, k] int32/int64, topk_weights [T, k] f32/bf16, all on
        the CPU -> [T, H] in hidden's dtype."""
        self._check(hidden, topk_ids, topk_weights, None)
        hidden, topk_ids, topk_weights = hidden.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        if hidden.shape[0] > 0:
            self._run(self._call(hidden, topk_ids, topk_weights, out, None))
        return out

    def forward_into(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, out: Tensor,
                     num_tokens: int | None = None) -> None:
        """Like __call__ into `out` [rows, H] (hidden's dtype), computing only the first
        `num_tokens` rows (default all) and leaving the others untouched; allocates nothing."""
        self._check(hidden, topk_ids, topk_weights, out, contiguous=True)
        rows = hidden.shape[0]
        n = rows if num_tokens is None else num_tokens
        if not 0 <= n <= rows:
            raise ValueError(f"num_tokens {n} is outside 0..{rows} (the buffers' rows)")
        if n > 0:
            call = self._call(hidden, topk_ids, topk_weights, out, None)
            call.rows = n
            self._run(call)

    def host_job(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, out: Tensor,
                 num_tokens: Tensor) -> HostJob:
        """A call bound to these (pinned) buffers for a CUDA host node; `num_tokens` (int32 [1],
        CPU) is read when the job runs."""
        self._check(hidden, topk_ids, topk_weights, out, contiguous=True)
        if num_tokens.device.type != "cpu" or num_tokens.dtype != torch.int32 or num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must be a CPU int32 tensor of one element, got {num_tokens.dtype} "
                             f"{tuple(num_tokens.shape)} on {num_tokens.device}")
        call = self._call(hidden, topk_ids, topk_weights, out, num_tokens)
        return HostJob(call, (self.data, hidden, topk_ids, topk_weights, out, num_tokens))

    def _check(self, hidden: Tensor, ids: Tensor, weights: Tensor, out: Tensor | None, contiguous: bool = False) -> None:
        named = [("hidden", hidden), ("topk_ids", ids), ("topk_weights", weights)]
        if out is not None:
            named.append(("out", out))
        for name, t in named:
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}: the CPU expert kernel takes CPU tensors")
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
            if contiguous and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (the kernel keeps its pointer)")
        if hidden.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"hidden must be float32 or bfloat16, got {hidden.dtype}")
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden has {hidden.shape[1]} columns; this layer's hidden size is {self.hidden_size}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got {ids.dtype}")
        if weights.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"topk_weights must be float32 or bfloat16, got {weights.dtype}")
        if ids.shape[0] != hidden.shape[0] or tuple(weights.shape) != tuple(ids.shape) or ids.shape[1] < 1:
            raise ValueError(f"topk_ids {tuple(ids.shape)} and topk_weights {tuple(weights.shape)} must both be "
                             f"[{hidden.shape[0]}, k] with k >= 1 for hidden {tuple(hidden.shape)}")
        if out is not None and (tuple(out.shape) != tuple(hidden.shape) or out.dtype != hidden.dtype):
            raise ValueError(f"out must be {hidden.dtype} {tuple(hidden.shape)} like hidden, "
                             f"got {out.dtype} {tuple(out.shape)}")

    def _call(self, hidden: Tensor, ids: Tensor, weights: Tensor, out: Tensor, num_tokens: Tensor | None) -> _Call:
        return _Call(
            self.data.data_ptr(), self.bytes_per_expert, self.num_experts, self.hidden_size, self.intermediate_size,
            _FMT_CODE[self.fmt], self.swiglu_limit or 0.0, ACT_DTYPES.index(self.act_dtype),  # limit 0: no clamp
            hidden.data_ptr(), ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
            None if num_tokens is None else num_tokens.data_ptr(), hidden.shape[0], ids.shape[1],
            _DTYPE_CODE[hidden.dtype], _DTYPE_CODE[ids.dtype], _DTYPE_CODE[weights.dtype], 0, 0)

    def _run(self, call: _Call) -> None:
        _lib().tandem_moe(ctypes.byref(call))
        _raise_status(call, self.num_experts)


def _raise_status(call: _Call, num_experts: int) -> None:
    if call.status == 0:
        return
    if call.status == 1:
        raise ValueError(f"topk_ids holds expert {call.bad_value}, outside 0..{num_experts - 1} (-1: skip)")
    if call.status == 2:
        raise ValueError(f"num_tokens is {call.bad_value}, outside 0..{call.rows} (the buffers' rows)")
    if call.status == 3:
        raise MemoryError("the CPU expert kernel could not allocate its scratch buffers")
    raise ValueError(f"the CPU expert kernel rejected its arguments (status {call.status})")


class HostJob:
    """A call bound to fixed (pinned) buffers, run from a CUDA host node: `fn_ptr` is the address
    of the C function `void tandem_host_fn(void*)` (a cudaHostFn_t: no CUDA, no Python, safe while
    the GIL is held) and `arg_ptr` the address of its argument struct, which holds the buffers'
    pointers, the layer, and a pointer to `num_tokens` (int32 [1], read at run time, so one
    captured graph serves any count up to the buffers' rows). The object keeps the struct and the
    tensors alive. A host node cannot raise: a bad expert id or count leaves `out` untouched and
    sets `status`; `run()` (synchronous, for tests) raises it."""

    def __init__(self, call: _Call, keep: tuple[Tensor, ...]) -> None:
        self._call, self._keep = call, keep
        self.fn_ptr: int = ctypes.cast(_lib().tandem_host_fn, ctypes.c_void_p).value
        self.arg_ptr: int = ctypes.addressof(call)

    @property
    def status(self) -> int:
        """0 when the last run succeeded."""
        return self._call.status

    def run(self) -> None:
        _lib().tandem_moe(ctypes.byref(self._call))
        _raise_status(self._call, self._call.num_experts)


def quantize_int8_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """The int8 activation mode's quantisation: x [T, K] -> (q [T, nb, 32] fp32 integers in
    -127..127, d [T, nb, 1] fp32), nb = ceil(K / 32), the last block zero-padded: per block
    d = max|x| / 127 and q = x / d rounded half to even (d = 0: q = 0; a NaN or inf: d NaN, q 0)."""
    blocks = F.pad(x.float(), (0, -x.shape[-1] % 32)).unflatten(-1, (-1, 32))  # [T, nb, 32]
    amax = blocks.abs().amax(-1, keepdim=True)  # [T, nb, 1]
    d = torch.where(amax.isfinite(), amax / 127, torch.full_like(amax, math.nan))
    q = torch.where(d > 0, (blocks / d).round().clamp(-127, 127), torch.zeros_like(blocks))
    return q, d


def _int8_dequantized(x: Tensor) -> Tensor:
    """x [T, K] as the int8 activation mode sees it: q * d, fp32 [T, K]."""
    q, d = quantize_int8_activations(x)
    return (q * d).flatten(-2)[..., : x.shape[-1]]


def reference_moe(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate: Tensor, up: Tensor,
                  down: Tensor, swiglu_limit: float | None = None, act_dtype: str = "auto") -> Tensor:
    """Plain torch in fp32 with the weights as given (pass `dequantized()` ones): [T, H] float32,
    sum_j w[t, j] * down_e(silu(gate_e x) * up_e x), e = ids[t, j]; with `swiglu_limit` (as the
    layer takes it) gate_e x is clamped to <= limit and up_e x to [-limit, limit] first. With
    `act_dtype` "int8", x and the intermediate silu(.) * up_e x are first replaced by their int8
    quantisations q * d (`quantize_int8_activations`), as the kernel's int8 mode computes them."""
    limit = _swiglu_limit(swiglu_limit)
    int8 = _act_dtype(act_dtype, None) == "int8"
    x = _int8_dequantized(hidden) if int8 else hidden.float()
    w = topk_weights.float()
    out = torch.zeros(x.shape[0], down.shape[1])
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = x[tok]  # [n, H]
        g, u = h @ gate[e].float().T, h @ up[e].float().T  # [n, I]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        a = F.silu(g) * u  # [n, I]
        y = (_int8_dequantized(a) if int8 else a) @ down[e].float().T  # [n, H]
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out
