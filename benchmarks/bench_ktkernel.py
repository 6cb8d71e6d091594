#!/usr/bin/env python3
"""Decode-time benchmark of ktransformers' kt-kernel CPU MoE kernel, for a side-by-side with
Tandem's CPU expert path: milliseconds per MoE layer call at batch 1..8, cold weights, and the
RAM bandwidth that implies.

What is timed
    kt-kernel's pybind11 extension called directly (its own Python wrapper, KTMoEWrapper, needs
    torch==2.9.1, gguf, safetensors, ... and only adds GPU<->CPU buffer plumbing): a CPUInfer
    worker pool of --threads threads (subpool 0 = NUMA node 0), one MoE object per layer
    (AMXFP4_KGroup_MOE for MXFP4, AMXBF16_MOE for BF16 -- the classes kt-kernel's
    NativeMoEWrapper picks), each built from per-expert weight pointers and loaded with
    load_weights_task (kt-kernel copies the weights into its own buffers), then per call
    `cpu_infer.submit(moe.forward_task(bsz*, top_k, expert_ids*, weights*, x*, y*, False))`
    + `cpu_infer.sync()` (the path kt-kernel's SGLang integration takes), x and y bf16
    [batch, hidden], expert ids int64 [batch, top_k], routing weights fp32 [batch, top_k].
    `--call direct` times `moe.forward(...)` on the calling thread instead.

Cold weights
    L layers are built and the calls cycle through them (call i runs layer i % L), so an expert's
    weights come from RAM, not the caches: L (unless --layers) is the largest of 2, enough layers
    for --working-set-gib of resident weights, and enough that the L-1 calls between two visits
    of one layer move at least 4x the caches (L3 + every core's L2, from sysfs) even at batch 1;
    if that does not fit in 70% of available memory (or --mem-budget-gib), fewer experts are kept
    per layer, then fewer layers. Routing is random top-k per token (distinct experts within a token), fresh
    every call. --num-experts-kept N keeps only N experts per layer; routing is still drawn over
    the model's full expert count and each call's distinct experts are mapped one-to-one onto
    kept experts, so distinct experts per call -- and bytes per token -- are the full model's
    (needs N >= batch x top_k, else the routing is drawn among the N kept experts and the meta
    file says "within-kept").

Bytes
    bytes = distinct experts touched in the call (mean over timed calls) x bytes per expert,
    bytes per expert = 3 x hidden x intermediate weights (gate, up: [I, H]; down: [H, I]) at
      bf16:  2 bytes per weight;
      mxfp4: 4.25 bits per weight = one 4-bit E2M1 code + one e8m0 byte per 32 weights
             (the checkpoint's bytes; 13,369,344 B per V4-Flash expert). kt-kernel itself holds
             the group scales as fp32 (5 bits per weight, 15,728,640 B), so it really streams
             ~18% more; the .meta.json has that "resident" figure too.
    gbps = bytes / median call time; share_of_ram = gbps / RAM read bandwidth, measured in this
    run in a subprocess (torch .sum() of a --ram-gib float32 buffer with one thread per CPU,
    best of 3; the meta file also has it at --threads threads) unless --ram-gbps is given.

Correctness
    Before timing, one batch-4 call on layer 0 is checked against a plain torch fp32 reference
    on the dequantized weights (silu(x Wg^T) * (x Wu^T) Wd^T, weighted by the routing weights):
    relative L2 error and cosine go in the table and the meta file; --check-tol fails the run.

Shapes and formats (--configs, default all three)
    qwen3-30b:bf16   Qwen3-30B-A3B experts: hidden 2048, 128 experts top-8, intermediate 768
    v4-flash:mxfp4   DeepSeek-V4-Flash: hidden 4096, 256 experts top-6, intermediate 2048
    v4-flash:bf16    the same shape in bf16 (12.9 GB per layer of 256 experts)
    (any shape:fmt pair of these works, e.g. qwen3-30b:mxfp4)
    Every shape:fmt runs in its own subprocess: kt-kernel never frees a MoE object's weight
    buffers, so one process per configuration keeps memory bounded.

Weights
    Random, generated in well under a second whatever the model size: one random block per
    fan-in (codes: uniform random bytes = uniform E2M1 nibbles; bf16: random sign and mantissa,
    4 adjacent exponents; MXFP4 scales: 2 adjacent e8m0 exponents; magnitudes ~1/sqrt(fan-in)),
    and every (layer, expert, projection) points at its own random 64-byte-aligned window of it.
    kt-kernel copies each window into its own buffers, so every expert of every layer occupies
    its own RAM.

Install of kt-kernel (no pip, no dependencies, any torch)
    bash benchmarks/pack_ktkernel.sh            # -> .ktk/kt_kernel_cpu.tar.xz (cp312, ~2.5 MiB)
    bash benchmarks/pack_ktkernel.sh --cp311    # -> .ktk/kt_kernel_cpu_cp311.tar.xz (local test)
    The tarball holds kt_kernel/_kt_kernel_ext_{amx,avx512_bf16}.cpython-3XX-x86_64-linux-gnu.so,
    kt_kernel/_cpu_detect.py and kt_kernel.libs/ (libnuma, libgomp, libhwloc, libmvec, libudev).
    The extensions link no libtorch/libc10, so torch's version does not matter; they need
    glibc >= 2.35 (manylinux_2_35) and libstdc++ with GLIBCXX_3.4.30 (GCC 12+).
    --tarball unpacks it into a temporary directory; --ktk-dir takes an unpacked tarball or a
    `pip install --no-deps --target DIR kt_kernel-*.whl` directory. Without either, the script
    looks for .ktk/kt_kernel_cpu.tar.xz (cp312) / .ktk/kt_kernel_cpu_cp3XX.tar.xz.

ISA build
    The wheel ships six builds of the extension (amx, avx512_bf16, avx512_vbmi, avx512_vnni,
    avx512_base, avx2); kt-kernel picks one from /proc/cpuinfo flags (amx needs amx_tile,
    amx_int8, amx_bf16 plus avx512f/bw/vnni/vbmi/bf16), overridable with KT_KERNEL_CPU_VARIANT,
    and falls back down that chain when a build is missing. This script uses the wheel's own
    picker (kt_kernel/_cpu_detect.py) and the same fallback; --variant forces one (refused if the
    host lacks its ISA). The MXFP4 kernel is AVX-512-BF16 (vpdpbf16ps with a nibble lookup) in
    every build that has it; the BF16 kernel uses AMX tiles only in the amx build.

Usage
    # local smoke test (tiny: 2 layers, few experts, batch 1 and 4, correctness checked)
    bash benchmarks/pack_ktkernel.sh --cp311
    python benchmarks/bench_ktkernel.py --quick --tarball .ktk/kt_kernel_cpu_cp311.tar.xz

    # the remote (16-core Xeon, AMX, 128 GiB): full shapes, batches 1,2,4,8, 15 threads
    python benchmarks/bench_ktkernel.py --tarball .ktk/kt_kernel_cpu.tar.xz \\
        --out benchmarks/results/ktkernel_cpu.json

    Options: --configs qwen3-30b:bf16,v4-flash:mxfp4 --batches 1,4 --threads 15 --layers L
    --num-experts-kept N --working-set-gib 8 --mem-budget-gib G --iters 200 --warmup 20 --ram-gbps X --ram-gib 4
    --variant amx --call submit|direct --seed 0 --check-tol 0.03 --no-check --verbose

Output
    A table on stdout; --out FILE gets a JSON list, one record per (shape, fmt, batch):
    {"impl": "kt-kernel", "shape", "fmt", "batch", "ms_per_layer", "distinct_experts", "bytes",
     "gbps", "share_of_ram"}; FILE with .meta.json instead of .json gets the rest (RAM figure,
    variant, layers, experts kept, p10/p90 call times, resident bytes, correctness check, host).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "qwen3-30b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8},
    "v4-flash": {"hidden": 4096, "inter": 2048, "experts": 256, "top_k": 6},
}
FORMATS = ("bf16", "mxfp4")
DEFAULT_CONFIGS = "qwen3-30b:bf16,v4-flash:mxfp4,v4-flash:bf16"
MXFP4_GROUP = 32
# E2M1 code -> value (OCP MX): bit 3 sign, bits 0-2 magnitude index.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)
VARIANT_CHAIN = ["amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2"]
GiB = 1 << 30


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# bytes per expert
# ----------------------------------------------------------------------------------------------
def expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Checkpoint bytes of one routed expert (gate, up, down): bf16 2 B/weight; mxfp4 4.25
    bits/weight (4-bit E2M1 code + one e8m0 byte per 32 weights)."""
    n = 3 * hidden * inter
    if fmt == "bf16":
        return 2 * n
    if fmt == "mxfp4":
        return n // 2 + n // MXFP4_GROUP
    raise ValueError(fmt)


