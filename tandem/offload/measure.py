"""Machine constants the planner predicts decode speed from (`tandem plan --measure`): RAM read
bandwidth (the CPU expert kernel's own thread pool streaming a buffer far larger than the caches),
PCIe host-to-device bandwidth from pinned memory, GPU memory bandwidth, and the latency of the
small GPU -> CPU -> GPU round trip an offloaded layer makes each step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("tandem")

GB = 1e9


@dataclass(frozen=True)
class MachineConstants:
    ram_read: float  # bytes/s, all CPU expert threads
    gpu_read: float  # bytes/s (a device-to-device copy counts its read and its write)
    h2d: float  # bytes/s, pinned host -> device
    roundtrip: float  # seconds: a few KiB device -> host -> device, synchronised

    def describe(self) -> str:
        return (f"RAM read {self.ram_read / GB:.1f} GB/s, GPU {self.gpu_read / GB:.0f} GB/s, PCIe host->device "
                f"{self.h2d / GB:.1f} GB/s, GPU->CPU->GPU round trip {self.roundtrip * 1e6:.0f} us")


def _best_seconds(fn, repeats: int) -> float:  # noqa: ANN001 - a no-argument callable
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gpu_read_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(device)

    copy()
    return 2 * nbytes / _best_seconds(copy, repeats)


def h2d_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    copy()
    return nbytes / _best_seconds(copy, repeats)


def roundtrip_seconds(device: torch.device, nbytes: int = 8192, repeats: int = 50) -> float:
    """Median of a device -> pinned host -> device copy of `nbytes` (a decode step's hidden state
    of one layer is 4-16 KiB), each synchronised."""
    gpu = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        host.copy_(gpu, non_blocking=True)
        gpu.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_machine(device: torch.device | str = "cuda", ram_bytes: int = 2 << 30,
                    threads: int | None = None) -> MachineConstants:
    """Time the four constants (a few seconds; the CPU kernel is compiled first if it must be)."""
    from tandem.offload.cpu_experts import measure_read_bandwidth

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("--measure times the GPU and PCIe too: it needs a CUDA device (plan with --device cuda)")
    logger.info("Measuring RAM read, PCIe and GPU bandwidth (a few seconds)")
    return MachineConstants(
        ram_read=measure_read_bandwidth(ram_bytes, threads=threads),
        gpu_read=gpu_read_bandwidth(device),
        h2d=h2d_bandwidth(device),
        roundtrip=roundtrip_seconds(device),
    )
