"""Expert placement: per MoE layer, whether its routed experts live on the GPU or in system RAM
(computed there by the CPU expert executor), decided before anything is loaded.

Everything else (embeddings, attention, routers, dense MLPs, shared experts, norms, the KV cache)
stays on the GPU. The sizes come from a meta-device model, so a config.json alone is enough.

Policy, in the order the flags are read:
  * `--cpu-moe`: every MoE layer's routed experts in RAM, except `--gpu-resident-moe-layers`.
  * `--n-cpu-moe N`: those of layers 0..N-1 in RAM (llama.cpp's meaning), the rest on the GPU.
  * no flag: all on the GPU when weights, activations and a KV cache for one `--max-model-len`
    request fit the budget; else every MoE layer offloaded, then whole MoE layers kept on the GPU
    (from layer 0 up, `--gpu-resident-moe-layers auto`) while that KV cache still fits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from tandem.config import OffloadConfig
from tandem.models.loader import LAYER_INDEX
from tandem.offload.hot_experts import ExpertCounts, choose_hot
from tandem.offload.hot_online import INTERVAL as ONLINE_INTERVAL
from tandem.offload.hot_online import ONLINE, initial_hot
from tandem.offload.streaming import stream_memory, unpacked_bytes_per_expert

GiB = 1024**3
MiB = 1024**2
LOSSY_CONVERSIONS = frozenset({"int8", "int4", "mxfp4"})  # from a bf16 / fp32 checkpoint


def expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes of one routed expert (gate, up [I, H] and down [H, I]) in the CPU kernel's format:
    what reading it for one token costs. Scales: int8 one fp32 per output row, int4 one bf16 per
    32 inputs, mxfp4 one e8m0 byte per 32 inputs (tests check this against the kernel's layout)."""
    n = 3 * hidden * inter
    if fmt == "fp32":
        return 4 * n
    if fmt == "bf16":
        return 2 * n
    if fmt == "int8":
        return n + 4 * (2 * inter + hidden)
    if fmt == "int4":
        return n // 2 + 2 * (n // 32)
    if fmt == "mxfp4":
        return n // 2 + n // 32
    raise ValueError(f"unknown CPU expert format {fmt!r}")


def resolve_cpu_format(requested: str, dtype: torch.dtype) -> str:
    """`--cpu-moe-dtype auto` keeps the run dtype's values: fp32 -> fp32, bf16 -> bf16, fp16 ->
    fp32 (bf16 would round fp16 values; fp32 holds them exactly)."""
    if requested != "auto":
        return requested
    return "bf16" if dtype == torch.bfloat16 else "fp32"


@dataclass(frozen=True)
class LayerPlacement:
    layer: int
    moe: bool
    experts_on: str | None  # "gpu" | "cpu" (None: a dense layer)
    gpu_bytes: int  # attention, norms, router, dense MLP, and the experts when on the GPU
    cpu_bytes: int  # routed experts in RAM, in the CPU format
    expert_bytes: int = 0  # the layer's routed experts in the run dtype, wherever they are


