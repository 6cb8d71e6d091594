"""Builds the CPU expert kernel (tandem/offload/cpu_kernels/*.cpp) with the system C++ compiler on
first use and loads it with ctypes.

The library lands in `default_cache_dir() / "cpu_kernels" / <hash>/libtandem_moe.so`, the hash
covering the sources, the flags and the compiler's version, so an edit or a new compiler builds a
new one and an unchanged tree loads in milliseconds. Each ISA's file is compiled with its own -m
flags and the kernel picks one at run time (`__builtin_cpu_supports`), so the library is portable
across x86-64 CPUs (no -march=native). Concurrent first uses (two servers, pytest-xdist) take a
file lock; the build goes to a temporary directory renamed into place, so nobody loads half a
library. Nothing here touches the network.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.builtin import default_cache_dir

logger = logging.getLogger("tandem")

SOURCE_DIR = Path(__file__).resolve().parent / "cpu_kernels"
LIBRARY_NAME = "libtandem_moe.so"
_COMMON = ("-std=c++17", "-fPIC", "-fvisibility=hidden", "-DNDEBUG")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# avx512bf16 is not a file-wide flag: only the functions that use vdpbf16ps carry
# target("avx512bf16"), so the compiler cannot put it in the plain AVX-512 path.
_X86_UNITS: dict[str, tuple[str, ...]] = {
    "moe_common.cpp": ("-O2",),
    "moe_scalar.cpp": ("-O3",),
    "moe_avx2.cpp": ("-O3", *_AVX2),
    "moe_avx512.cpp": ("-O3", *_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "moe_doorbell.cpp": ("-O2",),
}
_PORTABLE_UNITS: dict[str, tuple[str, ...]] = {  # other CPUs: the scalar kernels only
    "moe_common.cpp": ("-O2", "-DTANDEM_SCALAR_ONLY"),
    "moe_scalar.cpp": ("-O3",),
    "moe_doorbell.cpp": ("-O2",),
}


class CpuKernelBuildError(RuntimeError):
    """The CPU expert kernel could not be compiled or loaded; the message says what to do."""


def _units() -> dict[str, tuple[str, ...]]:
    return _X86_UNITS if platform.machine().lower() in ("x86_64", "amd64") else _PORTABLE_UNITS


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        raise CpuKernelBuildError(
            f"{cxx} not found: the CPU expert kernel is compiled on first use; install gcc/g++ "
            "(e.g. `apt-get install g++`) or point $CXX at a C++17 compiler") from None
    if done.returncode != 0:
        raise CpuKernelBuildError(f"`{cxx} --version` failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def _digest(cxx: str, units: dict[str, tuple[str, ...]], extra_flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(_compiler_version(cxx).encode())
    h.update(repr((_COMMON, sorted(units.items()), tuple(extra_flags), platform.machine())).encode())
    for path in sorted(SOURCE_DIR.glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-3000:]
        raise CpuKernelBuildError(f"compiling the CPU expert kernel failed ({what}, exit {done.returncode}):\n"
                                  f"{' '.join(cmd)}\n{tail}")


def _compile(cxx: str, units: dict[str, tuple[str, ...]], extra_flags: Sequence[str], out_dir: Path) -> Path:
    objects, procs = [], []
    for name, flags in units.items():
        obj = out_dir / (Path(name).stem + ".o")
        cmd = [cxx, *_COMMON, *flags, *extra_flags, "-c", str(SOURCE_DIR / name), "-o", str(obj)]
        procs.append((name, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        objects.append(str(obj))
    stderr = [proc.communicate()[1] for _, _, proc in procs]  # they compile in parallel; wait for all
    for (name, cmd, proc), err in zip(procs, stderr):
        if proc.returncode != 0:
            raise CpuKernelBuildError(f"compiling the CPU expert kernel failed ({name}, exit {proc.returncode}):\n"
                                      f"{' '.join(cmd)}\n{err.strip()[-3000:]}")
    lib = out_dir / LIBRARY_NAME
    _run([cxx, "-shared", "-fPIC", "-pthread", *extra_flags, *objects, "-o", str(lib)], "link")
    for obj in objects:
        os.unlink(obj)
    return lib


def library_path(cxx: str | None = None, cache_dir: Path | None = None, extra_flags: Sequence[str] = ()) -> Path:
    """The built library, compiling it first if this source tree, flag set and compiler have no
    build yet. `cxx` defaults to $CXX or g++; `cache_dir` to Tandem's cache; `extra_flags` go to
    every compile and the link (e.g. sanitizers)."""
    cxx = cxx or os.environ.get("CXX") or "g++"
    if platform.system() != "Linux":
        raise CpuKernelBuildError("the CPU expert kernel needs Linux (futex, sched_setaffinity); "
                                  f"this is {platform.system()}")
    units = _units()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "cpu_kernels"
    final = root / _digest(cxx, units, extra_flags)
    lib = final / LIBRARY_NAME
    if lib.is_file():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same one
        if lib.is_file():
            return lib
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            _compile(cxx, units, extra_flags, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp made it private
            os.rename(tmp, final)  # atomic: a reader sees no library or a whole one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("Compiled the CPU expert kernel in %.1f s (%s)", time.perf_counter() - start, lib)
    return lib


def load_library(cxx: str | None = None, cache_dir: Path | None = None, extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """ctypes handle of the kernel library (built first if needed); see `library_path`."""
    path = library_path(cxx, cache_dir, extra_flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise CpuKernelBuildError(f"loading the CPU expert kernel {path} failed: {e}; "
                                  f"delete {path.parent} to rebuild it") from None
