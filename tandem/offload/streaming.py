"""PCIe expert streaming for long prefill chunks (issue 17, part 1).

With the routed experts in RAM, a prefill chunk of thousands of tokens is compute-bound on the CPU
(every expert meets hundreds of tokens), while copying the layer's experts to the GPU and
computing there is bound by PCIe: the copy costs the same for 2K tokens as for 32K. So a step of
at least `min_tokens` tokens streams; shorter ones (decode, verify, small chunks) keep the CPU
kernel. `min_tokens` comes from the cost model (`stream_threshold`, from the host-to-device
bandwidth and the CPU kernel's time per (token, expert) pair, both measured at start-up), or
from --stream-experts-min-tokens.

The experts stream in groups of `group` experts through a ring of `slots` device buffers holding
the CPU kernel's packed bytes (tandem/offload/cpu_kernels/moe.h), in the order (offloaded layer,
group): the copy of position p + slots - 1 is queued on the copy stream as soon as position p's
compute is queued, so while the GPU computes one group the next ones are on the wire, across layer
boundaries too (layer i's call queues the first groups of layer i + 1). A copy waits on the GPU
for the compute that last read its slot (an event), never on the host. Each group is unpacked on
the GPU into dense `w13 [G, 2I, H]`, `w2 [G, H, I]` in the run's dtype (fp32 and bf16 tiles are a
permutation of the stored values; int8, int4 and mxfp4 are decoded to the float32 values the CPU
kernel computes with, then cast: in one Triton pass on CUDA), and its rows run through
`expert_rows`, the grouped executor's math (tandem/kernels/moe_grouped.py). The result equals the
CPU kernel's to rounding, and exactly in fp32 up to summation order.

One host sync per streamed layer reads where each group's rows start (a prefill step syncs
anyway: the CPU path's host node does). On a CPU run the same code runs with the CPU as the
"device" (no copy stream): that is what CI checks.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from tandem.kernels.expert_layout import BLOCK as _BLOCK
from tandem.kernels.expert_layout import ROWS as _ROWS
from tandem.kernels.expert_layout import SCALE_BYTES, Geometry
from tandem.kernels.moe_grouped import combine_slots, expert_rows, sort_by_expert
from tandem.offload.cpu_experts import CpuExpertLayer

logger = logging.getLogger("tandem")

STREAMABLE_FORMATS = ("fp32", "bf16", "int8", "int4", "mxfp4")  # the packed formats `unpack_experts` undoes
SLOTS = 3  # ring buffers: one computing, two on the wire
_QUANTIZED = ("int8", "int4", "mxfp4")


def _fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15, uint8) -> float32: sign bit 3, exponent bits 1-2, mantissa bit 0
    (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives: moe_scalar.cpp's kFp4Values)."""
    e, m = ((codes >> 1) & 3).float(), (codes & 1).float()
    magnitude = torch.where(e == 0, 0.5 * m, (1 + 0.5 * m) * torch.exp2(e - 1))
    return torch.where(codes >= 8, -magnitude, magnitude)