@dataclass(frozen=True)
class Placement:
    """Where each layer's weights live. `cpu_layers` is what the loader and the engine read."""

    layers: tuple[LayerPlacement, ...]
    cpu_format: str
    reason: str  # why experts are (or are not) offloaded
    global_gpu_bytes: int  # embeddings, lm_head, final norm
    num_experts: int
    top_k: int
    hidden_size: int
    inter_size: int
    run_elem: int  # bytes per element of the run dtype
    problems: tuple[str, ...] = field(default=())
    # Hot experts (hot_experts.py): per offloaded layer, the experts also kept on the device, and
    # the share of the calibration's pairs they take (the predicted hit rate).
    hot: tuple[tuple[int, tuple[int, ...]], ...] = ()
    hot_hit_rate: float = 0.0
    hot_source: str = ""
    stream_bytes: int = 0  # device memory for PCIe expert streaming (streaming.py; 0: none)

    @property
    def hot_bytes(self) -> int:
        """Device bytes of the hot experts (run dtype)."""
        per = self.hidden_size * self.inter_size * 3 * self.run_elem
        return per * sum(len(ids) for _, ids in self.hot)

    @property
    def cpu_layers(self) -> tuple[int, ...]:
        return tuple(p.layer for p in self.layers if p.experts_on == "cpu")

    @property
    def gpu_moe_layers(self) -> tuple[int, ...]:
        return tuple(p.layer for p in self.layers if p.experts_on == "gpu")

    @property
    def offloaded(self) -> bool:
        return bool(self.cpu_layers)

    @property
    def gpu_bytes(self) -> int:
        return self.global_gpu_bytes + sum(p.gpu_bytes for p in self.layers) + self.hot_bytes + self.stream_bytes

    @property
    def cpu_bytes(self) -> int:
        return sum(p.cpu_bytes for p in self.layers)

    @property
    def gpu_expert_bytes(self) -> int:
        """Routed experts that stay on the GPU (run dtype)."""
        return sum(p.expert_bytes for p in self.layers if p.experts_on == "gpu")

    @property
    def lossy(self) -> bool:
        return self.offloaded and self.cpu_format in LOSSY_CONVERSIONS

    def render(self) -> list[str]:
        """The per-layer table; runs of identical layers are folded into one row."""
        lines = [f"  expert placement: {self.reason}"]
        if self.offloaded:
            lossy = " (a LOSSY conversion of the checkpoint's weights)" if self.lossy else ""
            lines.append(f"  routed experts in RAM as {self.cpu_format}{lossy}: {len(self.cpu_layers)} of "
                         f"{len(self.cpu_layers) + len(self.gpu_moe_layers)} MoE layers")
        lines.append(f"    {'layers':<12} {'kind':<6} {'experts on':<11} {'GPU MiB':>9} {'RAM MiB':>9}")
        rows: list[tuple[int, int, LayerPlacement]] = []
        for p in self.layers:
            last = rows[-1][2] if rows else None
            if last is not None and (last.moe, last.experts_on, last.gpu_bytes, last.cpu_bytes) == (
                p.moe, p.experts_on, p.gpu_bytes, p.cpu_bytes
            ):
                rows[-1] = (rows[-1][0], p.layer, last)
            else:
                rows.append((p.layer, p.layer, p))
        for first, last_layer, p in rows:
            span = str(first) if first == last_layer else f"{first}-{last_layer}"
            each = " each" if first != last_layer else ""
            lines.append(f"    {span:<12} {'moe' if p.moe else 'dense':<6} {p.experts_on or '-':<11} "
                         f"{p.gpu_bytes / MiB:9.1f} {p.cpu_bytes / MiB:9.1f}{each}")
        lines.append(f"    {'(global)':<12} {'':<6} {'':<11} {self.global_gpu_bytes / MiB:9.1f} {0:9.1f}"
                     "   embeddings, lm_head, final norm")
        if self.hot:
            n = sum(len(ids) for _, ids in self.hot)
            lines.append(f"    {'(hot)':<12} {'':<6} {'gpu':<11} {self.hot_bytes / MiB:9.1f} {0:9.1f}   {n} hot experts "
                         f"over {len(self.hot)} layers, also in RAM; predicted hit rate {100 * self.hot_hit_rate:.1f}% "
                         f"({self.hot_source})")
        if self.stream_bytes:
            lines.append(f"    {'(streaming)':<12} {'':<6} {'gpu':<11} {self.stream_bytes / MiB:9.1f} {0:9.1f}   buffers for "
                         "long prefill steps' experts copied over PCIe (--stream-experts-memory)")
        lines.append(f"  weights on the GPU {self.gpu_bytes / GiB:.2f} GiB, routed experts in RAM "
                     f"{self.cpu_bytes / GiB:.2f} GiB")
        return lines

    # -- what one decode step reads ----------------------------------------------------------
    def distinct_experts(self, batch: int) -> float:
        """Expected distinct experts a layer's batch touches under uniform routing."""
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** batch) if e else 0.0

    def bytes_per_step(self, batch: int) -> tuple[int, int]:
        """(GPU weight bytes, RAM expert bytes) one decode step of `batch` tokens reads: every
        non-expert weight but the embedding table, and each touched expert once."""
        touched = self.distinct_experts(batch)
        per_cpu = expert_bytes(self.cpu_format, self.hidden_size, self.inter_size) if self.offloaded else 0
        gpu = self.global_gpu_bytes // 2  # the lm_head (an embedding lookup reads a few rows)
        cpu = 0
        for p in self.layers:
            if p.experts_on == "cpu":
                gpu += p.gpu_bytes
                cpu += int(touched * per_cpu)
            elif p.experts_on == "gpu":  # the touched experts only
                gpu += p.gpu_bytes - p.expert_bytes + int(touched * p.expert_bytes / self.num_experts)
            else:
                gpu += p.gpu_bytes
        return gpu, cpu


