"""Frozen, typed configuration. Every CLI flag maps to one field here.

"auto" values are resolved when the config is built (`EngineConfig.resolve` and the CLI); a config
object is never mutated afterwards.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.core import MAX_LOGPROBS
from tandem.kv.spec import page_dtype_of

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # --block-size: tokens per KV cache block

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse a byte size such as `4GiB`, `512MiB`, `2G` or `1000000` into bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4GiB, 512MiB or a byte count")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if (binary or unit) else 1  # plain 'G' is read as GiB, as vLLM does
    power = " KMGT".index(unit) if unit else 0
    return int(value * base**power)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU keeps results exact against transformers; bf16 is what GPUs serve in.
        return torch.bfloat16 if device == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} unknown; choose auto, {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    model: str  # directory of an HF-format checkpoint
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_model_len: int | None = None  # None: from the checkpoint's config (max_position_embeddings)
    served_model_name: str | None = None
    chat_template: str | None = None  # a path or an inline jinja template; None: the tokenizer's
    seed: int = 0
    # --generation-config: where the sampling defaults of fields a request leaves out come from.
    # "auto": the model directory's generation_config.json; "vllm": none (SamplingParams' own);
    # else a directory holding the generation_config.json to use (eos ids stay the model's).
    generation_config: str = "auto"


@dataclass(frozen=True)
class RunnerConfig:
    """How the forward pass executes. "auto" picks the fast path on CUDA (Triton paged attention,
    grouped-GEMM MoE, CUDA graphs for decode) and the torch reference elsewhere."""

    attention_backend: str = "auto"  # auto | torch | triton
    moe_executor: str = "auto"  # auto | torch | grouped
    enforce_eager: bool = False  # never capture CUDA graphs
    # Triton RMSNorm / rotary / SiLU*up / router / small-batch MoE kernels (CUDA only; CPU always runs
    # the torch reference). On by default: 2.5x batch-1 decode on the H200 (BENCHMARKS.md).
    fused_ops: bool = True
    # torch intra-op threads (--cpu-threads); None: the cores this process may use, less one left
    # for the server's event loop and the engine thread that drives the device.
    cpu_threads: int | None = None
    # --prefill-graph-max-tokens: a step with prompt work (chunks of one or more prompts, beside
    # decodes and verifies) of up to this many tokens replays a CUDA graph (token totals 8, 16,
    # .. this); 0: prefill runs eagerly. An eager prefill step is ~7-13 ms of host launches on
    # the demo model, which dwarfs its decode steps.
    prefill_graph_max_tokens: int = 512

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"--prefill-graph-max-tokens must be 0 (off) or more, got {self.prefill_graph_max_tokens}")

    def resolve(self, device: str, dtype: torch.dtype) -> RunnerConfig:
        fast = device == "cuda" and dtype in (torch.bfloat16, torch.float16)
        attn = self.attention_backend if self.attention_backend != "auto" else ("triton" if device == "cuda" else "torch")
        moe = self.moe_executor if self.moe_executor != "auto" else ("grouped" if fast else "torch")
        threads = self.cpu_threads if self.cpu_threads is not None else max(1, usable_cpus() - 1)
        return RunnerConfig(attn, moe, self.enforce_eager or device != "cuda", self.fused_ops, threads,
                            self.prefill_graph_max_tokens)


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; overrides gpu_memory_utilization, works on any device
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3: see kv/spec.py page_dtype_of

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:  # (True == 1)
            raise ValueError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))} (tokens per KV cache "
                             f"block), got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")
        page_dtype_of(self.kv_cache_dtype)  # raises, naming the flag


DEFAULT_BATCHED_TOKENS = 2048  # --max-num-batched-tokens when it is left out and no expert streams
# The longest chunk auto gives a prefill step whose experts stream over PCIe (the memory plan
# reserves its activations): on the H200 a 16K-token step of V4-Flash's expert shape already
# computes longer than its experts take to copy (BENCHMARKS.md), so a longer one buys nothing.
MAX_AUTO_CHUNK = 16384


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # None (auto): DEFAULT_BATCHED_TOKENS, or with routed experts streamed over PCIe for prefill the
    # cost model's chunk (tandem/offload/streaming.py: stream_chunk). The engine resolves it at
    # start-up; everything past that reads an int.
    max_num_batched_tokens: int | None = None
    max_queued_requests: int = 1024
    enable_chunked_prefill: bool = True
    # Schedule and launch the next decode step before the current one's tokens reach the host, so
    # the host's work (output, stop checks, scheduling, staging) runs while the device computes.
    # None (auto): on for CUDA, off for the CPU (where a launch is the computation itself).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or (self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0):
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be positive")

    @property
    def batched_tokens(self) -> int:
        """The step's token budget, the default where auto has not been resolved yet."""
        return self.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS


SPEC_METHODS = ("ngram", "draft_model", "dspark")  # wired into the engine
# Kmax of a drafter method whose config leaves num_speculative_tokens out (n-gram needs it given).
DEFAULT_DRAFTER_TOKENS = 3
_SPEC_NOT_WIRED = {
    "mtp": "speculative method 'mtp' is reserved for DeepSeek-V4's multi-token prediction and does not exist yet",
}
MAX_SPEC_TOKENS = 8
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive",
              "phase_k")


def _spec_int(key: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"--speculative-config: {key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, with vLLM's `--speculative-config` keys plus Tandem's `adaptive`.

    method None: off. `num_speculative_tokens` is Kmax, the longest draft; `adaptive` "off" drafts
    Kmax tokens for every request, "phase" drafts `phase_k[phase]` (0..Kmax; a phase not listed
    gets Kmax) for a request in that phase (`tandem.spec.phase`), "auto" lets the goodput
    controller choose 0..Kmax per request and step (`tandem.spec.auto`; its choices follow
    measured step times, so a seeded sampled request is reproducible in distribution, not token
    for token, across runs; greedy output is the target's either way). `max_k` sizes the
    runner's CUDA graph query lengths (1 .. max_k + 1): Kmax when speculating, else what was asked
    (0: decode only). Build one from JSON or a dict with `SpecConfig.parse`, which checks every key.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    adaptive: str = "off"  # off | phase | auto
    phase_k: tuple[tuple[str, int], ...] = ()  # (phase, K) pairs
    model: str | None = None  # the drafter's directory (draft_model / dspark; default: the target's draft/, dspark/)
    max_k: int = 0

    def __post_init__(self) -> None:
        if self.method is not None:
            object.__setattr__(self, "max_k", max(self.max_k, self.num_speculative_tokens))

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def k_for(self, phase: str) -> int:
        """The draft depth of a request in `phase` (before the request's own limits)."""
        if self.adaptive == "phase":
            return dict(self.phase_k).get(phase, self.num_speculative_tokens)
        return self.num_speculative_tokens

    def draft_depths(self) -> tuple[int, ...]:
        """The draft depths (> 0) the policy can choose: Kmax, with `phase` each phase's K, with
        `auto` every depth 1..Kmax. A block drafter captures a graph per depth; a request whose K
        is cut shorter (max_tokens) uses the next depth up and keeps the prefix."""
        from tandem.spec.phase import PHASES

        if self.adaptive == "auto":
            return tuple(range(1, self.num_speculative_tokens + 1))
        return tuple(sorted({self.k_for(p) for p in PHASES} - {0} | {self.num_speculative_tokens}))

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None, max_k: int = 0) -> SpecConfig:
        """`--speculative-config` JSON (or its dict) -> a checked config. Raises ValueError with one
        line naming the bad key."""
        if value is None or value == "" or value == {}:
            return cls(max_k=max_k)
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\'')
        unknown = [k for k in value if k not in _SPEC_KEYS]
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}; known keys: {', '.join(_SPEC_KEYS)}")
        method = value.get("method")
        if method in _SPEC_NOT_WIRED:
            raise ValueError(f"--speculative-config: method: {_SPEC_NOT_WIRED[method]}")
        if method not in SPEC_METHODS:
            raise ValueError(f"--speculative-config: method must be one of ngram, draft_model, dspark, got {method!r}")
        if "num_speculative_tokens" not in value and method == "ngram":
            raise ValueError("--speculative-config: num_speculative_tokens (Kmax) is required")
        kmax = _spec_int("num_speculative_tokens", value.get("num_speculative_tokens", DEFAULT_DRAFTER_TOKENS), 1,
                         MAX_SPEC_TOKENS)
        lo = _spec_int("prompt_lookup_min", value.get("prompt_lookup_min", 1), 1, 64)
        hi = _spec_int("prompt_lookup_max", value.get("prompt_lookup_max", max(3, lo)), 1, 64)
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lo}) must be at most prompt_lookup_max ({hi})")
        adaptive = value.get("adaptive", "off")
        if adaptive not in ("off", "phase", "auto"):
            raise ValueError(f"--speculative-config: adaptive must be 'off', 'phase' or 'auto', got {adaptive!r}")
        phase_k = value.get("phase_k", {})
        if not isinstance(phase_k, dict):
            raise ValueError(f"--speculative-config: phase_k must be an object such as "
                             f'{{"reasoning": 1, "content": 2}}, got {type(phase_k).__name__}')
        if phase_k and adaptive != "phase":
            raise ValueError("--speculative-config: phase_k needs \"adaptive\": \"phase\"")
        from tandem.spec.phase import PHASES  # here, not at the top: config is imported by everything

        for phase, k in phase_k.items():
            if phase not in PHASES:
                raise ValueError(f"--speculative-config: phase_k: unknown phase {phase!r}; phases: "
                                 f"{', '.join(PHASES)}")
            _spec_int(f"phase_k.{phase}", k, 0, kmax)
        model = value.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"--speculative-config: model must be a directory path, got {type(model).__name__}")
        return cls(method, kmax, lo, hi, adaptive, tuple(sorted(phase_k.items())), model, max_k)


