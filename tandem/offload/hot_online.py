"""Online hot experts (`--hot-experts online`): the hot set learned from the routing being served,
for users without a calibration file (issue 17, part 2).

- Start: the budget split evenly over the offloaded layers, each layer's first experts
  (`initial_hot`); the predicted hit rate is what uniform routing would give.
- Counting: each layer's `HotExpertsExecutor` adds its (token, slot) pairs to a float32 count per
  expert on the device (`index_add_`: a fixed shape, so captured decode graphs count too).
- Every `interval` engine steps, between steps, the counts come to the host (a few KiB; the step
  has already waited for its sampled tokens) and are halved (recent routing weighs most). In each
  layer, a cold expert counted more than `MARGIN` times the weakest hot one replaces it; at most
  `max_swaps` swaps per update over all layers, the largest gains first.
- A swap copies the expert's packed bytes from RAM on a side stream and unpacks them there
  (streaming.unpack_experts: the values the CPU kernel computes with). Only at a later step
  boundary, once that copy's event has completed (polled, never waited for), does the main stream
  write them into the slot's weights and update the expert -> slot table. So no step waits for a
  swap, and no step sees a half-written slot. The outputs stay exact, since a pair gives the same
  result on either side, to the executors' rounding.

On a CPU run the copy is made at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tandem.offload.cpu_experts import CpuExpertLayer
from tandem.offload.hot_experts import HotExpertsExecutor
from tandem.offload.streaming import unpack_experts

logger = logging.getLogger("tandem")

ONLINE = "online"  # the --hot-experts value
INTERVAL = 64  # engine steps between re-rankings
MARGIN = 1.25  # how much more a cold expert must be counted than the weakest hot one it replaces
MAX_SWAPS = 8  # per update over all layers: bounds the PCIe traffic of one update


def initial_hot(layers: list[int], num_experts: int, budget: int, bytes_per_expert: int
                ) -> tuple[dict[int, tuple[int, ...]], float]:
    """The starting hot set: the budget split evenly over `layers` (each its first experts), and
    the hit rate uniform routing would give it."""
    if not layers or bytes_per_expert <= 0:
        return {}, 0.0
    per_layer = min(num_experts, budget // bytes_per_expert // len(layers))
    if per_layer == 0:
        return {}, 0.0
    return {i: tuple(range(per_layer)) for i in layers}, per_layer / num_experts


@dataclass
class _Swap:
    layer: int
    slot: int
    expert: int
    w13: torch.Tensor  # [1, 2I, H] in the run dtype, on the device
    w2: torch.Tensor  # [1, H, I]
    done: torch.cuda.Event | None  # the side stream's copy and unpack (None: already done, CPU)


class OnlineHotExperts:
    """The counts, the re-ranking and the swaps of every layer with hot experts (module docstring)."""

    def __init__(self, executors: dict[int, HotExpertsExecutor], layers: dict[int, CpuExpertLayer],
                 dtype: torch.dtype, interval: int = INTERVAL, max_swaps: int = MAX_SWAPS) -> None:
        self.executors, self.layers, self.dtype = executors, layers, dtype
        self.interval, self.max_swaps = interval, max_swaps
        first = next(iter(executors.values()))
        self.device = first.local.device
        for ex in executors.values():
            ex.counts = torch.zeros(ex.local.numel(), dtype=torch.float32, device=self.device)
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.steps = 0
        self.swaps = 0  # swaps applied since start
        self._pending: list[_Swap] = []

    def after_step(self) -> None:
        """The engine's hook after every step: apply the swaps whose copies are done, and every
        `interval` steps (none pending) plan the next ones."""
        self.steps += 1
        if self._pending:
            self._apply_done()
        if not self._pending and self.steps % self.interval == 0:
            self._plan()

    def _plan(self) -> None:
        gains = []  # (gain, layer, slot, expert)
        for i, ex in self.executors.items():
            counts = ex.counts.tolist()
            ex.counts.mul_(0.5)
            slot_of = {e: s for s, e in enumerate(ex.hot_ids)}
            cold = sorted((e for e in range(len(counts)) if e not in slot_of), key=lambda e: -counts[e])
            hot = sorted(slot_of, key=lambda e: counts[e])  # weakest first
            for new, old in zip(cold, hot):
                if counts[new] <= MARGIN * counts[old]:
                    break
                gains.append((counts[new] - counts[old], i, slot_of[old], new))
        for _, layer, slot, expert in sorted(gains, reverse=True)[: self.max_swaps]:
            self._pending.append(self._start(layer, slot, expert))
        if self.side is None:
            self._apply_done()

    def _start(self, layer: int, slot: int, expert: int) -> _Swap:
        cpu = self.layers[layer]
        if self.side is None:
            w13, w2 = unpack_experts(cpu.data[expert : expert + 1], cpu.fmt, cpu.hidden_size, cpu.intermediate_size,
                                     self.dtype)
            return _Swap(layer, slot, expert, w13, w2, None)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            packed = cpu.data[expert : expert + 1].to(self.device, non_blocking=True)  # pinned: a DMA
            w13, w2 = unpack_experts(packed, cpu.fmt, cpu.hidden_size, cpu.intermediate_size, self.dtype)
            done = torch.cuda.Event()
            done.record(self.side)
        return _Swap(layer, slot, expert, w13, w2, done)

    def _apply_done(self) -> None:
        still = []
        for swap in self._pending:
            if swap.done is not None and not swap.done.query():
                still.append(swap)
                continue
            self._apply(swap)
        self._pending = still

    def _apply(self, swap: _Swap) -> None:
        ex = self.executors[swap.layer]
        module = ex.hot_experts[swap.slot]
        inter = swap.w2.shape[-1]
        if swap.done is not None:  # made on the side stream: the main stream reads and frees them
            main = torch.cuda.current_stream(self.device)
            main.wait_event(swap.done)
            swap.w13.record_stream(main)
            swap.w2.record_stream(main)
        with torch.no_grad():
            module.gate_proj.weight.copy_(swap.w13[0, :inter])
            module.up_proj.weight.copy_(swap.w13[0, inter:])
            module.down_proj.weight.copy_(swap.w2[0])
        old = ex.hot_ids[swap.slot]
        ex.local[old] = -1
        ex.local[swap.expert] = swap.slot
        ex.hot_ids = ex.hot_ids[: swap.slot] + (swap.expert,) + ex.hot_ids[swap.slot + 1 :]
        self.swaps += 1
        logger.debug("Hot experts, layer %d: expert %d replaces %d in slot %d", swap.layer, swap.expert, old, swap.slot)
