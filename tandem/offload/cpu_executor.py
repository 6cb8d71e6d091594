"""The MoE executor of a layer whose routed experts live in RAM: the CPU expert kernel
(tandem/offload/cpu_experts.py) behind the `experts(hidden, topk_ids, topk_weights)` contract.

On a CPU run the kernel is called directly. On CUDA every offloaded layer goes through the same
few stream operations, eager or inside a CUDA graph alike:

    hidden, topk_ids, topk_weights, live-row count --(D2H into pinned staging)-->
    host node: the kernel reads the staging buffers, computes, writes the staged output
    --(H2D)--> the layer's output on the GPU

The hand-off to the CPU and back (`--cpu-moe-handoff`, tandem/offload/handoff.py) is a host node
(`cuLaunchHostFunc` with a C function of the kernel library) or the doorbell (stream writes and
waits on pinned flags that a polling thread serves); neither enters Python, so a captured decode
graph replays CPU experts with no Python in the loop. The staging
buffers are shared by every offloaded layer: the stream orders one layer's copies and host node
after the previous layer's. The number of rows the kernel computes is a device scalar copied with
the inputs: eager calls set it to the rows they pass; before a graph replay the runner writes the
real rows of the padded batch into it (`live_rows`), so the kernel skips the pads' experts.
"""

from __future__ import annotations

import copy
import logging
import re
import resource
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.offload.handoff import Doorbell, launch_host_func
from tandem.offload.hot_experts import HotExpertsExecutor
from tandem.offload.hot_online import ONLINE, OnlineHotExperts
from tandem.offload.streaming import ExpertStreamer, StreamingExecutor

if TYPE_CHECKING:
    from tandem.config import OffloadConfig
    from tandem.engine.metrics import EngineMetrics
    from tandem.offload.cpu_experts import CpuExpertLayer
    from tandem.offload.placement import Placement

logger = logging.getLogger("tandem")

_EXPERT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def pin_in_place(tensor: torch.Tensor) -> None:
    """Page-lock a CPU tensor's memory where it is (cudaHostRegister), unlocked when the tensor
    is freed. torch's pinned allocator would round each layer's experts up to a power of two (a
    1.2 GiB layer would take 2 GiB); registering pins exactly the bytes. Pinned experts never swap
    and can be copied to the GPU at full PCIe speed."""
    cudart = torch.cuda.cudart()
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 2**30:.2f} GiB of routed experts failed (cudaError {int(err)}): "
                           "is the locked-memory limit (ulimit -l) too low?")
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)


class Staging:
    """Pinned host buffers for the rows of one step, and the device row count (see module doc)."""

    def __init__(self, rows: int, hidden_size: int, top_k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.device = rows, device
        pin = dict(pin_memory=True)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, **pin)  # [R, H]
        self.ids = torch.zeros(rows, top_k, dtype=torch.int64, **pin)  # [R, k]
        self.weights = torch.zeros(rows, top_k, dtype=dtype, **pin)  # [R, k]
        self.out = torch.zeros(rows, hidden_size, dtype=dtype, **pin)  # [R, H]
        self.count = torch.zeros(1, dtype=torch.int32, **pin)  # rows the kernel computes
        self.live_rows = torch.zeros(1, dtype=torch.int32, device=device)  # written before a graph replay


