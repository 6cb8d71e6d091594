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

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {self.cpu_threads}")

    def resolve(self, device: str, dtype: torch.dtype) -> RunnerConfig:
        fast = device == "cuda" and dtype in (torch.bfloat16, torch.float16)
        attn = self.attention_backend if self.attention_backend != "auto" else ("triton" if device == "cuda" else "torch")
        moe = self.moe_executor if self.moe_executor != "auto" else ("grouped" if fast else "torch")
        threads = self.cpu_threads if self.cpu_threads is not None else max(1, usable_cpus() - 1)
        return RunnerConfig(attn, moe, self.enforce_eager or device != "cuda", self.fused_ops, threads)


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

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 1024
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be positive")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (a later issue). `max_k` already sizes the runner's query shapes."""

    max_k: int = 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    log_stats_interval: float = 10.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64  # nesting of a request body's JSON, checked when it is parsed
    max_n: int = 16  # --max-n: choices per request
    max_prompts: int = 64  # --max-prompts-per-request: prompts in one /v1/completions request
    # Chat templates render and prompts tokenize in worker processes (never on the event loop);
    # a render that runs longer than this is killed and answered with HTTP 400.
    text_workers: int = 2
    render_timeout: float = 10.0
    shutdown_timeout: float = 30.0
    max_header_bytes: int = 64 * 1024  # uvicorn's h11 limit on a request's header block
