"""What a failure inside a step means for the engine: whether the device is still usable, and
the one-line form of an error that a client is told."""

from __future__ import annotations

import torch

# Steps that fail as a whole one after another before the engine gives up: one such step is a
# request's bad luck (its requests end, the rest go on); several in a row mean the engine is broken.
MAX_FAILED_STEPS = 3
# Errors after which the CUDA context is unusable: every later kernel launch fails as well.
_DEVICE_ERROR_MARKERS = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "CUDNN_STATUS", "illegal memory access")


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a device error, or steps failing one after another); whoever owns
    it must stop serving. Raised by `LLMEngine.step`."""


def is_device_error(error: BaseException) -> bool:
    """Whether `error` leaves the device unusable: CUDA errors (device-side asserts included) are
    sticky. Out-of-memory is not one: the failed step's memory goes back to the allocator."""
    if isinstance(error, torch.AcceleratorError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _DEVICE_ERROR_MARKERS)


def brief(error: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, at most `limit` characters: what a client is told."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raise_if_fatal(stage: str, error: Exception) -> None:
    """Raise EngineFatalError when `error` left the device unusable (`is_device_error`)."""
    if is_device_error(error):
        raise EngineFatalError(f"device error while {stage}: {brief(error)}") from error