class CpuMoEExecutor:
    """MoEExecutor for one offloaded layer (its experts in `layer`, in RAM)."""

    def __init__(self, layer: CpuExpertLayer, staging: Staging | None, rows: torch.Tensor | None = None,
                 doorbell: Doorbell | None = None) -> None:
        """`rows` (a device int32 scalar; default the staging's live_rows) is what the kernel is told
        to compute; benchmarks pass a zero to time the copies and the hand-off alone. With a
        `doorbell` the stream rings it (`--cpu-moe-handoff poll`), else it queues a host node."""
        self.layer = layer
        self.staging = staging
        self.rows = rows if rows is not None or staging is None else staging.live_rows
        self.job = None
        self.doorbell, self.number = doorbell, -1
        if staging is not None:
            self.job = layer.host_job(staging.hidden, staging.ids, staging.weights, staging.out, staging.count)
            if doorbell is not None:
                self.number = doorbell.add(self.job)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if hidden.device.type == "cpu":
            return self.layer(hidden, topk_ids, topk_weights)
        stage = self.staging
        if stage is None:
            raise RuntimeError("this CPU expert layer was built for a CPU run; it got CUDA tensors")
        num_tokens = hidden.shape[0]
        if torch.cuda.is_current_stream_capturing():
            if num_tokens > stage.rows:
                raise RuntimeError(f"a captured step of {num_tokens} rows exceeds the CPU experts' staging "
                                   f"({stage.rows} rows)")
            return self._queue(hidden, topk_ids, topk_weights)
        if num_tokens <= stage.rows:
            stage.live_rows.fill_(num_tokens)
            return self._queue(hidden, topk_ids, topk_weights)
        out = torch.empty_like(hidden)
        for start in range(0, num_tokens, stage.rows):  # a long prefill chunk, in pieces of the staging's rows
            end = min(start + stage.rows, num_tokens)
            stage.live_rows.fill_(end - start)
            out[start:end] = self._queue(hidden[start:end], topk_ids[start:end], topk_weights[start:end])
        return out

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
               ) -> Callable[[], torch.Tensor]:
        """Starts the layer's experts and returns what gives their output (the MoE executor's
        `submit`, tandem/models/layers/moe.py). With the doorbell, on CUDA, for a step that fits
        the staging, the stream only requests the call here: GPU work queued before `collect()`
        runs while the CPU computes. Otherwise the call is made whole now. Nothing may use the
        CPU experts of another layer in between (the staging is shared)."""
        stage = self.staging
        if self.doorbell is None or hidden.device.type == "cpu" or stage is None or hidden.shape[0] > stage.rows:
            out = self(hidden, topk_ids, topk_weights)
            return lambda: out
        if not torch.cuda.is_current_stream_capturing():
            stage.live_rows.fill_(hidden.shape[0])
        stream = self._start(hidden, topk_ids, topk_weights)
        return lambda: self._finish(stream, hidden)

    def _queue(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self._finish(self._start(hidden, topk_ids, topk_weights), hidden)

    def _start(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.cuda.Stream:
        """Queues the D2H copies of a call's inputs and row count into the staging, then the hand-off:
        the doorbell's request, or the host node (the stream moves on once the call is done).
        Returns the stream."""
        stage, n = self.staging, hidden.shape[0]
        assert stage is not None and self.job is not None
        stage.hidden[:n].copy_(hidden, non_blocking=True)
        stage.ids[:n].copy_(topk_ids, non_blocking=True)
        stage.weights[:n].copy_(topk_weights, non_blocking=True)
        stage.count.copy_(self.rows, non_blocking=True)
        stream = torch.cuda.current_stream(hidden.device)
        if self.doorbell is not None:
            self.doorbell.signal(stream, self.number)
        else:
            launch_host_func(stream, self.job.fn_ptr, self.job.arg_ptr)
        return stream

    def _finish(self, stream: torch.cuda.Stream, hidden: torch.Tensor) -> torch.Tensor:
        """Queues the doorbell's wait (if any) and the copy of the output back, for `hidden`'s rows."""
        if self.doorbell is not None:
            self.doorbell.wait(stream, self.number)
        assert self.staging is not None
        return self.staging.out[: hidden.shape[0]].to(hidden.device, non_blocking=True)


class OffloadedExperts:
    """The loader's hook for the layers a placement puts in RAM: takes their routed experts out of
    the model before it is materialised (no device memory for them), packs each expert from the
    checkpoint straight into its layer's kernel layout (one expert at a time: there is never a
    second full copy in RAM), then installs a CpuMoEExecutor on each of those layers.

    `staging_rows` is the most rows one step hands an offloaded layer on CUDA (the largest
    batch of a captured graph or a prefill chunk); longer eager calls are split. `offload` carries
    the expert-streaming settings (tandem/offload/streaming.py; None: no streaming)."""

    def __init__(self, placement: Placement, threads: int | None = None, staging_rows: int = 2048,
                 offload: OffloadConfig | None = None) -> None:
        self.placement = placement
        self.offload = offload
        self.streamer: ExpertStreamer | None = None
        self.layers_in_ram = set(placement.cpu_layers)
        self.threads = threads
        self.staging_rows = staging_rows
        self.top_k = 0  # the offloaded layers' experts a token (install)
        self.layers: dict[int, CpuExpertLayer] = {}
        self._pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.staging: Staging | None = None
        self.doorbell: Doorbell | None = None  # --cpu-moe-handoff poll on CUDA (install)
        # Hot experts (hot_experts.py): also kept on the device, built from a meta template of the
        # layer's expert module once the checkpoint's three tensors of one have come.
        self.hot = dict(placement.hot)
        self._templates: dict[int, nn.Module] = {}
        self._hot_weights: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.hot_executors: dict[int, HotExpertsExecutor] = {}
        self.online: OnlineHotExperts | None = None  # --hot-experts online: the engine calls after_step

    def prepare(self, model: nn.Module) -> None:
        """On the meta model: detach the offloaded layers' experts (kept as shapes only)."""
        from tandem.offload import cpu_experts

        if self.threads is not None:
            cpu_experts.set_threads(self.threads)
        act_dtype = self.offload.cpu_moe_act_dtype if self.offload is not None else "auto"
        for i, block in model.moe_blocks().items():
            if i in self.layers_in_ram:
                hidden, inter = block.experts[0].down_proj.weight.shape
                limit = getattr(block.experts[0], "limit", None)  # DeepSeek-V4's SwiGLU clamp
                if i in self.hot:
                    self._templates[i] = copy.deepcopy(block.experts[0])  # on meta: shapes only
                block.detach_experts()
                self.layers[i] = cpu_experts.CpuExpertLayer.empty(block.num_experts, hidden, inter,
                                                                  self.placement.cpu_format, swiglu_limit=limit,
                                                                  act_dtype=act_dtype)
                if torch.cuda.is_available():
                    pin_in_place(self.layers[i].data)
        logger.info("Routed experts of %d MoE layers go to RAM as %s (%.2f GiB): CPU expert kernel %s, %d threads, "
                    "%s activations", len(self.layers), self.placement.cpu_format, self.placement.cpu_bytes / 2**30,
                    cpu_experts.kernel_isa(), cpu_experts.num_threads(), act_dtype)

    def wants(self, name: str) -> bool:
        m = _EXPERT_NAME.search(name)
        return m is not None and int(m.group(1)) in self.layers_in_ram

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of an offloaded expert; the expert is packed once all three came."""
        m = _EXPERT_NAME.search(name)
        assert m is not None, name
        key = (int(m.group(1)), int(m.group(2)))
        parts = self._pending.setdefault(key, {})
        parts[m.group(3)] = tensor
        if len(parts) == 3:
            self.layers[key[0]].set_expert(key[1], parts["gate_proj"], parts["up_proj"], parts["down_proj"])
            if key[1] in self.hot.get(key[0], ()):
                self._hot_weights[key] = parts
            del self._pending[key]

    def install(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """After loading: every expert of every offloaded layer must have arrived."""
        if self._pending:
            (layer, expert), parts = next(iter(self._pending.items()))
            raise RuntimeError(f"layer {layer} expert {expert}: the checkpoint held only {sorted(parts)} of "
                               "gate_proj, up_proj, down_proj")
        blocks = model.moe_blocks()
        if device.type == "cuda" and self.layers:
            first = blocks[min(self.layers)]
            hidden = first.gate.weight.shape[1]  # the router: a Linear (Qwen3) or its own module (V4)
            self.staging = Staging(self.staging_rows, hidden, first.top_k, dtype, device)
            if self.offload is not None and self.offload.cpu_moe_handoff == "poll":
                self.doorbell = Doorbell()
        device_executor = "grouped" if device.type == "cuda" and dtype == torch.bfloat16 else "torch"
        for i, layer in self.layers.items():
            executor = CpuMoEExecutor(layer, self.staging, doorbell=self.doorbell)
            if i in self.hot:
                hot = nn.ModuleList(self._hot_expert(i, e, device, dtype) for e in self.hot[i])
                executor = self.hot_executors[i] = HotExpertsExecutor(executor, hot, self.hot[i], blocks[i].num_experts,
                                                                      device_executor)
            blocks[i].set_executor(executor)
        self._hot_weights.clear()
        if self.offload is not None and self.offload.hot_experts == ONLINE and self.hot_executors:
            self.online = OnlineHotExperts(self.hot_executors, {i: self.layers[i] for i in self.hot_executors}, dtype)
        self.streamer = self._streamer(blocks, device, dtype)
        if self.streamer is not None:
            for i, layer in self.layers.items():
                blocks[i].set_executor(StreamingExecutor(blocks[i].executor, self.streamer, i, layer.swiglu_limit))
        if self.hot:
            logger.info("Hot experts on %s: %d over %d layers (%.2f GiB, %s; predicted hit rate %.1f%%)", device,
                        sum(map(len, self.hot.values())), len(self.hot), self.placement.hot_bytes / 2**30,
                        self.placement.hot_source, 100 * self.placement.hot_hit_rate)
        model.cpu_experts = self  # the runner writes a graph replay's real rows into live_rows
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        handoff = "" if self.staging is None else (", hand-off: a polling thread (poll)" if self.doorbell is not None
                                                   else ", hand-off: CUDA host nodes (hostfunc)")
        logger.info("CPU experts installed on layers %s; peak RSS %.2f GiB (experts in RAM %.2f GiB)%s",
                    _short(sorted(self.layers)), peak / 2**30, self.placement.cpu_bytes / 2**30, handoff)

    def _streamer(self, blocks: dict[int, nn.Module], device: torch.device, dtype: torch.dtype) -> ExpertStreamer | None:
        """The expert streamer the settings ask for (None: off), its threshold from the cost model
        unless given: PCIe and the CPU kernel are timed here (a second or so), and logged."""
        from tandem.offload import streaming

        cfg = self.offload
        if cfg is None or cfg.stream_experts == "off" or not self.layers:
            return None
        if device.type != "cuda" and cfg.stream_experts == "auto":
            return None  # a CPU run: there is no PCIe to stream over
        from tandem.kernels.moe_grouped import check_grouped_support

        layer = next(iter(self.layers.values()))
        try:  # the streamed groups run through torch._grouped_mm: bf16 on sm90+ GPUs
            check_grouped_support(dtype, device, layer.hidden_size, layer.intermediate_size)
        except ValueError as e:
            if cfg.stream_experts == "on":
                raise ValueError(f"--stream-experts on: {e}") from e
            logger.info("Expert streaming off (long prefill steps run on the CPU experts): %s", e)
            return None
        if device.type == "cuda" and not self.placement.stream_bytes:
            if cfg.stream_experts == "on":
                raise ValueError("--stream-experts on: the memory plan has no GPU memory for its buffers "
                                 f"({self.placement.reason}); give --stream-experts-memory or use a bigger budget")
            logger.info("Expert streaming off: the memory plan left no GPU memory for its buffers (%s)",
                        self.placement.reason)
            return None
        self.top_k = blocks[min(self.layers)].top_k
        min_tokens, h2d = cfg.stream_experts_min_tokens, None
        if device.type != "cuda":
            min_tokens = min_tokens or 1  # a CPU run: no PCIe, no cost model
        elif min_tokens is None:
            min_tokens, h2d = streaming.measured_threshold(layer, self.top_k, device)
        per_expert = streaming.unpacked_bytes_per_expert(layer.bytes_per_expert, layer.hidden_size,
                                                         layer.intermediate_size, dtype)
        memory = self.placement.stream_bytes or streaming.stream_memory(cfg.stream_experts_memory, layer.num_experts,
                                                                        per_expert)  # a CPU run plans no GPU
        streamer = streaming.ExpertStreamer(self.layers, device, dtype, memory, min_tokens, h2d)
        logger.info("Expert streaming: %s", streamer.describe())
        return streamer

    def prefill_chunk(self, cap: int) -> int | None:
        """--max-num-batched-tokens auto with streaming: `stream_chunk` from the PCIe bandwidth
        (the cost model's, or measured now when --stream-experts-min-tokens skipped it) and the
        device's unpack and grouped-GEMM times, measured now (well under a second); at most `cap`
        tokens. Logged with the prediction it makes. None on a CPU run: no PCIe to amortise."""
        from tandem.offload import streaming

        s = self.streamer
        assert s is not None, "prefill_chunk needs a streamer"
        if s.h2d is None and s.cuda:
            from tandem.offload.measure import h2d_bandwidth

            s.h2d = h2d_bandwidth(s.device)
        if s.h2d is None:
            return None
        layer = self.layers[s.order[0]]
        unpack, pair = s.time_device()
        knee = streaming.stream_chunk(layer.nbytes, s.h2d, unpack, pair, self.top_k)
        chunk = min(cap, max(knee, s.min_tokens))  # a chunk below the threshold would not stream
        step = streaming.streamed_step_seconds(chunk, len(s.order), layer.nbytes, s.h2d, unpack, pair, self.top_k)
        logger.info("Prefill chunk: %d tokens a step (--max-num-batched-tokens auto: at most %d, streaming from %d). "
                    "A streamed step copies each layer's %.2f GB of experts in %.1f ms (%.1f GB/s); the GPU's expert "
                    "work (unpack %.1f ms a layer, then %.3f us a token-expert pair) fills that at %d tokens. "
                    "Predicted: %.2f s of expert time a chunk, prefill at most ~%.0f tok/s", chunk, cap, s.min_tokens,
                    layer.nbytes / 1e9, 1e3 * layer.nbytes / s.h2d, s.h2d / 1e9, 1e3 * unpack, 1e6 * pair, knee,
                    step, chunk / step)
        return chunk

    def _hot_expert(self, layer: int, expert: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        module = copy.deepcopy(self._templates[layer]).to_empty(device=device).to(dtype).requires_grad_(False)
        with torch.no_grad():
            for name, tensor in self._hot_weights[(layer, expert)].items():
                getattr(module, name).weight.copy_(tensor)
        return module

    def stats_line_part(self, metrics: EngineMetrics, model_name: str) -> str:
        """The engine stats line's part for experts in RAM, and its gauges and counters (syncs with
        the device: stats time only): `, Hot-expert hit rate: x% (y-z% over N layers)` since start,
        `, Expert streaming: N layer calls, X GB at Y GB/s` over the window since the last line."""
        part = ""
        rates = self.hot_hit_rates()
        if rates:
            for layer, rate in rates.items():
                metrics.hot_expert_hit_rate.labels(model_name=model_name, layer=str(layer)).set(rate)
            part += (f", Hot-expert hit rate: {100 * sum(rates.values()) / len(rates):.1f}% "
                     f"({100 * min(rates.values()):.1f}-{100 * max(rates.values()):.1f}% over {len(rates)} layers)")
        if self.streamer is not None:
            stats = self.streamer.stats()
            self.streamer.reset_stats()
            if stats.layers:
                metrics.expert_stream_bytes.labels(model_name=model_name).inc(stats.bytes)
                metrics.expert_stream_seconds.labels(model_name=model_name).inc(stats.seconds)
                rate = f" at {stats.bandwidth / 1e9:.1f} GB/s" if stats.seconds else ""
                part += f", Expert streaming: {stats.layers} layer calls, {stats.bytes / 1e9:.2f} GB{rate}"
        return part

    def hot_hit_rates(self) -> dict[int, float]:
        """Per layer with hot experts, the share of its (token, slot) pairs they served (syncs)."""
        rates = {i: ex.hit_rate() for i, ex in self.hot_executors.items()}
        return {i: r for i, r in rates.items() if r is not None}

    @property
    def live_rows(self) -> torch.Tensor | None:
        """The device scalar a graph replay writes its real row count into (None: no staging)."""
        return None if self.staging is None else self.staging.live_rows


def _short(indices: list[int]) -> str:
    return f"{indices[0]}..{indices[-1]}" if len(indices) > 3 else ",".join(map(str, indices))