CPU_MOE_DTYPES = ("auto", "fp32", "bf16", "int8", "int4", "mxfp4")
CPU_MOE_ACT_DTYPES = ("auto", "int8")  # tandem/offload/cpu_experts.py ACT_DTYPES
CPU_MOE_HANDOFFS = ("hostfunc", "poll")  # tandem/offload/handoff.py HANDOFFS


@dataclass(frozen=True)
class OffloadConfig:
    """Where routed experts live: the GPU, or system RAM computed on the CPU, decided per MoE layer
    by the planner (tandem/offload/placement.py).

    With no flag the planner offloads only when the model does not fit the GPU, keeping whole MoE
    layers on the GPU with what is left of its budget. `cpu_moe` puts every routed expert in RAM;
    `n_cpu_moe` those of the first N layers (llama.cpp's --n-cpu-moe). `gpu_resident_moe_layers`
    names MoE layers kept whole on the GPU when experts are offloaded: layer indices, "auto" (as
    many as the budget allows) or None (the default: "auto" when offloading because the model does
    not fit, none with --cpu-moe)."""

    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    gpu_resident_moe_layers: tuple[int, ...] | str | None = None
    cpu_moe_threads: int | None = None  # None: the usable cores less one (for the thread driving the GPU)
    # Expert weights in RAM: auto keeps the checkpoint's values (bf16 -> bf16, fp32 -> fp32, MXFP4
    # as it is); int8 / int4 (and mxfp4 from a bf16 checkpoint) are lossy conversions.
    cpu_moe_dtype: str = "auto"
    cpu_memory: int | None = None  # bytes of RAM to plan for (None: this machine's)
    # The CPU kernel's activations: auto (fp32 math, or bf16 pairs on avx512bf16) or int8 (per
    # block of 32, LOSSY, for int4 / mxfp4 experts: fewer lookups and products per weight).
    cpu_moe_act_dtype: str = "auto"
    # How a CUDA stream hands a layer to the CPU experts and waits for it (tandem/offload/handoff.py):
    # a polling thread the stream signals through pinned flags (poll), or a host node (hostfunc).
    # poll by default: on the H100 boxes it hands a layer off in 25 us against 56-79 us, and in
    # session 23 it decoded faster at every batch of both shapes (BENCHMARKS.md).
    cpu_moe_handoff: str = "poll"
    # Hot experts (tandem/offload/hot_experts.py): a `tandem profile-experts` calibration file, and
    # the device bytes its most-used experts of the offloaded layers may take there as well.
    hot_experts: str | None = None
    hot_expert_memory: int | None = None
    # PCIe streaming for long prefill steps (tandem/offload/streaming.py): "auto" streams on CUDA
    # (bf16 on sm90+, where the grouped executor runs) from the cost model's threshold; "on" also
    # on a CPU run (the same math there: for checking) and refuses where it cannot run; "off" never.
    stream_experts: str = "auto"
    stream_experts_min_tokens: int | None = None  # overrides the cost model's threshold
    stream_experts_memory: int | None = None  # device bytes of the ring and one unpacked group (None: auto)

    def __post_init__(self) -> None:
        if self.cpu_moe and self.n_cpu_moe is not None:
            raise ValueError("--cpu-moe and --n-cpu-moe both say which experts go to the CPU; give one")
        if self.n_cpu_moe is not None and self.n_cpu_moe < 0:
            raise ValueError(f"--n-cpu-moe must be at least 0, got {self.n_cpu_moe}")
        if self.cpu_moe_threads is not None and self.cpu_moe_threads < 1:
            raise ValueError(f"--cpu-moe-threads must be at least 1, got {self.cpu_moe_threads}")
        if self.cpu_moe_dtype not in CPU_MOE_DTYPES:
            raise ValueError(f"--cpu-moe-dtype must be one of {', '.join(CPU_MOE_DTYPES)}, got {self.cpu_moe_dtype!r}")
        if self.cpu_moe_act_dtype not in CPU_MOE_ACT_DTYPES:
            raise ValueError(f"--cpu-moe-act-dtype must be one of {', '.join(CPU_MOE_ACT_DTYPES)}, "
                             f"got {self.cpu_moe_act_dtype!r}")
        if self.cpu_moe_handoff not in CPU_MOE_HANDOFFS:
            raise ValueError(f"--cpu-moe-handoff must be one of {', '.join(CPU_MOE_HANDOFFS)}, "
                             f"got {self.cpu_moe_handoff!r}")
        # cpu_experts.INT8_ACT_FORMATS; "auto" is checked once the placement resolves it
        if self.cpu_moe_act_dtype == "int8" and self.cpu_moe_dtype not in ("auto", "int4", "mxfp4"):
            raise ValueError(f"--cpu-moe-act-dtype int8 covers int4 and mxfp4 experts, not --cpu-moe-dtype "
                             f"{self.cpu_moe_dtype}: use --cpu-moe-dtype int4 or mxfp4, or --cpu-moe-act-dtype auto")
        layers = self.gpu_resident_moe_layers
        if isinstance(layers, str) and layers != "auto":
            raise ValueError(f"--gpu-resident-moe-layers must be 'auto' or layer indices, got {layers!r}")
        if isinstance(layers, tuple) and any(i < 0 for i in layers):
            raise ValueError(f"--gpu-resident-moe-layers are layer indices (0 or more), got {layers}")
        if self.cpu_memory is not None and self.cpu_memory <= 0:
            raise ValueError("--cpu-memory must be positive")
        if (self.hot_experts is None) != (self.hot_expert_memory is None):
            raise ValueError("--hot-experts FILE and --hot-expert-memory SIZE go together: the calibration says "
                             "which experts, the size how many")
        if self.hot_expert_memory is not None and self.hot_expert_memory <= 0:
            raise ValueError("--hot-expert-memory must be positive")
        if self.stream_experts not in ("auto", "on", "off"):
            raise ValueError(f"--stream-experts must be auto, on or off, got {self.stream_experts!r}")
        if self.stream_experts_min_tokens is not None and self.stream_experts_min_tokens < 1:
            raise ValueError(f"--stream-experts-min-tokens must be at least 1, got {self.stream_experts_min_tokens}")
        if self.stream_experts_memory is not None and self.stream_experts_memory <= 0:
            raise ValueError("--stream-experts-memory must be positive")

    @property
    def forced(self) -> bool:
        """Whether a flag says which experts go to the CPU (else: only if the model does not fit)."""
        return self.cpu_moe or self.n_cpu_moe is not None

    @staticmethod
    def parse_layers(text: str | None) -> tuple[int, ...] | str | None:
        """--gpu-resident-moe-layers: "auto", "" / "none" (no layer), or "0,1,5"."""
        if text is None:
            return None
        text = text.strip()
        if text == "auto":
            return text
        if text in ("", "none"):
            return ()
        try:
            return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
        except ValueError:
            raise ValueError(f"--gpu-resident-moe-layers must be 'auto', 'none' or comma-separated layer indices "
                             f"such as 0,1; got {text!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    log_stats_interval: float = 10.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # --served-model-name: the names requests may use; the first (the engine's model_name) is the
    # one responses carry. Empty: only the engine's model_name.
    served_model_names: tuple[str, ...] = ()
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # --tool-call-parser (tandem/server/tool_parsers.py)
    enable_auto_tool_choice: bool = False  # `"tool_choice": "auto"` allowed; needs tool_call_parser
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64  # nesting of a request body's JSON, checked when it is parsed
    max_n: int = 16  # --max-n: choices per request
    max_prompts: int = 64  # --max-prompts-per-request: prompts in one /v1/completions request
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: top logprobs one request may ask for
    # Chat templates render and prompts tokenize in worker processes (never on the event loop);
    # a render that runs longer than this is killed and answered with HTTP 400.
    text_workers: int = 2
    render_timeout: float = 10.0
    shutdown_timeout: float = 30.0
    max_header_bytes: int = 64 * 1024  # uvicorn's h11 limit on a request's header block
    uvicorn_log_level: str = "info"  # --uvicorn-log-level (default: --log-level)