def _tile_rows(raw: torch.Tensor, fmt: str, tiles: int, nb: int) -> torch.Tensor:
    """Packed tiles (uint8 [G, tiles * tile bytes]) -> their rows [G, tiles, 16, nb * 32]: the
    values as stored (fp32, bf16), or dequantized to float32 exactly as moe_scalar.cpp's
    decode_block (code x scale)."""
    g, k = raw.shape[0], nb * _BLOCK
    if fmt == "fp32":  # a tile is [K][16]: one input index of its 16 rows after the other
        return raw.view(torch.float32).view(g, tiles, k, _ROWS).permute(0, 1, 3, 2)
    if fmt == "bf16":  # [K/2][16] pairs; the pair of row r holds inputs 2i (first) and 2i + 1
        return raw.view(torch.bfloat16).view(g, tiles, k // 2, _ROWS, 2).permute(0, 1, 3, 2, 4).reshape(g, tiles, _ROWS, k)
    tile = raw.view(g, tiles, -1)
    if fmt == "int8":  # [16] float row scales (64 bytes), then [K][16] int8
        scales = tile[..., : 4 * _ROWS].contiguous().view(torch.float32)  # [G, tiles, 16]
        codes = tile[..., 64:].view(torch.int8).view(g, tiles, k, _ROWS).permute(0, 1, 3, 2)
        return codes.float() * scales[..., None]
    blocks = tile.view(g, tiles, nb, -1)  # per block: the scales, then the codes
    sb = SCALE_BYTES[fmt]
    if fmt == "int4":
        scales = blocks[..., :sb].contiguous().view(torch.bfloat16).float()  # [G, tiles, nb, 16]
    else:  # E8M0: 2^(s - 127); 0 is 2^-127 and 255 +inf, as decode_block
        scales = torch.exp2(blocks[..., :sb].float() - 127)
    # octet o, row r, word w, its byte h, that byte's high nibble or not: input 8o + 4h + 2 high + w
    codes = blocks[..., sb:].view(g, tiles, nb, _BLOCK // 8, _ROWS, 2, 2)
    nibbles = torch.stack((codes & 15, codes >> 4), dim=-1)  # [.., o, r, w, h, high]
    nibbles = nibbles.permute(0, 1, 4, 2, 3, 6, 7, 5).reshape(g, tiles, _ROWS, nb, _BLOCK)
    if fmt == "int4":  # two's complement -8..7
        values = nibbles.float() - 16 * (nibbles >= 8).float()
    else:
        values = _fp4_values(nibbles)
    return (values * scales.permute(0, 1, 3, 2)[..., None]).reshape(g, tiles, _ROWS, k)


def unpack_experts(packed: torch.Tensor, fmt: str, hidden: int, inter: int, dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """G experts in the CPU kernel's packed layout (uint8 [G, bytes per expert], any device) ->
    (w13 [G, 2I, H]: gate rows then up rows, w2 [G, H, I]) on that device, in `dtype` (default:
    fp32 and bf16 as stored; the quantized formats dequantized to float32, the values the CPU
    kernel computes with). On CUDA quantized experts are decoded by one Triton kernel
    (tandem/kernels/expert_unpack.py); elsewhere one at a time in torch, so the float32
    temporaries are one expert's."""
    if fmt not in STREAMABLE_FORMATS:
        raise ValueError(f"experts packed as {fmt} cannot be unpacked on the device (streamable: "
                         f"{', '.join(STREAMABLE_FORMATS)})")
    if fmt in _QUANTIZED and packed.is_cuda:  # one pass in Triton, straight to the run dtype
        from tandem.kernels.expert_unpack import unpack_quantized

        return unpack_quantized(packed.contiguous(), fmt, hidden, inter, dtype or torch.float32)
    if fmt in _QUANTIZED and packed.shape[0] > 1:
        g, out = packed.shape[0], dtype or torch.float32
        w13 = torch.empty(g, 2 * inter, hidden, dtype=out, device=packed.device)
        w2 = torch.empty(g, hidden, inter, dtype=out, device=packed.device)
        for e in range(g):
            w13[e : e + 1], w2[e : e + 1] = unpack_experts(packed[e : e + 1], fmt, hidden, inter)
        return w13, w2
    w13, w2 = _unpack(packed, fmt, hidden, inter)
    return (w13, w2) if dtype is None else (w13.to(dtype), w2.to(dtype))


def unpacked_bytes_per_expert(expert_bytes: int, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """Device bytes streaming needs per expert of a group: its packed bytes in each ring slot, and
    twice its unpacked weights (the group, and the copy the unpacking makes on the way)."""
    return SLOTS * expert_bytes + 2 * 3 * hidden * inter * torch.empty((), dtype=dtype).element_size()


def _unpack(packed: torch.Tensor, fmt: str, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    geo = Geometry.of(fmt, hidden, inter)
    g, hp, ip, down = packed.shape[0], geo.nb_h * _BLOCK, geo.nb_i * _BLOCK, geo.down_offset
    phase1 = _tile_rows(packed[:, :down], fmt, geo.tiles1, geo.nb_h)  # [G, tiles1, 16, Hp]: gate rows 0-7, up 8-15
    gate = phase1[:, :, : _ROWS // 2].reshape(g, geo.tiles1 * _ROWS // 2, hp)[:, :inter, :hidden]
    up = phase1[:, :, _ROWS // 2 :].reshape(g, geo.tiles1 * _ROWS // 2, hp)[:, :inter, :hidden]
    phase2 = _tile_rows(packed[:, down : down + geo.tiles2 * geo.tile2], fmt, geo.tiles2, geo.nb_i)
    w2 = phase2.reshape(g, geo.tiles2 * _ROWS, ip)[:, :hidden, :inter].contiguous()  # phase2: [G, tiles2, 16, Ip]
    return torch.cat((gate, up), dim=1), w2


DEFAULT_MEMORY = 2 << 30


def stream_memory(requested: int | None, num_experts: int, per_expert: int) -> int:
    """Device bytes streaming takes: `requested` (--stream-experts-memory), else 2 GiB or what
    groups of a whole layer need, if less (`per_expert`: `unpacked_bytes_per_expert`)."""
    return requested if requested is not None else min(DEFAULT_MEMORY, num_experts * per_expert)


def stream_threshold(layer_bytes: int, h2d: float, pair_seconds: float, top_k: int) -> int:
    """The fewest tokens for which streaming a layer's experts (`layer_bytes` at `h2d` bytes/s;
    the GPU's compute hides under the copy) beats the CPU kernel, which spends `pair_seconds`
    per (token, expert) pair on a compute-bound chunk."""
    if h2d <= 0 or pair_seconds <= 0:
        raise ValueError(f"bandwidth and pair time must be positive, got {h2d}, {pair_seconds}")
    return max(1, math.ceil(layer_bytes / h2d / (top_k * pair_seconds)))


def measure_pair_seconds(layer: CpuExpertLayer, top_k: int, tokens: int = 512, repeats: int = 2) -> float:
    """The CPU kernel's seconds per (token, expert) pair on a `tokens`-token call with random
    routing (compute-bound: every expert meets ~tokens * top_k / E of them)."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if layer.fmt == "fp32" else torch.bfloat16
    hidden = (torch.randn(tokens, layer.hidden_size, generator=g) * 0.1).to(dtype)
    ids = torch.rand(tokens, layer.num_experts, generator=g).argsort(-1)[:, :top_k]
    weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=dtype)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        layer(hidden, ids, weights)
        best = min(best, time.perf_counter() - start)
    return best / (tokens * top_k)


def measured_threshold(layer: CpuExpertLayer, top_k: int, device: torch.device) -> tuple[int, float]:
    """`stream_threshold` from this machine, and the PCIe host-to-device bytes/s it used: PCIe and
    the CPU kernel on `layer`, timed now (a second or so) and logged."""
    from tandem.offload.measure import h2d_bandwidth

    h2d = h2d_bandwidth(device)
    pair = measure_pair_seconds(layer, top_k)
    tokens = stream_threshold(layer.nbytes, h2d, pair, top_k)
    logger.info("Expert streaming cost model: PCIe host->device %.1f GB/s, CPU experts %.1f us per (token, expert) "
                "pair, %.2f GB of experts a layer -> steps of >= %d tokens stream (--stream-experts-min-tokens "
                "overrides)", h2d / 1e9, pair * 1e6, layer.nbytes / 1e9, tokens)
    return tokens, h2d


CHUNK_ROUND = 256  # stream_chunk's granularity


def stream_chunk(layer_bytes: int, h2d: float, unpack_seconds: float, pair_seconds: float, top_k: int) -> int:
    """The prefill chunk (tokens a step) for streamed experts. A streamed step costs each
    offloaded layer max(copy, unpack + tokens * top_k * pair_seconds): the copy of its experts
    (`layer_bytes` at `h2d`) is the same for any chunk, so more tokens a step are free until the
    GPU's expert work (`unpack_seconds` a layer, `pair_seconds` a (token, expert) pair) fills it;
    past that a longer chunk buys no speed, only delays the decodes sharing its step and takes
    activation memory. Returns where the two meet, rounded up to 256 tokens (at least 256)."""
    if h2d <= 0 or pair_seconds <= 0 or top_k <= 0:
        raise ValueError(f"bandwidth, pair time and top_k must be positive, got {h2d}, {pair_seconds}, {top_k}")
    spare = layer_bytes / h2d - unpack_seconds  # the copy time the GPU's fixed work leaves
    return max(1, math.ceil(max(spare, 0.0) / (top_k * pair_seconds) / CHUNK_ROUND)) * CHUNK_ROUND


def streamed_step_seconds(tokens: int, layers: int, layer_bytes: int, h2d: float, unpack_seconds: float,
                          pair_seconds: float, top_k: int) -> float:
    """`stream_chunk`'s model of a streamed step's expert time: per layer the copy or the GPU's
    expert work, whichever is longer (attention and the dense parts not counted)."""
    return layers * max(layer_bytes / h2d, unpack_seconds + tokens * top_k * pair_seconds)


@dataclass(frozen=True)
class StreamStats:
    """Bytes sent over PCIe since `reset_stats`, and the copy stream's seconds from the first
    copy's start to the last one's end (CUDA events; 0 on a CPU run)."""

    bytes: int
    seconds: float
    layers: int  # layer calls that streamed

    @property
    def bandwidth(self) -> float:
        return self.bytes / self.seconds if self.seconds else 0.0


class ExpertStreamer:
    """The ring, the copy stream and the decision, shared by every offloaded layer (module docstring)."""

    def __init__(self, layers: dict[int, CpuExpertLayer], device: torch.device, dtype: torch.dtype, memory: int,
                 min_tokens: int, h2d: float | None = None) -> None:
        first = layers[min(layers)]
        self.h2d = h2d  # PCIe bytes/s the cost model measured (None: not measured yet, or a CPU run)
        self.fmt, self.hidden, self.inter = first.fmt, first.hidden_size, first.intermediate_size
        self.layers, self.device, self.dtype, self.min_tokens = layers, device, dtype, min_tokens
        self.num_experts, self.expert_bytes = first.num_experts, first.bytes_per_expert
        per_expert = unpacked_bytes_per_expert(self.expert_bytes, self.hidden, self.inter, dtype)
        if memory < per_expert:
            raise ValueError(f"--stream-experts-memory {memory / 2**20:.2f} MiB holds no group: the ring of {SLOTS} "
                             f"and the unpacked experts need {per_expert / 2**20:.2f} MiB per expert in a group")
        self.group = min(self.num_experts, memory // per_expert)
        self.groups_per_layer = math.ceil(self.num_experts / self.group)
        self.order = sorted(layers)
        self.first_position = {layer: i * self.groups_per_layer for i, layer in enumerate(self.order)}
        self.num_positions = len(self.order) * self.groups_per_layer
        self.buffers = torch.empty(SLOTS, self.group * self.expert_bytes, dtype=torch.uint8, device=device)
        self.holds = [-1] * SLOTS  # the position each slot's bytes are (or are being) copied from
        self.expert_range = torch.arange(self.num_experts, device=device)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(SLOTS)]  # the slot's copy is done
            self.free: list[torch.cuda.Event | None] = [None] * SLOTS  # the last compute reading it is done
        self.reset_stats()

    @property
    def device_bytes(self) -> int:
        """Device memory the streaming takes at most: the ring, and one unpacked group twice."""
        return self.group * unpacked_bytes_per_expert(self.expert_bytes, self.hidden, self.inter, self.dtype)

    def describe(self) -> str:
        return (f"steps of >= {self.min_tokens} tokens stream the experts of {len(self.order)} layers over "
                f"{'PCIe' if self.cuda else 'memory (CPU run)'}, {self.group} experts a copy through {SLOTS} buffers "
                f"({self.device_bytes / 2**30:.2f} GiB on {self.device})")

    def time_device(self, rows_per_expert: int = 512, repeats: int = 3) -> tuple[float, float]:
        """(seconds to unpack one layer's experts, seconds per (token, expert) pair of their
        grouped GEMMs, SwiGLU clamp included) on the device, timed now on the first layer's first
        experts (up to 16 of them, `rows_per_expert` rows each: a long chunk's density) in ring
        slot 0."""
        from tandem.engine.runner import seconds_per_call

        n = min(self.group, 16)
        if self.cuda:  # no copy of an earlier step may still be writing the slot
            self.copy_stream.synchronize()
        first = self.layers[self.order[0]]
        packed = self.buffers[0, : n * self.expert_bytes].view(n, self.expert_bytes)
        packed.copy_(first.data[:n])
        self.holds[0] = -1  # slot 0 holds no position's experts now
        g = torch.Generator(device=self.device).manual_seed(0)
        x = (torch.randn(n * rows_per_expert, self.hidden, generator=g, device=self.device) * 0.1).to(self.dtype)
        offs = torch.arange(1, n + 1, dtype=torch.int32, device=self.device) * rows_per_expert

        def unpack() -> tuple[torch.Tensor, torch.Tensor]:
            return unpack_experts(packed, self.fmt, self.hidden, self.inter, self.dtype)

        unpack_s = seconds_per_call(unpack, self.device, repeats, warm_up=True)
        w13, w2 = unpack()
        rows_s = seconds_per_call(lambda: expert_rows(x, w13, w2, offs, first.swiglu_limit), self.device, repeats,
                                  warm_up=True)
        return unpack_s * self.num_experts / n, rows_s / (n * rows_per_expert)

    def wants(self, num_tokens: int) -> bool:
        """Whether a call of `num_tokens` rows streams (decided on the host from its shape; never
        inside a graph capture)."""
        if num_tokens < self.min_tokens:
            return False
        return not (self.cuda and torch.cuda.is_current_stream_capturing())

    def reset_stats(self) -> None:
        self._bytes, self._layers = 0, 0
        self._start: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None

    def stats(self) -> StreamStats:
        """What was streamed since `reset_stats` (synchronises with the copy stream)."""
        seconds = 0.0
        if self._start is not None and self._end is not None:
            self._end.synchronize()
            seconds = self._start.elapsed_time(self._end) / 1e3
        return StreamStats(self._bytes, seconds, self._layers)

    def _experts_of(self, position: int) -> tuple[int, int, int]:
        layer = self.order[position // self.groups_per_layer]
        e0 = position % self.groups_per_layer * self.group
        return layer, e0, min(e0 + self.group, self.num_experts)

    def _ensure(self, position: int) -> None:
        """Queue the copy of `position`'s experts into its slot unless the slot holds them."""
        slot = position % SLOTS
        if self.holds[slot] == position:
            return
        layer, e0, e1 = self._experts_of(position)
        src = self.layers[layer].data[e0:e1].view(-1)
        dst = self.buffers[slot, : src.numel()]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                free = self.free[slot]
                if free is not None:
                    self.copy_stream.wait_event(free)
                if self._start is None:
                    self._start = torch.cuda.Event(enable_timing=True)
                    self._start.record(self.copy_stream)
                dst.copy_(src, non_blocking=True)  # pinned (pin_in_place): an asynchronous DMA
                self.ready[slot].record(self.copy_stream)
                self._end = self._end or torch.cuda.Event(enable_timing=True)
                self._end.record(self.copy_stream)
        else:
            dst.copy_(src)
        self.holds[slot] = position
        self._bytes += src.numel()

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            limit: float | None) -> torch.Tensor:
        """The layer's routed experts for these rows, computed on the device from streamed weights."""
        x, order, offs = sort_by_expert(hidden, topk_ids, self.expert_range)
        ends = offs.tolist()  # the one host sync: where each group's rows are
        y = torch.empty_like(x)
        first = self.first_position[layer]
        for p in range(first, min(first + SLOTS - 1, self.num_positions)):  # fill the ring (no-op if prefetched)
            self._ensure(p)
        main = torch.cuda.current_stream(self.device) if self.cuda else None
        for p in range(first, first + self.groups_per_layer):
            self._ensure(p)
            slot = p % SLOTS
            _, e0, e1 = self._experts_of(p)
            start, end = ends[e0 - 1] if e0 else 0, ends[e1 - 1]
            if main is not None:
                main.wait_event(self.ready[slot])
            if end > start:
                packed = self.buffers[slot, : (e1 - e0) * self.expert_bytes].view(e1 - e0, self.expert_bytes)
                w13, w2 = unpack_experts(packed, self.fmt, self.hidden, self.inter, self.dtype)
                local = offs[e0:e1] - start
                y[start:end] = expert_rows(x[start:end], w13, w2, local, limit)
                del w13, w2
            if main is not None:
                self.free[slot] = torch.cuda.Event()
                self.free[slot].record(main)
            if p + SLOTS - 1 < self.num_positions:  # reuses the slot of p - 1, whose compute is queued
                self._ensure(p + SLOTS - 1)
        self._layers += 1
        return combine_slots(y, order, topk_weights)


class StreamingExecutor:
    """MoEExecutor of an offloaded layer: long steps through the streamer, the rest through `inner`
    (the CPU experts, with the hot experts when there are)."""

    def __init__(self, inner, streamer: ExpertStreamer, layer: int, limit: float | None) -> None:  # noqa: ANN001
        self.inner, self.streamer, self.layer, self.limit = inner, streamer, layer, limit

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        rows, streams = hidden.shape[0], self.streamer.wants(hidden.shape[0])
        if self.layer == self.streamer.order[0] and rows > 1:  # once a step: which path it takes
            if streams:
                logger.info("Step of %d tokens: routed experts streamed over PCIe (%d layers, %.1f GB)", rows,
                            len(self.streamer.order), sum(x.nbytes for x in self.streamer.layers.values()) / 1e9)
            elif not (self.streamer.cuda and torch.cuda.is_current_stream_capturing()):
                logger.debug("Step of %d tokens: routed experts on the CPU (streaming from %d)", rows,
                             self.streamer.min_tokens)
        if streams:
            return self.streamer.run(self.layer, hidden, topk_ids, topk_weights, self.limit)
        return self.inner(hidden, topk_ids, topk_weights)