def _layer_sizes(model: torch.nn.Module, elem: int) -> tuple[dict[int, int], dict[int, int], int]:
    """(layer -> non-expert bytes, layer -> routed-expert bytes, bytes outside layers), run dtype."""
    other: dict[int, int] = {}
    experts: dict[int, int] = {}
    outside = 0
    for name, p in model.named_parameters():  # tied parameters once
        m = LAYER_INDEX.search(name)
        n = p.numel() * elem
        if m is None:
            outside += n
        elif ".experts." in name:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + n
        else:
            other[int(m.group(1))] = other.get(int(m.group(1)), 0) + n
    return other, experts, outside


def plan_placement(
    model: torch.nn.Module,
    dtype: torch.dtype,
    offload: OffloadConfig,
    gpu_budget: int | None,
    kv_min_bytes: int,
) -> Placement:
    """Decide per layer. `model` may be on the meta device. `gpu_budget` is what weights and the
    KV cache may take on the GPU (after activations and CUDA overhead; None on a CPU run, where
    everything is in RAM and `--cpu-moe` only chooses the CPU kernel over the torch experts).
    `kv_min_bytes` is the KV cache of one --max-model-len request. Problems (the GPU part does not
    fit) are returned in `problems`, with the flag that would fix them."""
    elem = torch.empty((), dtype=dtype).element_size()
    other, experts, outside = _layer_sizes(model, elem)
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else {}
    num_layers = max([*other, *experts], default=-1) + 1
    fmt = resolve_cpu_format(offload.cpu_moe_dtype, dtype)
    first = next(iter(blocks.values()), None)
    num_experts, top_k = (first.num_experts, first.top_k) if first is not None else (0, 0)
    hidden, inter = tuple(first.experts[0].down_proj.weight.shape) if first is not None else (0, 0)
    per_cpu = expert_bytes(fmt, hidden, inter) if first is not None else 0
    fixed = outside + sum(other.values()) + kv_min_bytes
    # Expert streaming's device buffers (streaming.py), planned whenever experts go to RAM. Its
    # groups run through torch._grouped_mm, bf16 on the GPU (cpu_executor.py's _streamer).
    streams = gpu_budget is not None and first is not None and offload.stream_experts != "off" and dtype == torch.bfloat16
    stream_per_expert = unpacked_bytes_per_expert(per_cpu, hidden, inter, dtype)
    stream_reserve = stream_memory(offload.stream_experts_memory, num_experts, stream_per_expert) if streams else 0
    stream_note = ""

    def gpu_need(cpu: set[int]) -> int:
        return fixed + sum(n for i, n in experts.items() if i not in cpu) + (stream_reserve if cpu & set(blocks) else 0)

    def placement(cpu: set[int], reason: str, problems: tuple[str, ...] = ()) -> Placement:
        layers = []
        for i in range(num_layers):
            on_cpu = i in cpu and i in blocks
            gpu = other.get(i, 0) + (0 if on_cpu else experts.get(i, 0))
            ram = blocks[i].num_experts * per_cpu if on_cpu else 0
            layers.append(LayerPlacement(i, i in blocks, ("cpu" if on_cpu else "gpu") if i in blocks else None, gpu, ram,
                                         experts.get(i, 0)))
        in_ram = any(i in blocks for i in cpu)
        if stream_reserve and in_ram and problems:  # the shortfall counts the streaming buffers: say so
            problems = (problems[0] + f" (the GPU part includes {stream_reserve / GiB:.2f} GiB of expert-streaming "
                        "buffers: lower --stream-experts-memory or use --stream-experts off)", *problems[1:])
        p = Placement(tuple(layers), fmt, reason + (stream_note if in_ram else ""), outside, num_experts, top_k,
                      hidden, inter, elem, problems, stream_bytes=stream_reserve if in_ram else 0)
        if offload.hot_experts is None or not p.cpu_layers:
            return p
        assert offload.hot_expert_memory is not None  # OffloadConfig checks they come together
        if offload.hot_experts == ONLINE:
            hot, rate = initial_hot(list(p.cpu_layers), num_experts, offload.hot_expert_memory, 3 * hidden * inter * elem)
            source = (f"--hot-experts online: re-ranked every {ONLINE_INTERVAL} steps from the routing served, "
                      "starting from each layer's first experts; the rate is uniform routing's")
        else:
            counts = ExpertCounts.load(offload.hot_experts, num_experts, set(blocks))
            hot, rate = choose_hot(counts, list(p.cpu_layers), offload.hot_expert_memory, 3 * hidden * inter * elem)
            source = f"--hot-experts {offload.hot_experts}"
        p = replace(p, hot=tuple(hot.items()), hot_hit_rate=rate, hot_source=source)
        if gpu_budget is not None and not p.problems and gpu_need(cpu) + p.hot_bytes > gpu_budget:
            short = (gpu_need(cpu) + p.hot_bytes - gpu_budget) / GiB
            p = replace(p, problems=(f"the hot experts ({p.hot_bytes / GiB:.2f} GiB) do not fit beside the rest of the "
                                     f"GPU part ({short:.2f} GiB short); lower --hot-expert-memory",))
        return p

    resident = offload.gpu_resident_moe_layers
    if isinstance(resident, tuple) and (unknown := sorted(set(resident) - set(blocks))):
        raise ValueError(f"--gpu-resident-moe-layers {','.join(map(str, unknown))}: not MoE layers of this model "
                         f"(its MoE layers: {_ranges(sorted(blocks))})")
    if offload.n_cpu_moe is not None and resident is not None:
        raise ValueError("--gpu-resident-moe-layers goes with --cpu-moe or automatic offload, not --n-cpu-moe "
                         "(which already keeps the layers from N up on the GPU)")
    if not blocks:
        if offload.forced:
            raise ValueError("--cpu-moe / --n-cpu-moe: this model has no MoE layers (no routed experts to offload)")
        return placement(set(), "no MoE layers")
    if gpu_budget is None:  # a CPU run: all in RAM; the flags choose the CPU kernel for the experts
        if offload.cpu_moe:
            return placement(set(blocks), "CPU run, --cpu-moe: routed experts on the CPU expert kernel")
        if offload.n_cpu_moe is not None:
            cpu = {i for i in blocks if i < offload.n_cpu_moe}
            return placement(cpu, f"CPU run, --n-cpu-moe {offload.n_cpu_moe}: those layers on the CPU expert kernel")
        return placement(set(), "CPU run: routed experts run by the torch executor (--cpu-moe for the CPU kernel)")

    if stream_reserve and offload.stream_experts == "auto" and offload.stream_experts_memory is None:
        # Streaming is an optimisation: with no room for its default buffers beside every expert in
        # RAM, it gets one expert a group, or none; the model is served either way.
        if gpu_need(set(blocks)) > gpu_budget:
            fits = gpu_need(set(blocks)) - stream_reserve + stream_per_expert <= gpu_budget
            stream_reserve = stream_per_expert if fits else 0
            stream_note = (f"; expert streaming gets {stream_reserve / GiB:.2f} GiB (one expert a copy)" if stream_reserve
                           else "; expert streaming off: no GPU memory left for its buffers")
    if offload.n_cpu_moe is not None:
        cpu = {i for i in blocks if i < offload.n_cpu_moe}
        reason = f"--n-cpu-moe {offload.n_cpu_moe}: routed experts of layers 0..{offload.n_cpu_moe - 1} in RAM"
        if gpu_need(cpu) <= gpu_budget:
            return placement(cpu, reason)
        fix = next((n for n in range(offload.n_cpu_moe + 1, num_layers + 1)
                    if gpu_need({i for i in blocks if i < n}) <= gpu_budget), None)
        hint = f"raise --n-cpu-moe to {fix}" if fix is not None else "lower --max-model-len or use a bigger GPU"
        return placement(cpu, reason, (_gpu_shortfall(gpu_need(cpu), gpu_budget, kv_min_bytes, hint),))
    if not offload.cpu_moe and gpu_need(set()) <= gpu_budget:
        return placement(set(), "everything fits the GPU")
    all_cpu = set(blocks)
    if not offload.cpu_moe and gpu_need(all_cpu) > gpu_budget:  # offloading would not make it fit
        hint = "lower --max-model-len, raise --gpu-memory-utilization or use a bigger GPU"
        problem = "the weights and activations do not fit even with every routed expert in RAM: "
        return placement(set(), "nothing offloaded: it would not fit the GPU even so",
                         (problem + _gpu_shortfall(gpu_need(all_cpu), gpu_budget, kv_min_bytes, hint),))
    if offload.cpu_moe:
        reason = "--cpu-moe: routed experts of every MoE layer in RAM"
        resident = resident if resident is not None else ()
    else:
        reason = (f"the model needs {gpu_need(set()) / GiB:.2f} GiB on the GPU (with a KV cache for one "
                  f"--max-model-len request) but the budget is {gpu_budget / GiB:.2f} GiB: routed experts in RAM")
        resident = resident if resident is not None else "auto"
    if resident == "auto":
        kept: list[int] = []
        for i in sorted(blocks):
            if gpu_need(all_cpu - {*kept, i}) <= gpu_budget:
                kept.append(i)
        resident = tuple(kept)
        reason += f", {len(kept)} whole MoE layers kept on the GPU (auto: {_ranges(kept) or 'none fit'})"
    elif resident:
        reason += f", MoE layers {_ranges(list(resident))} kept on the GPU (--gpu-resident-moe-layers)"
    cpu = all_cpu - set(resident)
    if gpu_need(cpu) <= gpu_budget:
        return placement(cpu, reason)
    hint = ("keep fewer --gpu-resident-moe-layers" if resident else
            "lower --max-model-len, raise --gpu-memory-utilization or use a bigger GPU")
    return placement(cpu, reason, (_gpu_shortfall(gpu_need(cpu), gpu_budget, kv_min_bytes, hint),))


