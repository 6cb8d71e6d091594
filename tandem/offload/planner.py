"""Memory plan: where the weights and the KV cache go, computed from config.json and the
safetensors headers before anything is loaded (`tandem plan`).

A directory without weight files, or a config.json given alone, is planned from the
architecture: the parameters of the model config.json describes, in the run dtype, are what its
weights would take, so a model's fit can be known before it is downloaded.

The engine sizes its KV cache with `kv_blocks` below; on CUDA it measures activation memory with a
profiling pass at start-up, so the plan's activation figure is an estimate and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.config import DEFAULT_BATCHED_TOKENS, MAX_AUTO_CHUNK, OffloadConfig, SpecConfig
from tandem.kv.groups import kv_bytes_per_token, kv_cache_bytes
from tandem.kv.spec import CacheGroup, group_layers, page_dtype_of, with_page_dtype
from tandem.models.loader import (
    CheckpointError,
    CheckpointInfo,
    available_host_memory,
    build_meta_model,
    check_config,
    inspect_checkpoint,
    read_config_file,
    read_safetensors_header,
    supported_model_type,
)
from tandem.models.registry import get_model_class
from tandem.offload.measure import MachineConstants
from tandem.offload.placement import Placement, plan_placement, predict_decode_seconds, ram_problems
from tandem.tokenizer import Tokenizer, TokenizerError

GiB = 1024**3
DRAFTER = "speculative drafter"  # the weights category of a draft model / DSpark drafter
DEFAULT_CPU_KV_MEMORY = 4 * GiB  # as vLLM's CPU backend: KV space is a fixed budget on CPU
CUDA_OVERHEAD = GiB // 2  # CUDA context, cuBLAS workspaces and allocator slack (estimate)
# A directory with none of these is planned from its config.json alone (one with weights in a
# format Tandem does not load gets the loader's error, as `tandem serve` would).
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth", "*.gguf")


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / 2**20:.2f} MiB"


def kv_blocks(budget: int, bytes_per_block: int, max_model_len: int, block_size: int, max_num_seqs: int) -> int:
    """KV blocks a budget buys, capped at what max_num_seqs sequences of max_model_len can use.
    Raises MemoryError (with what to change) when not even one full-length request fits."""
    num_blocks = budget // bytes_per_block
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise MemoryError(
            f"KV cache needs {_size(needed * bytes_per_block)} for one request at "
            f"--max-model-len {max_model_len} but the budget leaves {_size(max(budget, 0))}; "
            "lower --max-model-len or raise --kv-cache-memory / --gpu-memory-utilization"
        )
    return int(min(num_blocks, needed * max_num_seqs + 1))  # more would be unusable


def _category(name: str) -> str:
    if ".experts." in name:
        return "routed experts"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings + lm_head"
    if ".self_attn." in name:
        return "attention"
    return "other (norms, router, dense MLP)"


@dataclass(frozen=True)
class MemoryPlan:
    model_dir: Path
    model_type: str
    dtype: torch.dtype
    device: str
    weights: dict[str, int]  # bytes by category, in the run dtype
    kv_bytes_per_token: int
    max_model_len: int
    max_num_seqs: int
    device_bytes: int | None  # GPU memory the plan is for (None on CPU)
    activation_bytes: int  # estimate (CUDA only; measured by the engine at start-up)
    kv_budget: int
    kv_tokens: int = 0
    problems: list[str] = field(default_factory=list)
    from_config_only: bool = False  # no weight files: the sizes come from the architecture
    placement: Placement | None = None
    machine: MachineConstants | None = None  # measured bandwidths (--measure): a predicted decode speed
    # The placement's own problems (the GPU part, the experts in RAM): what the engine refuses to
    # load with. The others (the KV estimate) it settles by profiling.
    offload_problems: tuple[str, ...] = ()
    kv_groups: tuple[str, ...] = ()  # per cache group, for models beyond full attention (DeepSeek-V4)
    chunk_tokens: int = DEFAULT_BATCHED_TOKENS  # --max-num-batched-tokens: a prefill chunk (a streamed one copies
    # every expert; auto: the longest the plan reserves activations for)

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    def render(self) -> str:
        lines = [f"Memory plan for {self.model_dir} ({self.model_type}, {str(self.dtype).removeprefix('torch.')}, "
                 f"{self.device})"]
        if self.from_config_only:
            lines.append("  from config.json alone (no weight files, or an architecture Tandem plans but does not load "
                         "yet): weight sizes computed from the architecture")
        for cat, n in sorted(self.weights.items(), key=lambda kv: -kv[1]):
            lines.append(f"  weights  {cat:<34} {n / GiB:9.2f} GiB")
        lines.append(f"  weights  {'total':<34} {self.weights_total / GiB:9.2f} GiB")
        if self.device_bytes is not None:
            lines.append(f"  activations + CUDA overhead (estimate)      {self.activation_bytes / GiB:9.2f} GiB "
                         f"(steps of up to {self.chunk_tokens} tokens: --max-num-batched-tokens)")
        lines.append(f"  KV cache budget                             {max(self.kv_budget, 0) / GiB:9.2f} GiB "
                     f"({self.kv_bytes_per_token / 1024:.1f} KiB per token)")
        lines += self.kv_groups
        if self.kv_tokens:
            lines.append(f"  KV capacity {self.kv_tokens} tokens; max concurrency at --max-model-len "
                         f"{self.max_model_len}: {self.kv_tokens / self.max_model_len:.2f}x")
        if self.placement is not None and self.placement.num_experts:
            lines += self.placement.render()
            lines += self._predicted()
        lines += [f"  DOES NOT FIT: {p}" for p in self.problems]
        return "\n".join(lines)


    def _predicted(self) -> list[str]:
        p, m = self.placement, self.machine
        if p is None or self.device != "cuda":
            return []
        if m is None:
            return ["  predicted decode speed: run with --measure (it times RAM reads, PCIe and the GPU)"]
        lines = [f"  measured: {m.describe()}"]
        for batch in (1, 4):
            gpu, cpu = p.bytes_per_step(batch)
            step = predict_decode_seconds(p, batch, m.ram_read, m.gpu_read, m.roundtrip)
            lines.append(f"  predicted decode, batch {batch}: {batch / step:7.1f} tok/s ({step * 1e3:.2f} ms a step: "
                         f"{gpu / GiB:.2f} GiB GPU weights, {cpu / GiB:.2f} GiB experts from RAM per step)")
        if p.stream_bytes and p.cpu_bytes:  # a streamed chunk is bound by one pass of the experts over PCIe
            seconds = p.cpu_bytes / m.h2d
            lines.append(f"  predicted prefill with expert streaming: at most {self.chunk_tokens / seconds:7.0f} tok/s "
                         f"in chunks of {self.chunk_tokens} tokens (--max-num-batched-tokens; each chunk copies "
                         f"{p.cpu_bytes / GiB:.2f} GiB of experts, {seconds:.2f} s; the engine's cost model may "
                         "choose a shorter one, under auto)")
        return lines


def plan_memory(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory: int | None = None,
    kv_cache_dtype: str = "auto",
    device_bytes: int | None = None,
    offload: OffloadConfig | None = None,
    machine: MachineConstants | None = None,
    spec: SpecConfig | None = None,
    info: CheckpointInfo | None = None,
) -> MemoryPlan:
    """Plan without touching device memory. On CUDA, `device_bytes` is the GPU's memory (the
    current device's when None). `model_dir` is a checkpoint directory, or a config.json (a file,
    or a directory with no weight files): then the plan is the architecture's (see the module
    docstring). A checkpoint `tandem serve` would refuse (its weights, config.json or tokenizer
    files) raises CheckpointError with the same one-line message. `offload` says which routed
    experts may go to RAM (see placement.py); `machine` (measured bandwidths) adds a predicted
    decode speed; a draft model or DSpark drafter in `spec` takes its weights' share of the GPU.
    `info` is the caller's inspection of the checkpoint (the engine's, its tokenizer already read):
    not repeated. `max_num_batched_tokens` None is auto: DEFAULT_BATCHED_TOKENS, or up to
    MAX_AUTO_CHUNK when the experts in RAM stream for prefill (the engine's cost model picks a chunk
    up to that; the plan's `chunk_tokens` says which the activations were planned for)."""
    path = Path(model_dir)
    elem = torch.empty((), dtype=dtype).element_size()
    weights: dict[str, int] = {}
    config_only = path.is_file() or (path.is_dir() and not any(any(path.glob(g)) for g in WEIGHT_FILES))
    if config_only:
        config_path = path if path.is_file() else path / "config.json"
        config = read_config_file(config_path)
        model_type = supported_model_type(config, config_path)
        check_config(config, config_path)
        model = build_meta_model(get_model_class(model_type), config, dtype, config_path)
        for name, p in model.named_parameters():  # shared (tied) parameters once
            weights[_category(name)] = weights.get(_category(name), 0) + p.numel() * elem
    else:
        if info is None:
            info = inspect_checkpoint(path)  # validates the checkpoint; builds only a meta model
            try:
                Tokenizer.from_dir(path)  # as the engine does first: generation_config.json's defaults too
            except TokenizerError as e:
                raise CheckpointError(str(e)) from None
        config, model_type = info.config, info.model_type
        for name, entry in info.tensors.items():
            if name not in info.unused:
                weights[_category(name)] = weights.get(_category(name), 0) + math.prod(entry.shape) * elem
        with torch.device("meta"):
            model = info.model_class(info.config, dtype)
    groups = with_page_dtype(group_layers(model.kv_cache_specs()), page_dtype_of(kv_cache_dtype))
    max_len = max_model_len or model.max_position_embeddings
    kv_per_token, kv_min = _kv_geometry(groups, block_size, max_len)
    if device == "cuda" and device_bytes is None:
        if not torch.cuda.is_available():
            raise ValueError("planning for CUDA without a GPU here: pass --gpu-memory (e.g. 24GiB)")
        device_bytes = torch.cuda.mem_get_info()[1]
    offload = offload or OffloadConfig()
    drafter = drafter_bytes(spec, path, elem) if spec is not None and not config_only else 0
    if drafter:
        weights[DRAFTER] = drafter

    def place(chunk: int) -> tuple[int, int | None, Placement]:  # activations, GPU budget, placement
        activation = 0
        if device == "cuda":
            activation = CUDA_OVERHEAD + _activation_estimate(config, min(chunk, max_len), max_num_seqs, elem)
        budget = int(gpu_memory_utilization * device_bytes) - activation - drafter if device == "cuda" else None
        return activation, budget, plan_placement(model, dtype, offload, budget, kv_min)

    chunk = max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    activation, gpu_budget, placement = place(chunk)
    if max_num_batched_tokens is None and placement.offloaded and placement.stream_bytes:
        # A streamed chunk's activations: planned for the longest chunk auto may pick (MAX_AUTO_CHUNK,
        # else half, else a quarter) whose placement still fits and streams; never a plan the
        # default chunk fits and a longer one does not.
        for longer in sorted({min(MAX_AUTO_CHUNK >> i, max_len) for i in range(3)}, reverse=True):
            if longer <= chunk:
                break
            planned = place(longer)
            if planned[2].stream_bytes and not planned[2].problems:
                chunk, (activation, gpu_budget, placement) = longer, planned
                break
    problems = list(placement.problems)
    if placement.offloaded:  # the experts' bytes in RAM, in the CPU format
        weights.pop("routed experts", None)
        weights["routed experts on the GPU"] = placement.gpu_expert_bytes
        weights[f"routed experts in RAM ({placement.cpu_format})"] = placement.cpu_bytes
        weights = {k: v for k, v in weights.items() if v}
    on_device = gpu_weight_bytes(weights)  # (gpu_budget already has the drafter)
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device == "cuda":
        budget = gpu_budget - on_device
    else:
        budget = DEFAULT_CPU_KV_MEMORY
    if device == "cuda" and not placement.problems and on_device > gpu_budget:
        problems.append(
            f"the weights ({on_device / GiB:.2f} GiB) and activations do not fit in "
            f"{gpu_memory_utilization} x {device_bytes / GiB:.1f} GiB; use a bigger GPU, a smaller model or "
            "offload routed experts to RAM (--cpu-moe, --n-cpu-moe N)"
        )
    kv_tokens = 0
    try:
        kv_tokens = kv_capacity(groups, budget, block_size, max_len, max_num_seqs, batch_tokens=chunk)
    except MemoryError as e:
        if not placement.problems:  # the placement's message already says the KV cache does not fit
            problems.append(str(e))
    offload_problems = list(placement.problems)
    if device == "cpu":
        problems += _host_memory_problems(sum(weights.values()), kv_tokens * kv_per_token, offload.cpu_memory)
    elif placement.offloaded:
        ram = offload.cpu_memory if offload.cpu_memory is not None else available_host_memory()
        source = "--cpu-memory" if offload.cpu_memory is not None else "this machine's available RAM"
        offload_problems += ram_problems(placement, ram, source)
        problems += offload_problems[len(placement.problems):]
    return MemoryPlan(path, model_type, dtype, device, weights, kv_per_token, max_len,
                      max_num_seqs, device_bytes, activation, budget, kv_tokens, problems, config_only,
                      placement, machine, tuple(offload_problems), _group_lines(groups, block_size, max_len),
                      chunk)


def gpu_weight_bytes(weights: dict[str, int]) -> int:
    """The target's weights on the device: every category but the experts in RAM and the drafter."""
    return sum(v for k, v in weights.items() if "in RAM" not in k and k != DRAFTER)


def _one_kind(groups: tuple[CacheGroup, ...]) -> bool:
    return all(g.spec.kind == "full" for g in groups)


def _kv_geometry(groups: tuple[CacheGroup, ...], block_size: int, max_len: int) -> tuple[int, int]:
    """(bytes per token of context, bytes of one --max-model-len request's cache)."""
    if _one_kind(groups):
        per_token = sum(g.bytes_per_block(block_size) for g in groups) // block_size
        return per_token, -(-max_len // block_size) * block_size * per_token
    return math.ceil(kv_bytes_per_token(groups)), sum(kv_cache_bytes(groups, block_size, max_len))


def kv_capacity(groups: tuple[CacheGroup, ...], budget: int, block_size: int, max_len: int,
                max_num_seqs: int, step_tokens: int = 1, batch_tokens: int = 0) -> int:
    """Tokens of context the budget holds over `max_num_seqs` requests (decode steps of up to
    `step_tokens` query tokens, prefill chunks of `batch_tokens` a step: see `group_blocks`);
    MemoryError (naming the flags) when one --max-model-len request does not fit."""
    if _one_kind(groups):
        per_block = sum(g.bytes_per_block(block_size) for g in groups)
        return kv_blocks(budget, per_block, max_len, block_size, max_num_seqs) * block_size
    need = sum(kv_cache_bytes(groups, block_size, max_len, max_num_seqs, step_tokens, batch_tokens=batch_tokens))
    if need > budget:
        raise MemoryError(f"KV cache needs {_size(need)} for one request at --max-model-len {max_len} (and the state "
                          f"slots of --max-num-seqs {max_num_seqs}) but the budget leaves {_size(max(budget, 0))}; "
                          "lower --max-model-len or --max-num-seqs, or raise --kv-cache-memory / "
                          "--gpu-memory-utilization")
    # The most tokens whose caches fit, by bisection; the state slots and per-request rounding of
    # `max_num_seqs` requests are counted whatever the total (the engine allocates them all).
    lo, hi = max_len, max_len * max_num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = sum(kv_cache_bytes(groups, block_size, mid, max_num_seqs, step_tokens, batch_tokens=batch_tokens)) <= budget
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def _group_lines(groups: tuple[CacheGroup, ...], block_size: int, max_len: int) -> tuple[str, ...]:
    """The per-group cost and the 1M-token cache, for models with more than full-attention caches."""
    if _one_kind(groups):
        return ()
    lines = ["  KV cache groups:"]
    for g in groups:
        sp = g.spec
        if sp.kind == "sliding_window":
            per_request = kv_cache_bytes((g,), block_size, max_len)[0]
            lines.append(f"    sliding window {sp.window}, {g.num_layers} layers: {per_request / 2**20:.1f} MiB a "
                         "request, whatever its length")
        elif sp.kind == "compressed":
            index = f" + indexer keys ({sp.index_head_dim})" if sp.index_head_dim else ""
            lines.append(f"    compressed 1/{sp.ratio}{index}, {g.num_layers} layers: "
                         f"{g.num_layers * sp.bytes_per_token():.0f} B per token")
        else:
            lines.append(f"    full, {g.num_layers} layers: {g.num_layers * sp.bytes_per_token():.0f} B per token")
    million = sum(kv_cache_bytes(groups, block_size, 1 << 20))
    spec = groups[0].spec
    dtype = "fp8 (e4m3, a float32 scale per vector)" if spec.scaled else str(spec.stored_dtype).removeprefix("torch.")
    lines.append(f"  1M tokens of context (one request): {million / GiB:.2f} GiB in {dtype}")
    return tuple(lines)


def drafter_bytes(spec: SpecConfig, model_dir: Path, elem: int) -> int:
    """Weights of the spec config's draft model or DSpark drafter in the run dtype (0 for n-gram or
    none), read from its safetensors headers."""
    sub = {"draft_model": "draft", "dspark": "dspark"}.get(spec.method or "")
    if sub is None:
        return 0
    from tandem.spec.controller import drafter_dir

    files = sorted(drafter_dir(spec, str(model_dir), sub).glob("*.safetensors"))
    return sum(math.prod(t.shape) * elem for f in files for t in read_safetensors_header(f).values())


def _host_memory_problems(weights_bytes: int, kv_bytes: int, cpu_memory: int | None = None) -> list[str]:
    """On CPU the weights and the KV cache both live in RAM: this machine's, or `cpu_memory`."""
    available = cpu_memory if cpu_memory is not None else available_host_memory()
    if available is None or weights_bytes + kv_bytes <= available:
        return []
    where = "--cpu-memory is" if cpu_memory is not None else "this machine has"
    return [f"the weights ({weights_bytes / GiB:.2f} GiB) and the KV cache ({kv_bytes / GiB:.2f} GiB) need "
            f"{(weights_bytes + kv_bytes) / GiB:.2f} GiB but {where} {available / GiB:.2f} GiB of RAM "
            "available; free memory, lower --kv-cache-memory, use a smaller --dtype or a smaller model"]  # fmt: skip


def _activation_estimate(config: dict, tokens: int, max_num_seqs: int, elem: int) -> int:
    """Peak transient memory of one step of `tokens` tokens (hidden states, q/k/v, the widest MLP
    or expert activations, logits of the sampled rows), generously rounded up."""
    h = int(config["hidden_size"])
    d = int(config.get("head_dim") or h // int(config["num_attention_heads"]))
    qkv = (int(config["num_attention_heads"]) + 2 * int(config["num_key_value_heads"])) * d
    k = int(config.get("num_experts_per_tok", 1))
    mlp = max(int(config.get("intermediate_size", 0)), k * int(config.get("moe_intermediate_size", 0)))
    per_token = (8 * h + 2 * qkv + 3 * mlp) * elem
    logits = max_num_seqs * int(config["vocab_size"]) * 4 * 2
    return 2 * (tokens * per_token + logits)
