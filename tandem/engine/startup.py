"""What the engine decides once, at start-up, before serving: what the architecture can run (the
backends, the speculative config), where the routed experts go, the cache groups and how many
blocks each gets. Each is refused in one line, before memory is touched where it can be."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tandem.attention import get_attention_backend
from tandem.config import DEFAULT_BATCHED_TOKENS, EngineConfig, RunnerConfig, SpecConfig, usable_cpus
from tandem.core import Request, SamplingParams
from tandem.engine.runner import ModelRunner, allocate_kv_caches, prefill_buckets
from tandem.kv.groups import group_blocks
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import CacheGroup, group_layers, page_dtype_of, with_page_dtype
from tandem.models.base import CausalLM
from tandem.models.loader import CheckpointInfo
from tandem.offload.cpu_executor import OffloadedExperts
from tandem.offload.planner import DEFAULT_CPU_KV_MEMORY, gpu_weight_bytes, kv_blocks, kv_capacity, plan_memory

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine

logger = logging.getLogger("tandem")
GiB = 1024**3
CAPTURABLE_ATTENTION = {"triton"}  # backends that read only device tensors (no host syncs)
CAPTURABLE_MOE = {"grouped"}


def fit_to_model(asked: RunnerConfig, resolved: RunnerConfig, model: CausalLM) -> RunnerConfig:
    """The resolved runner config within what the architecture runs (`CausalLM.attention_backends`,
    `.moe_executors`): "auto" falls back to the model's own (logged); an explicit flag outside
    them is refused in one line."""
    changes = {}
    for field, flag, allowed in (("attention_backend", "--attention-backend", model.attention_backends),
                                 ("moe_executor", "--moe-executor", model.moe_executors)):
        value = getattr(resolved, field)
        if allowed is None or value in allowed:
            continue
        name = type(model).__name__
        if getattr(asked, field) != "auto":
            raise ValueError(f"{flag} {value}: {name} runs only {', '.join(allowed)}")
        logger.info("%s %s: %s runs only %s; using %s", flag, value, name, ", ".join(allowed), allowed[0])
        changes[field] = allowed[0]
    return replace(resolved, **changes) if changes else resolved


def check_spec_fits_the_model(model: CausalLM, sc: SpecConfig) -> None:
    """One line, before a drafter is loaded, for what the target's architecture cannot serve: a
    drafter reading the target's hidden states from a model that cannot give them, or more draft
    tokens a step than its compressed caches can roll back (one window of the smallest ratio:
    KVCacheManager.trim)."""
    if sc.method == "dspark" and type(model).forward_with_aux is CausalLM.forward_with_aux:
        raise ValueError(f"speculative method 'dspark' reads the target's hidden states, which "
                         f"{type(model).__name__} cannot give yet; use ngram")
    ratios = [s.ratio for g in group_layers(model.kv_cache_specs()) if (s := g.spec).kind == "compressed"]
    if ratios and sc.num_speculative_tokens > min(ratios):
        raise ValueError(f"num_speculative_tokens {sc.num_speculative_tokens}: this model's ratio-{min(ratios)} "
                         f"compressed cache rolls back at most {min(ratios)} tokens a step; use at most that")


def plan_placement(config: EngineConfig, device: torch.device, info: CheckpointInfo
                   ) -> tuple[OffloadedExperts | None, int]:
    """Plan where the routed experts go (tandem/offload/placement.py) before memory is touched;
    refuse, naming the shortfall and the flag, a placement that fits neither GPU nor RAM.
    Returns the loader's hook for experts in RAM (None when they all stay on the device) and the
    step's token budget the plan is for (`plan_memory`'s chunk_tokens: auto resolved)."""
    cfg, mc = config, config.model
    plan = plan_memory(
        mc.model, mc.dtype, device.type, max_model_len=mc.max_model_len,
        max_num_seqs=cfg.scheduler.max_num_seqs, max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        block_size=cfg.cache.block_size, gpu_memory_utilization=cfg.cache.gpu_memory_utilization,
        kv_cache_dtype=cfg.cache.kv_cache_dtype,
        offload=cfg.offload, spec=cfg.spec, info=info,
    )
    placement = plan.placement
    assert placement is not None, "plan_memory always places the experts"
    if plan.offload_problems:
        raise MemoryError("; ".join(plan.offload_problems))
    _check_weights_fit(config, device, gpu_weight_bytes(plan.weights))
    if placement.num_experts:
        logger.info("Expert placement: %s", placement.reason)
    if not placement.offloaded:
        return None, plan.chunk_tokens
    if placement.lossy:
        logger.warning("--cpu-moe-dtype %s is a LOSSY conversion of the checkpoint's expert weights",
                       placement.cpu_format)
    if cfg.offload.cpu_moe_act_dtype == "int8":
        logger.warning("--cpu-moe-act-dtype int8: the CPU experts quantise their activations to int8 per block of "
                       "32 inputs, a LOSSY approximation (up to max|block| / 254 per element)")
    rows = max(plan.chunk_tokens, cfg.scheduler.max_num_seqs * (1 + cfg.spec.max_k))
    sink = OffloadedExperts(placement, cfg.offload.cpu_moe_threads, staging_rows=rows, offload=cfg.offload)
    return sink, plan.chunk_tokens


def batched_tokens(config: EngineConfig, model: CausalLM, planned: int | None, max_model_len: int) -> int:
    """The step's token budget: --max-num-batched-tokens, else (auto) the expert streamer's
    chunk (its cost model, up to what the memory plan reserved activations for: `planned`, or the
    CPU experts' staging rows for a model built outside the engine), else the default."""
    asked = config.scheduler.max_num_batched_tokens
    if asked is not None:
        return asked
    sink = getattr(model, "cpu_experts", None)
    if sink is None or sink.streamer is None:
        return DEFAULT_BATCHED_TOKENS
    chunk = sink.prefill_chunk(min(planned or sink.staging_rows, max_model_len))
    return DEFAULT_BATCHED_TOKENS if chunk is None else chunk


def _check_weights_fit(config: EngineConfig, device: torch.device, weights_bytes: int) -> None:
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    utilization = config.cache.gpu_memory_utilization
    budget = utilization * total
    if weights_bytes > min(budget, free):
        raise MemoryError(
            f"the weights need {weights_bytes / GiB:.2f} GiB but --gpu-memory-utilization {utilization} of this "
            f"GPU allows {budget / GiB:.2f} GiB ({free / GiB:.2f} GiB free); raise it or use a smaller model"
        )


def cache_groups(model: CausalLM, kv_cache_dtype: str) -> tuple[CacheGroup, ...]:
    """The model's cache groups, their pages in --kv-cache-dtype."""
    groups = group_layers(model.kv_cache_specs())
    page_dtype = page_dtype_of(kv_cache_dtype)
    if page_dtype is not None:
        logger.warning("--kv-cache-dtype %s: KV pages stored in float8 e4m3 with a scale per vector, a LOSSY "
                       "cache (its cost on logits: BENCHMARKS.md)", kv_cache_dtype)
    return with_page_dtype(groups, page_dtype)


def kv_cache_budget(config: EngineConfig, model: CausalLM, device: torch.device, max_model_len: int) -> int:
    """Bytes for the KV cache: --kv-cache-memory, else (CUDA) what a profiled step leaves, else the
    CPU default."""
    if config.cache.kv_cache_memory is not None:
        return config.cache.kv_cache_memory
    if device.type == "cuda":
        return profile_free_gpu_memory(config, model, device, max_model_len)
    return DEFAULT_CPU_KV_MEMORY


def plan_kv_blocks(config: EngineConfig, groups: tuple[CacheGroup, ...], budget: int, max_model_len: int,
                   drafter_bytes_per_block: int = 0) -> int | tuple[int, ...]:
    """Blocks of the KV budget: one count for full-attention groups (a draft model's own cache,
    `drafter_bytes_per_block`, holds as many blocks and shares the budget); per group, sized for
    the tokens of context the budget holds, when a model has other kinds (DeepSeek-V4)."""
    block_size, sched = config.cache.block_size, config.scheduler
    if all(g.spec.kind == "full" for g in groups):
        bytes_per_block = sum(g.bytes_per_block(block_size) for g in groups) + drafter_bytes_per_block
        return kv_blocks(budget, bytes_per_block, max_model_len, block_size, sched.max_num_seqs)
    if drafter_bytes_per_block:
        raise ValueError(f"speculative method {config.spec.method!r} keeps a KV cache of its own, which needs "
                         "a target with full-attention caches only; use ngram with this model")
    step, chunk = 1 + config.spec.max_k, sched.max_num_batched_tokens
    tokens = kv_capacity(groups, budget, block_size, max_model_len, sched.max_num_seqs, step, chunk)
    return group_blocks(groups, block_size, tokens, sched.max_num_seqs, step, chunk)


def profile_free_gpu_memory(config: EngineConfig, model: CausalLM, device: torch.device, max_model_len: int) -> int:
    """Run one forward pass at the largest step size to measure activation memory, then give
    the KV cache what --gpu-memory-utilization leaves."""
    from tandem.engine.scheduler import ScheduledRequest

    tokens = min(config.scheduler.max_num_batched_tokens, max_model_len)
    groups = group_layers(model.kv_cache_specs())
    bs = config.cache.block_size
    scratch_blocks = group_blocks(groups, bs, tokens, 1, batch_tokens=tokens)
    kv = KVCacheManager(groups, scratch_blocks, bs, enable_prefix_caching=False, num_state_slots=1)
    allocate_kv_caches(model, kv, device)
    req = Request("__profile__", [0] * tokens, SamplingParams(max_tokens=1))
    kv.allocate_slots(req, tokens)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ModelRunner(model, kv, device).execute([ScheduledRequest.of(req, tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + scratch cache + activations
    free, total = torch.cuda.mem_get_info(device)
    # Memory outside torch's allocator (CUDA context, other processes) counts against the budget.
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(config.cache.gpu_memory_utilization * total - peak - outside_torch)
    logger.info("Memory profile: peak %.2f GiB (weights + activations of a %d-token step), %.2f GiB outside "
                "torch; %.2f GiB left for the KV cache", peak / GiB, tokens, outside_torch / GiB, max(budget, 0) / GiB)
    # The scratch caches stay bound until the real ones replace them (allocate_kv_caches).
    return max(budget, 0)


def set_cpu_threads(model: CausalLM, device: torch.device, asked: RunnerConfig, rc: RunnerConfig) -> None:
    """torch's CPU threads, process-wide: --cpu-threads, or 1 when the CPU expert kernel's pool
    owns the cores beside a GPU."""
    threads = rc.cpu_threads
    assert threads is not None, "RunnerConfig.resolve() fills cpu_threads"
    why = "--cpu-threads"
    if device.type == "cuda" and asked.cpu_threads is None and hasattr(model, "cpu_experts"):
        # The CPU expert kernel's pool owns the cores; torch's own CPU work here is small, and
        # spinning worker threads would take cores from the experts (on the H200 box kernel
        # calls ran 4-8x slower right after torch's 15 threads had run).
        threads, why = 1, "the CPU expert kernel has the other cores; --cpu-threads to change"
    torch.set_num_threads(threads)  # process-wide: the CPU forward uses these
    logger.info("CPU threads: %d for torch (of %d usable cores; %s)", threads, usable_cpus(), why)


def install_kernels(model: CausalLM, rc: RunnerConfig, device: torch.device, log: bool = True) -> None:
    """Put the configured attention backend and MoE executor into the layers of `model`."""
    from tandem.kernels.fused import set_fused_ops

    set_fused_ops(rc.fused_ops)  # process-wide; read when kernels run (and frozen into graphs)
    for layer in model.attention_layers():
        layer.set_backend(get_attention_backend(rc.attention_backend))
        if hasattr(layer, "stack_qkv"):
            layer.stack_qkv()  # one GEMM for q, k and v
    for mlp in getattr(model, "dense_mlps", list)():
        mlp.stack_gate_up()  # one GEMM for gate and up
    if device.type == "cuda":  # the separate projections' freed blocks: back to the device, not kept cached
        torch.cuda.empty_cache()
    if hasattr(model, "set_attention_backend"):  # a model with attention kernels of its own (DeepSeek-V4)
        model.set_attention_backend(rc.attention_backend)
    if rc.moe_executor != "torch" and hasattr(model, "moe_blocks"):
        from tandem.models.layers.moe import install_moe_executor

        install_moe_executor(model, rc.moe_executor)
    if not log:
        return
    fused = ("on" if device.type == "cuda" else "n/a (CPU runs the torch layers)") if rc.fused_ops else "off"
    logger.info("Kernels: attention %s, MoE %s, fused small ops %s", rc.attention_backend, rc.moe_executor, fused)


def graph_blockers(model: CausalLM, rc: RunnerConfig) -> list[str]:
    """What keeps the model's decode out of CUDA graphs, for the warning (empty: graphs capture)."""
    # Offloaded layers' CPU experts are host nodes (capturable); the GPU executor serves the rest.
    has_moe = any(not b.offloaded for b in getattr(model, "moe_blocks", dict)().values())
    blockers = []
    if rc.attention_backend not in CAPTURABLE_ATTENTION:
        blockers.append(f"attention backend {rc.attention_backend!r}")
    if has_moe and rc.moe_executor not in CAPTURABLE_MOE:
        blockers.append(f"MoE executor {rc.moe_executor!r}")
    sink = getattr(model, "cpu_experts", None)
    hot = {ex.device_executor for ex in (sink.hot_executors.values() if sink is not None else ())}
    if hot - CAPTURABLE_MOE:
        blockers.append(f"the hot experts' executor {sorted(hot - CAPTURABLE_MOE)[0]!r} (--dtype bfloat16 uses "
                        "'grouped')")
    return blockers


def prefill_graph_lens(engine: LLMEngine) -> tuple[int, ...]:
    """The token totals of the prefill graphs to capture: --prefill-graph-max-tokens, at most
    --max-num-batched-tokens and the context (() when off). Each runner leaves them out where its
    model's steps cannot take them (`ModelRunner.capture`)."""
    cap = min(engine.runner_config.prefill_graph_max_tokens, engine.config.scheduler.batched_tokens,
              engine.max_model_len)
    return prefill_buckets(cap) if cap > 0 else ()


def log_ready(engine: LLMEngine, num_blocks: int | tuple[int, ...], block_size: int) -> None:
    """The engine's ready line: model, dtype, weights, the KV cache's tokens and blocks (per group), concurrency."""
    if isinstance(num_blocks, int):
        capacity, blocks = num_blocks * block_size, f"{num_blocks} blocks of {block_size}"
    else:  # per group: the context its pool covers (a sliding window's is bounded: not counted)
        groups = engine.kv.groups
        capacity = min(n * g.spec.tokens_per_block(block_size) for n, g in zip(num_blocks, groups)
                       if g.spec.kind != "sliding_window")
        blocks = ", ".join(f"{g.spec.kind}{'' if g.spec.ratio == 1 else ' 1/' + str(g.spec.ratio)}: {n}"
                           for n, g in zip(num_blocks, groups)) + f" blocks of {block_size}"
    logger.info(
        "Tandem engine ready: model %s, dtype %s, device %s, weights %.2f GiB, KV cache %d tokens "
        "(%s), max model len %d, maximum concurrency at max model len: %.2fx",
        engine.model_name, str(engine.config.model.dtype).removeprefix("torch."), engine.device,
        engine.weights_bytes / GiB, capacity, blocks, engine.max_model_len,
        capacity / engine.max_model_len,
    )