def _gpu_shortfall(need: int, budget: int, kv_min: int, hint: str) -> str:
    return (f"the GPU part needs {need / GiB:.2f} GiB (of which {kv_min / GiB:.2f} GiB KV cache for one "
            f"--max-model-len request) but the budget leaves {max(budget, 0) / GiB:.2f} GiB "
            f"({(need - budget) / GiB:.2f} GiB short); {hint}")


def ram_problems(placement: Placement, available: int | None, source: str) -> list[str]:
    """The routed experts in RAM against the machine's RAM (`source` names where the figure is from)."""
    need = placement.cpu_bytes
    if available is None or need <= available:
        return []
    fixes = ["--cpu-moe-dtype int4 (lossy)" if placement.cpu_format not in ("int4", "mxfp4") else None,
             "keep more MoE layers on the GPU (--gpu-resident-moe-layers, --n-cpu-moe)"]
    return [f"the routed experts in RAM need {need / GiB:.2f} GiB but {source} is {available / GiB:.2f} GiB "
            f"({(need - available) / GiB:.2f} GiB short); " + " or ".join(f for f in fixes if f)]


def cpu_expert_step_cost(placement: Placement, ram_read: float) -> Callable[[Sequence[int]], float]:
    """The speculative controller's cost hook (tandem/spec/goodput.py `StepCost.extra`) for a
    model with experts in RAM: the seconds a step verifying draft depths ks spends on routed
    experts beyond the ones its measured tables read. Those tables time steps whose tokens are
    all alike (every token routes to the same top-k), so a real step of n = sum(1 + k) tokens
    reads, per offloaded layer, distinct_experts(n) - top_k more experts (uniform routing: an
    upper bound for a trained router), each `expert_bytes` at `ram_read` bytes/s, less the share
    the hot experts serve on the GPU."""
    per_expert = expert_bytes(placement.cpu_format, placement.hidden_size, placement.inter_size)
    layers, miss = len(placement.cpu_layers), 1.0 - placement.hot_hit_rate
    base = placement.distinct_experts(1)  # = top_k

    def extra(ks: Sequence[int]) -> float:
        more = placement.distinct_experts(sum(1 + k for k in ks)) - base
        return layers * max(more, 0.0) * per_expert * miss / ram_read

    return extra


def predict_decode_seconds(placement: Placement, batch: int, ram_read: float, gpu_read: float,
                           roundtrip: float) -> float:
    """Seconds per decode step of `batch` tokens at the bandwidths given (bytes/s): GPU weights at
    `gpu_read`, offloaded experts at `ram_read`, plus one GPU->CPU->GPU round trip per offloaded
    layer. The CPU and GPU parts of a layer run one after the other (Qwen3 has no shared expert
    to overlap with)."""
    gpu, cpu = placement.bytes_per_step(batch)
    return gpu / gpu_read + cpu / ram_read + len(placement.cpu_layers) * roundtrip


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    for i in sorted(indices):
        if out and (m := re.fullmatch(r"(\d+)(?:-(\d+))?", out[-1])) and int(m.group(2) or m.group(1)) == i - 1:
            out[-1] = f"{m.group(1)}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


__all__ = ["LayerPlacement", "Placement", "cpu_expert_step_cost", "expert_bytes", "plan_placement",
           "predict_decode_seconds",
           "ram_problems", "resolve_cpu_format"]
