"""Hot experts: with a layer's routed experts in RAM, its most-used ones also kept on the GPU.

- `profile` (`tandem profile-experts`) records how often each layer routes to each expert through
  Tandem's own engine, into a calibration file (`ExpertCounts`, JSON).
- `choose_hot` spends a byte budget (`--hot-expert-memory`) on the (layer, expert) pairs the file
  counts most, over the layers whose experts are in RAM: every pair costs the same bytes and
  saves the same CPU work per hit, so the most-counted pairs first is the best use of the budget.
- `HotExpertsExecutor` serves such a layer: each (token, slot) pair whose expert is hot runs on the
  device, the others on the CPU kernel (their pairs marked -1 for the device, the hot ones -1 for
  the CPU). On CUDA the device part runs on a side stream while the CPU part's copies and host
  node wait on the main one, so both run at once; in a CUDA graph too (a captured fork and join).
  The sum is the same whichever side a pair takes, up to the executors' rounding (exact in fp32).
  It counts hits and pairs on the device for the hit rate in /metrics and the stats line.
- Without a calibration file, `--hot-experts online` learns the hot set from the routing served
  and swaps experts in between steps (hot_online.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.models.layers.moe import MoEExecutor, make_moe_executor

logger = logging.getLogger("tandem")

FORMAT = "tandem_expert_counts_v1"


@dataclass(frozen=True)
class ExpertCounts:
    """Routing counts per MoE layer: counts[layer][expert] = (token, slot) pairs routed there."""

    model: str
    tokens: int
    counts: dict[int, tuple[int, ...]]

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, "model": self.model, "tokens": self.tokens,
                "layers": {str(i): list(c) for i, c in sorted(self.counts.items())}}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, num_experts: int | None = None, layers: set[int] | None = None) -> ExpertCounts:
        """Read a calibration file; ValueError naming the file when it is not one, or when it does
        not match the model (its MoE layers and experts per layer)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file (from `tandem profile-experts`)")
            counts = {int(i): tuple(int(n) for n in c) for i, c in data["layers"].items()}
            out = cls(str(data.get("model", "")), int(data["tokens"]), counts)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--hot-experts {path}: {e}") from None
        if layers is not None and not set(counts) <= layers:
            raise ValueError(f"--hot-experts {path}: counts for layers {sorted(set(counts) - layers)}, which are not "
                             "MoE layers of this model; was it recorded for another model?")
        if num_experts is not None and any(len(c) != num_experts for c in counts.values()):
            raise ValueError(f"--hot-experts {path}: a layer counts {next(len(c) for c in counts.values())} experts, "
                             f"this model has {num_experts}")
        return out


def choose_hot(counts: ExpertCounts, layers: list[int], budget: int, bytes_per_expert: int
               ) -> tuple[dict[int, tuple[int, ...]], float]:
    """The hot experts per layer (sorted ids) within `budget` bytes, and the predicted hit rate:
    the share of the calibration's pairs on these layers that the chosen experts take."""
    if bytes_per_expert <= 0 or budget < bytes_per_expert:
        return {}, 0.0
    ranked = sorted(((n, i, e) for i in layers for e, n in enumerate(counts.counts.get(i, ())) if n > 0),
                    key=lambda x: (-x[0], x[1], x[2]))
    chosen = ranked[: budget // bytes_per_expert]
    hot: dict[int, list[int]] = {}
    for _, i, e in chosen:
        hot.setdefault(i, []).append(e)
    total = sum(sum(counts.counts.get(i, ())) for i in layers)
    rate = sum(n for n, _, _ in chosen) / total if total else 0.0
    return {i: tuple(sorted(es)) for i, es in sorted(hot.items())}, rate


class HotExpertsExecutor:
    """MoEExecutor for a layer whose experts are in RAM with a few of them also on the device."""

    def __init__(self, cpu: MoEExecutor, hot_experts: nn.ModuleList, hot_ids: tuple[int, ...], num_experts: int,
                 device_executor: str = "torch") -> None:
        self.cpu = cpu
        self.hot_ids = hot_ids  # slot -> expert (online hot experts swap them: hot_online.py)
        self.hot_experts = hot_experts
        device = next(hot_experts.parameters()).device
        self.local = torch.full((num_experts,), -1, dtype=torch.int64, device=device)  # expert -> hot slot, or -1
        self.local[torch.tensor(hot_ids, device=device)] = torch.arange(len(hot_ids), device=device)
        self.device_executor = device_executor  # its name: the engine captures graphs only over capturable ones
        self.device_part = make_moe_executor(device_executor, hot_experts)
        self.hits = torch.zeros((), dtype=torch.int64, device=device)  # pairs served by hot experts
        self.pairs = torch.zeros((), dtype=torch.int64, device=device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.counts: torch.Tensor | None = None  # [E] float32 pairs per expert, when online (hot_online.py)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        slot = self.local[topk_ids]  # [T, k]
        hot = slot >= 0
        self.hits += hot.sum()
        self.pairs += hot.numel()
        if self.counts is not None:  # a fixed-shape add: captured graphs count too
            flat = topk_ids.reshape(-1)
            self.counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
        # Each side sees the other's pairs with weight 0 (the device; its slot 0 stands in) or id -1
        # (the CPU kernel skips them).
        device_ids, device_w = slot.clamp(min=0), topk_weights.masked_fill(~hot, 0)
        cpu_ids = topk_ids.masked_fill(hot, -1)
        if self.side is None:
            return self.cpu(hidden, cpu_ids, topk_weights) + self.device_part(hidden, device_ids, device_w)
        main = torch.cuda.current_stream(hidden.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            on_device = self.device_part(hidden, device_ids, device_w)
        on_cpu = self.cpu(hidden, cpu_ids, topk_weights)  # D2H, host node, H2D on the main stream
        main.wait_stream(self.side)
        if not torch.cuda.is_current_stream_capturing():  # a graph's memory is its pool's: never freed
            for t in (hidden, device_ids, device_w):  # made on the main stream, read on the side one
                t.record_stream(self.side)
            on_device.record_stream(main)  # made on the side stream, read (and freed) on the main one
        return on_cpu + on_device

    def hit_rate(self) -> float | None:
        """Hits over pairs since start (a device sync: call it when logging)."""
        pairs = int(self.pairs.item())
        return int(self.hits.item()) / pairs if pairs else None


class _Counting:
    """Wraps a block's executor: adds each call's routed experts to `counts` (a device bincount)."""

    def __init__(self, inner: MoEExecutor, counts: torch.Tensor) -> None:
        self.inner, self.counts = inner, counts

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.counts += torch.bincount(topk_ids.reshape(-1).clamp(min=0), minlength=self.counts.numel())
        return self.inner(hidden, topk_ids, topk_weights)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """While open, every MoE block of `model` counts the experts it routes to: layer -> [E] int64."""
    blocks = model.moe_blocks()
    counts = {i: torch.zeros(b.num_experts, dtype=torch.int64, device=b.gate.weight.device) for i, b in blocks.items()}
    saved = {i: b.executor for i, b in blocks.items()}
    for i, b in blocks.items():
        b.executor = _Counting(b.executor, counts[i])
    try:
        yield counts
    finally:
        for i, b in blocks.items():
            b.executor = saved[i]