def resident_expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """What kt-kernel holds per expert: bf16 the same; mxfp4 codes + an fp32 scale per group."""
    n = 3 * hidden * inter
    return 2 * n if fmt == "bf16" else n // 2 + 4 * (n // MXFP4_GROUP)


# ----------------------------------------------------------------------------------------------
# finding and loading the extension
# ----------------------------------------------------------------------------------------------
def default_tarball() -> str | None:
    tag = f"{sys.version_info.major}{sys.version_info.minor}"
    for name in ([f"kt_kernel_cpu_cp{tag}.tar.xz"] + (["kt_kernel_cpu.tar.xz"] if tag == "312" else [])):
        p = os.path.join(REPO, ".ktk", name)
        if os.path.exists(p):
            return p
    return None


def unpack(tarball: str) -> str:
    d = tempfile.mkdtemp(prefix="ktk_")
    with tarfile.open(tarball) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(d, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            t.extractall(d)
    return d


def _load_module_from(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_extension(ktk_dir: str, variant: str = "auto"):
    """Load kt-kernel's extension for this host the way kt_kernel/__init__.py does (its
    _cpu_detect picks the ISA build from /proc/cpuinfo, KT_KERNEL_CPU_VARIANT overrides), but
    without importing the kt_kernel package (which imports torch, gguf, safetensors, ...)."""
    kt_dir = os.path.join(ktk_dir, "kt_kernel")
    if not os.path.isdir(kt_dir):
        raise SystemExit(f"no kt_kernel/ under {ktk_dir}")
    if ktk_dir not in sys.path:  # as a --no-deps install would be (kt_kernel itself is not imported)
        sys.path.insert(0, ktk_dir)
    detect = _load_module_from(os.path.join(kt_dir, "_cpu_detect.py"), "_ktk_cpu_detect")
    host = detect.detect_cpu_features()  # honours KT_KERNEL_CPU_VARIANT
    wanted = host if variant == "auto" else variant
    if variant != "auto" and VARIANT_CHAIN.index(variant) < VARIANT_CHAIN.index(host):
        raise SystemExit(f"--variant {variant} needs an ISA this host lacks (its best build is {host})")
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    for v in VARIANT_CHAIN[VARIANT_CHAIN.index(wanted):]:
        hits = glob.glob(os.path.join(kt_dir, f"_kt_kernel_ext_{v}.{tag}-*.so"))
        if hits:
            ext = _load_module_from(hits[0], "kt_kernel_ext")
            loaded = str(getattr(ext, "__cpu_variant__", v))
            if v != wanted:
                log(f"[ktk] no {wanted} build in {ktk_dir}; fell back to {v}")
            return ext, loaded, hits[0], host
    have = sorted(os.path.basename(p) for p in glob.glob(os.path.join(kt_dir, "_kt_kernel_ext_*.so")))
    raise SystemExit(f"no kt-kernel extension for {tag} at or below {wanted} in {kt_dir} (have: {have}); "
                     f"pack one with benchmarks/pack_ktkernel.sh --cp{sys.version_info.major}{sys.version_info.minor}")


# ----------------------------------------------------------------------------------------------
# host facts
# ----------------------------------------------------------------------------------------------
def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def l2_bytes() -> int:
    return _cache_bytes("2") or (2 << 20)


def l3_bytes() -> int:
    return _cache_bytes("3") or (64 << 20)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _cache_bytes(level: str) -> int:
    best = 0
    for p in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/"):
        try:
            if _read(p + "level").strip() != level or "Instruction" in _read(p + "type"):
                continue
            s = _read(p + "size").strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            best = max(best, int(s.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best


def mem_available() -> int:
    try:
        for line in _read("/proc/meminfo").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def host_info() -> dict:
    model, flags = None, set()
    try:
        for line in _read("/proc/cpuinfo").splitlines():
            if model is None and line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if not flags and line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            if model and flags:
                break
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni"))
    return {"cpu": model, "cpus": cpu_count(), "isa": isa, "l3_bytes": l3_bytes(), "l2_bytes": l2_bytes(),
            "mem_available": mem_available(), "python": platform.python_version(), "numpy": np.__version__}


# ----------------------------------------------------------------------------------------------
# RAM read bandwidth (own subprocess: its threads and buffer are gone before kt-kernel starts)
# ----------------------------------------------------------------------------------------------
_RAM_CHILD = r"""
import sys, time
nbytes, threads = int(sys.argv[1]), int(sys.argv[2])
try:
    import torch
    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    run = lambda: float(buf.sum())
    how = f"torch {torch.__version__} float32 sum, {threads} threads"
except ImportError:
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor
    buf = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(buf, threads)
    pool = ThreadPoolExecutor(threads)
    run = lambda: sum(pool.map(np.sum, parts))
    how = f"numpy float32 sum, {threads} threads"
run()
best = float("inf")
for _ in range(3):
    t = time.perf_counter(); run(); best = min(best, time.perf_counter() - t)
print(nbytes / best / 1e9, how, sep="|")
"""


def measure_ram_gbps(nbytes: int, threads: int) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", _RAM_CHILD, str(nbytes), str(threads)],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    gbps, how = out.split("|", 1)
    return float(gbps), f"{how}, {nbytes / GiB:.1f} GiB buffer, best of 3"


# ----------------------------------------------------------------------------------------------
# random weights
# ----------------------------------------------------------------------------------------------
def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (round to nearest even)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


class WeightSource:
    """Random blocks that per-expert windows point into (see the module docstring)."""

    SLACK = 8 << 20  # bytes of random offsets per block: 131072 distinct 64-byte-aligned windows
    SCALE_SLACK = 1 << 20  # scale elements of random offsets (mxfp4): 32768 distinct windows

    def __init__(self, fmt: str, hidden: int, inter: int, rng: np.random.Generator):
        self.fmt, self.hidden, self.inter, self.rng = fmt, hidden, inter, rng
        n = hidden * inter  # weights of one projection
        self.blocks = {}
        for fan_in in sorted({hidden, inter}):
            if fmt == "bf16":
                raw = rng.integers(0, 256, size=2 * n + self.SLACK, dtype=np.uint8)
                w = raw.view(np.uint16)
                # keep sign, mantissa and the 2 low exponent bits; exponent = base + (0..3), chosen
                # so that the mean |w| (~5.6 x 2^(base-127)) is about 1/sqrt(fan_in)
                base = 127 + round(math.log2(1.0 / (5.6 * math.sqrt(fan_in))))
                np.bitwise_and(w, np.uint16(0x81FF), out=w)
                np.add(w, np.uint16(base << 7), out=w)
                self.blocks[fan_in] = (raw, None)
            else:
                codes = rng.integers(0, 256, size=n // 2 + self.SLACK, dtype=np.uint8)
                # e8m0 scale 2^(e-127), e in {e0, e0+1}; mean |E2M1| = 2.25
                e0 = 127 + round(math.log2(1.0 / (2.25 * 1.5 * math.sqrt(fan_in))))
                ns = n // MXFP4_GROUP + self.SCALE_SLACK
                e = (e0 + rng.integers(0, 2, size=ns)).astype(np.uint16)
                scales = (e << 7).astype(np.uint16)  # the bf16 kt-kernel takes: 2^(e-127) exactly
                self.blocks[fan_in] = (codes, scales)

    def window(self) -> tuple[int, int]:
        """Random (weight byte offset, scale element offset), 64-byte aligned."""
        o = int(self.rng.integers(0, self.SLACK // 64)) * 64
        so = int(self.rng.integers(0, self.SCALE_SLACK // 32)) * 32
        return o, so

    def make_layer(self, experts: int) -> dict:
        """Pointers (and offsets, for the reference) of every expert's gate/up/down of a layer."""
        lay = {"gate": [], "up": [], "down": [], "gate_s": [], "up_s": [], "down_s": [], "off": []}
        for _ in range(experts):
            offs = {}
            for proj, fan_in in (("gate", self.hidden), ("up", self.hidden), ("down", self.inter)):
                wo, so = self.window()
                w, s = self.blocks[fan_in]
                lay[proj].append(w.ctypes.data + wo)
                lay[proj + "_s"].append(0 if s is None else s.ctypes.data + 2 * so)
                offs[proj] = (wo, so)
            lay["off"].append(offs)
        return lay

    def dense(self, lay: dict, expert: int, proj: str) -> np.ndarray:
        """fp32 [out, in] weight of one projection, dequantized from its window."""
        out_f, in_f = (self.hidden, self.inter) if proj == "down" else (self.inter, self.hidden)
        wo, so = lay["off"][expert][proj]
        w, s = self.blocks[in_f]
        n = out_f * in_f
        if self.fmt == "bf16":
            return bits_to_f32(w[wo:wo + 2 * n].view(np.uint16)).reshape(out_f, in_f)
        codes = w[wo:wo + n // 2].reshape(out_f, in_f // 2)
        vals = np.empty((out_f, in_f), dtype=np.float32)
        vals[:, 0::2] = E2M1[codes & 0x0F]  # low nibble = even element
        vals[:, 1::2] = E2M1[codes >> 4]
        scale = bits_to_f32(s[so:so + n // MXFP4_GROUP]).reshape(out_f, in_f // MXFP4_GROUP)
        return vals * np.repeat(scale, MXFP4_GROUP, axis=1)


# ----------------------------------------------------------------------------------------------
# kt-kernel objects
# ----------------------------------------------------------------------------------------------
def make_cpu_infer(ext, threads: int):
    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count = 1
    cfg.subpool_numa_map = [0]
    cfg.subpool_thread_count = [threads]
    return ext.CPUInfer(cfg)


def moe_class(ext, fmt: str):
    mod = ext.moe
    if fmt == "mxfp4":
        forced = os.environ.get("KT_MXFP4_BACKEND", "").strip().lower()
        order = ["AVX2MXFP4_MOE"] if forced == "avx2" else ["AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE"]
    else:
        order = ["AMXBF16_MOE", "AVX2BF16_MOE"]
    for name in order:
        cls = getattr(mod, name, None)
        if cls is not None:
            return cls, name
    raise SystemExit(f"this kt-kernel build has no {fmt} MoE class (looked for {order})")


def build_moe(ext, cpu_infer, cls, fmt: str, shape: dict, experts: int, lay: dict, layer_idx: int,
              max_len: int):
    cfg = ext.moe.MOEConfig(experts, shape["top_k"], shape["hidden"], shape["inter"])
    cfg.layer_idx = layer_idx
    cfg.pool = cpu_infer.backend_
    cfg.max_len = max_len
    cfg.gate_projs = [lay["gate"]]
    cfg.up_projs = [lay["up"]]
    cfg.down_projs = [lay["down"]]
    cfg.gate_scales = [lay["gate_s"]]
    cfg.up_scales = [lay["up_s"]]
    cfg.down_scales = [lay["down_s"]]
    if fmt == "mxfp4":
        cfg.quant_config.bits = 4
        cfg.quant_config.group_size = MXFP4_GROUP
        cfg.quant_config.zero_point = False
    moe = cls(cfg)
    p2l = np.arange(experts, dtype=np.int64)
    cpu_infer.submit(moe.load_weights_task(p2l.ctypes.data))
    cpu_infer.sync()
    return moe, p2l


def make_routing(rng, calls: int, batch: int, top_k: int, full_experts: int, kept: int):
    """Random top-k routing per token over the model's full expert count; when fewer experts are
    kept, each call's distinct experts map one-to-one onto kept experts (same sharing pattern,
    same distinct count). Returns ids [calls, batch, top_k] int64, weights fp32, distinct, mode."""
    ids = np.argpartition(rng.random((calls, batch, full_experts)), top_k - 1, axis=-1)[..., :top_k]
    mode = "full"
    if kept < full_experts:
        if kept >= batch * top_k:
            mode = "full-mapped"
            for c in range(calls):
                u, inv = np.unique(ids[c], return_inverse=True)
                ids[c] = rng.choice(kept, size=len(u), replace=False)[inv.reshape(batch, top_k)]
        else:
            mode = "within-kept"
            ids = np.argpartition(rng.random((calls, batch, kept)), top_k - 1, axis=-1)[..., :top_k]
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    w = rng.random((calls, batch, top_k)).astype(np.float32) + 0.05
    w /= w.sum(-1, keepdims=True)
    distinct = np.array([len(np.unique(ids[c])) for c in range(calls)])
    return ids, np.ascontiguousarray(w), distinct, mode


def reference(src: WeightSource, lay: dict, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Plain fp32 MoE in torch (numpy if torch is missing): sum_k w_k * (silu(x Wg^T) * (x Wu^T)) Wd^T
    over the routed experts, on the weights dequantized from the same bytes kt-kernel loaded."""
    try:
        import torch
    except ImportError:
        torch = None
    xf = bits_to_f32(x)
    y = np.zeros((x.shape[0], src.hidden), dtype=np.float32)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        wg, wu, wd = (src.dense(lay, int(e), p) for p in ("gate", "up", "down"))
        xe = xf[tok]
        if torch is not None:
            xe_t = torch.from_numpy(xe)
            h = torch.nn.functional.silu(xe_t @ torch.from_numpy(wg).T) * (xe_t @ torch.from_numpy(wu).T)
            out = (h @ torch.from_numpy(wd).T).numpy()
        else:
            g = xe @ wg.T
            h = g / (1.0 + np.exp(-g)) * (xe @ wu.T)
            out = h @ wd.T
        np.add.at(y, tok, out * w[tok, slot][:, None])
    return y


def plan_layers(args, experts: int, top_k: int, bpe_res: int, max_batch: int) -> tuple[int, int, str]:
    """(layers, experts kept per layer, why). Cold: the traffic of the L-1 calls between two visits
    of one layer is >= 4x the caches (L3 + every core's L2) even at batch 1; big: >= --working-set-gib
    resident; both within 70% of available memory (plus one layer's temporary copy while loading),
    dropping experts per layer first (the routing stays the full model's, see make_routing)."""
    cache = l3_bytes() + cpu_count() * l2_bytes()
    l_traffic = 1 + math.ceil(4 * cache / (top_k * bpe_res))
    budget = args.mem_budget_gib * GiB if args.mem_budget_gib else 0.7 * mem_available()
    kept = min(experts, args.num_experts_kept) if args.num_experts_kept else experts
    if args.layers:
        return args.layers, kept, "given"
    l_ws = math.ceil(args.working_set_gib * GiB / (kept * bpe_res))
    layers = max(2, l_ws, l_traffic)
    why = f"cache traffic rule {l_traffic} (caches {cache / 2**20:.0f} MiB), working-set rule {l_ws}"
    if (layers + 1) * kept * bpe_res > budget and not args.num_experts_kept:
        layers = max(2, l_traffic)
        kept = max(min(experts, max_batch * top_k), min(experts, int(budget // ((layers + 1) * bpe_res))))
        why += f"; {kept} experts kept per layer to fit {budget / GiB:.0f} GiB"
    if (layers + 1) * kept * bpe_res > budget:
        layers = max(1, int(budget // (kept * bpe_res)) - 1)
        why += f"; memory-capped at {layers} layers"
    return layers, kept, why


# ----------------------------------------------------------------------------------------------
# one shape:fmt, in its own process
# ----------------------------------------------------------------------------------------------
def run_config(args) -> dict:
    shape_name, fmt = args.child.split(":")
    shape = SHAPES[shape_name]
    H, I, E, K = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    batches = [int(b) for b in args.batches.split(",")]
    ext, variant, so, host_variant = load_extension(args.ktk_dir, args.variant)
    cls, cls_name = moe_class(ext, fmt)
    bpe, bpe_res = expert_bytes(fmt, H, I), resident_expert_bytes(fmt, H, I)
    L, kept, why = plan_layers(args, E, K, bpe_res, max(batches))
    per_layer = kept * bpe_res
    log(f"[{shape_name}:{fmt}] {variant} build ({os.path.basename(so)}), {cls_name}, {args.threads} threads, "
        f"{L} layers x {kept} experts = {L * per_layer / GiB:.1f} GiB resident ({why})")

    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    src = WeightSource(fmt, H, I, rng)
    cpu_infer = make_cpu_infer(ext, args.threads)
    check_batch = 4
    max_len = max(batches + [check_batch])
    moes, keep_alive, layers = [], [], []
    for li in range(L):
        lay = src.make_layer(kept)
        moe, p2l = build_moe(ext, cpu_infer, cls, fmt, shape, kept, lay, li, max_len)
        moes.append(moe)
        keep_alive.append(p2l)
        layers.append(lay if li == 0 else None)
    load_s = time.perf_counter() - t0
    log(f"[{shape_name}:{fmt}] built and loaded {L} layers in {load_s:.1f} s")

    x_f = rng.standard_normal((max_len, H)).astype(np.float32)
    x = bf16_bits(x_f)
    y = np.zeros((max_len, H), dtype=np.uint16)

    check = None
    if not args.no_check:
        ids, w, _, mode = make_routing(rng, 1, check_batch, K, E, kept)
        bsz = np.array([check_batch], dtype=np.int32)
        cpu_infer.submit(moes[0].forward_task(bsz.ctypes.data, K, ids.ctypes.data, w.ctypes.data,
                                              x.ctypes.data, y.ctypes.data, False))
        cpu_infer.sync()
        got = bits_to_f32(y[:check_batch])
        t = time.perf_counter()
        ref = reference(src, layers[0], x[:check_batch], ids[0], w[0])
        rel = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
        # negative control: the same reference with every expert id shifted by one must not match
        wrong = reference(src, layers[0], x[:check_batch], (ids[0] + 1) % kept, w[0])
        rel_wrong = float(np.linalg.norm(got - wrong) / max(np.linalg.norm(wrong), 1e-30))
        cos = float((got * ref).sum() / max(np.linalg.norm(got) * np.linalg.norm(ref), 1e-30))
        check = {"batch": check_batch, "layer": 0, "rel_l2": rel, "cosine": cos,
                 "max_abs_err": float(np.abs(got - ref).max()), "ref_rms": float(np.sqrt((ref ** 2).mean())),
                 "finite": bool(np.isfinite(got).all()), "tol": args.check_tol,
                 "rel_l2_shifted_experts": rel_wrong,
                 "ok": bool(np.isfinite(got).all() and rel <= args.check_tol), "routing": mode,
                 "ref_seconds": round(time.perf_counter() - t, 2)}
        log(f"[{shape_name}:{fmt}] check vs torch fp32 reference (batch {check_batch}): rel L2 {rel:.2e}, "
            f"cosine {cos:.6f} -> {'OK' if check['ok'] else 'FAIL'} (vs shifted experts: rel L2 {rel_wrong:.2f})")
    layers.clear()

    rows = []
    for b in batches:
        calls = args.warmup + args.iters
        ids, w, distinct, mode = make_routing(rng, calls, b, K, E, kept)
        bsz = np.array([b], dtype=np.int32)
        id_stride, w_stride = ids[0].nbytes, w[0].nbytes
        ids_p, w_p, x_p, y_p, b_p = ids.ctypes.data, w.ctypes.data, x.ctypes.data, y.ctypes.data, bsz.ctypes.data
        times = np.empty(calls)
        pc = time.perf_counter
        if args.call == "direct":
            for c in range(calls):
                moe = moes[c % L]
                t = pc()
                moe.forward(b_p, K, ids_p + c * id_stride, w_p + c * w_stride, x_p, y_p, False)
                times[c] = pc() - t
        else:
            submit, sync = cpu_infer.submit, cpu_infer.sync
            for c in range(calls):
                task = moes[c % L].forward_task(b_p, K, ids_p + c * id_stride, w_p + c * w_stride, x_p, y_p, False)
                t = pc()
                submit(task)
                sync()
                times[c] = pc() - t
        tt = times[args.warmup:]
        dd = distinct[args.warmup:]
        med = float(np.median(tt))
        d_mean = float(dd.mean())
        nbytes = d_mean * bpe
        rows.append({
            "batch": b, "ms_per_layer": med * 1e3, "distinct_experts": d_mean, "bytes": round(nbytes),
            "gbps": nbytes / med / 1e9,
            "ms_p10": float(np.percentile(tt, 10)) * 1e3, "ms_p90": float(np.percentile(tt, 90)) * 1e3,
            "ms_mean": float(tt.mean()) * 1e3, "ms_min": float(tt.min()) * 1e3,
            "distinct_min": int(dd.min()), "distinct_max": int(dd.max()),
            "bytes_resident": round(d_mean * bpe_res), "gbps_resident": d_mean * bpe_res / med / 1e9,
            "routing": mode, "calls_timed": len(tt),
        })
        log(f"[{shape_name}:{fmt}] batch {b}: {med * 1e3:.3f} ms/layer (p10 {rows[-1]['ms_p10']:.3f}, "
            f"p90 {rows[-1]['ms_p90']:.3f}), {d_mean:.1f} distinct experts, {nbytes / 1e9 / med:.1f} GB/s")
    return {"shape": shape_name, "fmt": fmt, "hidden": H, "inter": I, "experts": E, "top_k": K,
            "experts_kept": kept, "layers": L, "layers_why": why, "resident_gib": L * per_layer / GiB,
            "bytes_per_expert": bpe, "bytes_per_expert_resident": bpe_res, "variant": variant,
            "host_variant": host_variant, "extension": os.path.basename(so), "moe_class": cls_name,
            "threads": args.threads, "call": args.call, "warmup": args.warmup, "iters": args.iters,
            "load_seconds": round(load_s, 2), "check": check, "rows": rows}


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tarball", help="kt-kernel CPU tarball from benchmarks/pack_ktkernel.sh (unpacked to a temp dir)")
    p.add_argument("--ktk-dir", help="an unpacked tarball or a pip --target dir holding kt_kernel/")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"shape:fmt,... (default {DEFAULT_CONFIGS})")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--threads", type=int, default=None, help="kt-kernel worker threads (default 15, "
                   "or cores-1 on smaller hosts; 16 on 16 cores stalls)")
    p.add_argument("--layers", type=int, default=0, help="layers to cycle through (default: auto, see doc)")
    p.add_argument("--working-set-gib", type=float, default=8.0)
    p.add_argument("--mem-budget-gib", type=float, default=0.0,
                   help="RAM the layers may take (default 70%% of MemAvailable; give it where MemAvailable "
                        "reads low at start, as on VMs whose memory grows as it is used)")
    p.add_argument("--num-experts-kept", type=int, default=0, help="experts per layer (default: all)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ram-gbps", type=float, default=None, help="RAM read GB/s to divide by (default: measure)")
    p.add_argument("--ram-gib", type=float, default=4.0)
    p.add_argument("--variant", default="auto", choices=["auto"] + VARIANT_CHAIN)
    p.add_argument("--call", default="submit", choices=["submit", "direct"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-tol", type=float, default=0.03, help="max relative L2 error of the check")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny local run: 2 layers, few experts, batch 1,4")
    p.add_argument("--out", help="JSON results (and OUT.meta.json)")
    p.add_argument("--verbose", action="store_true", help="show kt-kernel's own prints")
    p.add_argument("--keep-unpacked", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ncpu = cpu_count()
    if args.threads is None:
        args.threads = 15 if ncpu >= 16 else max(1, ncpu - 1)
    if args.threads >= ncpu and not args.child:
        log(f"warning: {args.threads} worker threads on {ncpu} cores: kt-kernel pins one worker per core and "
            f"the submitting thread needs one too (16 on 16 stalls at ~8 ms per call)")
    if args.quick:
        args.batches = "1,4" if args.batches == "1,2,4,8" else args.batches
        args.layers = args.layers or 2
        args.iters = min(args.iters, 20)
        args.warmup = min(args.warmup, 4)
        args.ram_gib = min(args.ram_gib, 1.0)
    for c in args.configs.split(","):
        s, _, f = c.partition(":")
        if s not in SHAPES or f not in FORMATS:
            p.error(f"bad config {c!r}: shapes {sorted(SHAPES)}, formats {FORMATS}")
    return args


def child_cmd(args, config: str, out: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--child-out", out,
           "--ktk-dir", args.ktk_dir, "--batches", args.batches, "--threads", str(args.threads),
           "--layers", str(args.layers), "--working-set-gib", str(args.working_set_gib),
           "--mem-budget-gib", str(args.mem_budget_gib),
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--variant", args.variant,
           "--call", args.call, "--seed", str(args.seed), "--check-tol", str(args.check_tol)]
    kept = args.num_experts_kept
    if args.quick and not kept:
        s = SHAPES[config.split(":")[0]]
        kept = max(int(b) for b in args.batches.split(",")) * s["top_k"]  # smallest that keeps full routing
    if kept:
        cmd += ["--num-experts-kept", str(kept)]
    if args.no_check:
        cmd.append("--no-check")
    return cmd


def print_table(results: list[dict], ram_gbps: float) -> None:
    print(f"\nkt-kernel CPU MoE, RAM read {ram_gbps:.1f} GB/s")
    hdr = (f"{'shape':<10} {'fmt':<6} {'batch':>5} {'ms/layer':>9} {'p10':>8} {'p90':>8} {'distinct':>8} "
           f"{'MB':>8} {'GB/s':>7} {'share':>6} {'GB/s res':>8} {'layers':>6} {'check':>14}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        chk = r.get("check")
        c = "-" if not chk else f"{'ok' if chk['ok'] else 'FAIL'} {chk['rel_l2']:.1e}"
        for row in r["rows"]:
            print(f"{r['shape']:<10} {r['fmt']:<6} {row['batch']:>5} {row['ms_per_layer']:>9.3f} "
                  f"{row['ms_p10']:>8.3f} {row['ms_p90']:>8.3f} {row['distinct_experts']:>8.1f} "
                  f"{row['bytes'] / 1e6:>8.1f} {row['gbps']:>7.1f} {row['gbps'] / ram_gbps:>6.0%} "
                  f"{row['gbps_resident']:>8.1f} {r['layers']:>6} {c:>14}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        res = run_config(args)
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return 0

    tmp = None
    if args.ktk_dir is None:
        tarball = args.tarball or default_tarball()
        if tarball is None:
            raise SystemExit("give --tarball (bash benchmarks/pack_ktkernel.sh makes one) or --ktk-dir")
        tmp = unpack(tarball)
        args.ktk_dir = tmp
        log(f"[ktk] unpacked {tarball} into {tmp}")
    try:
        info = host_info()
        if args.ram_gbps is None:
            ram_gbps, how = measure_ram_gbps(int(args.ram_gib * GiB), cpu_count())
            ram_kt, how_kt = measure_ram_gbps(int(args.ram_gib * GiB), args.threads)
            log(f"[ram] {ram_kt:.1f} GB/s at {args.threads} threads ({how_kt})")
        else:
            ram_gbps, how = args.ram_gbps, "given (--ram-gbps)"
            ram_kt = None
        log(f"[ram] {ram_gbps:.1f} GB/s ({how})")
        results, failed = [], []

        def write_out() -> None:
            records = [{"impl": "kt-kernel", "shape": r["shape"], "fmt": r["fmt"], "batch": row["batch"],
                        "ms_per_layer": round(row["ms_per_layer"], 4),
                        "distinct_experts": round(row["distinct_experts"], 3), "bytes": row["bytes"],
                        "gbps": round(row["gbps"], 3), "share_of_ram": round(row["gbps"] / ram_gbps, 4)}
                       for r in results for row in r["rows"]]
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
            meta = {"ram_gbps": ram_gbps, "ram_how": how, "ram_gbps_at_threads": ram_kt, "host": info,
                    "configs": results, "failed": failed,
                    "bytes_definition": "distinct experts (mean over timed calls) x bytes per expert; bytes per "
                                        "expert = 3*hidden*inter weights at bf16 2 B, mxfp4 4.25 bits (E2M1 code "
                                        "+ e8m0 byte per 32); *_resident: kt-kernel's own fp32-scale layout "
                                        "(mxfp4 5 bits)",
                    "args": {k: v for k, v in vars(args).items() if k not in ("child", "child_out")}}
            with open(args.out.removesuffix(".json") + ".meta.json", "w") as f:
                json.dump(meta, f, indent=1)

        with tempfile.TemporaryDirectory(prefix="ktk_res_") as rd:
            for config in args.configs.split(","):
                out = os.path.join(rd, config.replace(":", "_") + ".json")
                t = time.perf_counter()
                proc = subprocess.run(child_cmd(args, config, out), check=False, text=True,
                                      stdout=None if args.verbose else subprocess.PIPE)
                if proc.returncode != 0 or not os.path.exists(out):
                    tail = "" if args.verbose else "\n".join((proc.stdout or "").splitlines()[-30:])
                    why = f"exit {proc.returncode}"
                    if proc.returncode < 0:
                        why = f"killed by signal {-proc.returncode}"
                        if -proc.returncode == 4:
                            why += " (SIGILL: this build uses instructions the CPU lacks, e.g. AMX)"
                    log(f"[{config}] FAILED ({why}); kt-kernel output tail:\n{tail}")
                    failed.append(config)
                else:
                    with open(out) as f:
                        results.append(json.load(f))
                    log(f"[{config}] done in {time.perf_counter() - t:.0f} s")
                if args.out:  # after every configuration, so a time-out keeps what finished
                    write_out()
        if results:
            print_table(results, ram_gbps)
        if args.out:
            log(f"wrote {args.out} and {args.out.removesuffix('.json')}.meta.json")
        bad = [r["shape"] + ":" + r["fmt"] for r in results if r.get("check") and not r["check"]["ok"]]
        if bad:
            log(f"correctness check FAILED for {bad}")
        return 1 if (failed or bad) else 0
    finally:
        if tmp and not args.keep_unpacked:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
