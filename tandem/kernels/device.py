"""Facts about the GPU that kernels size their grids by, read once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None for other devices (the Triton interpreter)."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
