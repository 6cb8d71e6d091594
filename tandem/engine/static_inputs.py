"""The inputs CUDA graphs read by address, staged through host memory (`StaticInputs`)."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. On CUDA it is staged in pinned memory, so the copy
    is queued behind the work already in the stream and the host goes on: a copy from pageable
    memory may make the host wait for that work (what a step launched ahead must not do)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class StaticInputs:
    """The inputs CUDA graphs read by address, staged through host memory (pinned on CUDA) so a
    replay uploads them in a few asynchronous copies instead of one per tensor.

    The small 1-D inputs (ids, positions, slots, state, query starts, lengths) are named views
    into one flat device buffer, mirrored by a host buffer of the same layout: a replay writes the
    host views (`host[name]`, numpy arrays) and `upload` copies the whole buffer at once. Block
    tables are their own [rows, cols] int32 device tensors (too large to copy whole): a replay
    packs the corner it needs into `table_host(g, rows, width)` and `upload` copies it into
    `tables[g][:rows, :width]`. The device views keep their addresses, shapes and strides for the
    object's life. Host memory is reused every step: `wait` before writing it."""

    _ALIGN = 512  # bytes: each region as aligned as its own allocation would be (kernels may assume it)
    _TABLE_COLS = 64  # the host staging of a table starts at this many columns per row and grows on demand

    def __init__(self, regions: dict[str, tuple[int, torch.dtype, int]], tables: list[tuple[int, int, int]],
                 device: torch.device) -> None:
        """regions: name -> (entries, dtype, initial value); tables: (rows, cols, initial value)
        per block table."""
        self._pin = pin = device.type == "cuda"
        spans, size = {}, 0
        for name, (numel, dtype, _) in regions.items():
            spans[name] = (size, numel * dtype.itemsize, dtype)
            size += -(-numel * dtype.itemsize // self._ALIGN) * self._ALIGN
        self._device_buffer = torch.empty(size, dtype=torch.uint8, device=device)  # [bytes], device
        self._host_buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)  # [bytes], host mirror
        self.device = {name: self._device_buffer[at : at + n].view(dt) for name, (at, n, dt) in spans.items()}
        self.host = {name: self._host_buffer[at : at + n].view(dt).numpy() for name, (at, n, dt) in spans.items()}
        for name, (_, _, value) in regions.items():
            self.host[name][:] = value
        self._device_buffer.copy_(self._host_buffer)
        self.tables = [torch.full((rows, cols), value, dtype=torch.int32, device=device)  # [rows, cols] int32
                       for rows, cols, value in tables]
        # Packed corners, not mirrors: a whole table (max_b x a long context's blocks) is large, a
        # step's corner [:bucket, :width] normally small. [entries] int32, host
        self._table_sizes = [rows * cols for rows, cols, _ in tables]
        self._table_host = [torch.empty(rows * min(cols, self._TABLE_COLS), dtype=torch.int32, pin_memory=pin)
                            for rows, cols, _ in tables]
        self._table_host_np = [t.numpy() for t in self._table_host]
        self._uploaded = torch.cuda.Event() if pin else None  # after the last upload's copies

    def table_host(self, g: int, rows: int, width: int) -> np.ndarray:
        """Host staging of table g's corner [:rows, :width], packed row-major ([rows * width]);
        call after `wait` (it may replace the staging with a larger one)."""
        need = rows * width
        if need > self._table_host[g].numel():
            size = min(max(need, 2 * self._table_host[g].numel()), self._table_sizes[g])
            self._table_host[g] = torch.empty(size, dtype=torch.int32, pin_memory=self._pin)
            self._table_host_np[g] = self._table_host[g].numpy()
        return self._table_host_np[g][:need]

    def wait(self) -> None:
        """Block until the last upload has read the host memory (normally long done), so that it
        can be rewritten."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self, corners: list[tuple[int, int]]) -> None:
        """Copy the host mirror into the device buffer, and table g's staged corner into
        `tables[g][:rows, :width]` for each (rows, width) in `corners`: asynchronous, in stream order."""
        self._device_buffer.copy_(self._host_buffer, non_blocking=True)
        for g, (rows, width) in enumerate(corners):
            # A corner of several rows narrower than the table is strided on the device: torch copies
            # it into a temporary there, then into place (no host-side temporary: `staged` is packed).
            staged = self._table_host[g][: rows * width].view(rows, width)
            self.tables[g][:rows, :width].copy_(staged, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
