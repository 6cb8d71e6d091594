"""GPU decode and prefill throughput on a Qwen3-30B-A3B-shaped model with random bf16 weights.

Measured in one run, on one GPU: the HBM bandwidth (device-to-device copy), the batch-1 roofline
(weight bytes read per decoded token / that bandwidth), `transformers` generate on the same
architecture, and Tandem's decode at several batch sizes and prefill at several lengths.

    python benchmarks/bench_gpu.py --out results.json          # the full 48-layer shape (~61 GB)
    python benchmarks/bench_gpu.py --verify-only --device cpu --shape tiny --kv-gib 0.05 --verify-layers 1,2  # a smoke run

`--verify-cost` adds the cost of a speculative verify step: one target forward of B requests with
q = 1 + K query tokens each (q = 1 is a plain decode), replaying the runner's CUDA graphs;
`--verify-only` measures just that, and `--verify-layers 4,12,24` fits step time = fixed + per-layer
cost over engines of those depths (built one after another) to extrapolate to the shape's full depth:

    python benchmarks/bench_gpu.py --verify-only --verify-layers 4,12,24 --kv-gib 2 --out verify.json
    python benchmarks/bench_gpu.py --verify-only --device cpu --shape tiny --kv-gib 0.05  # CPU smoke (eager)

Random weights make the router spread tokens over experts roughly uniformly; real checkpoints
route less evenly, which changes how many distinct experts a batch reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.builtin import TOKENIZER_ASSET  # noqa: E402
from tandem.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig, SpecConfig  # noqa: E402
from tandem.core import Request, SamplingParams  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.engine.runner import ModelRunner  # noqa: E402
from tandem.engine.scheduler import ScheduledRequest  # noqa: E402
from tandem.models.registry import get_model_class  # noqa: E402

GB = 1e9

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "norm_topk_prob": True, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# The same architecture at test size (the tests' tiny qwen3_moe), for CPU smoke runs of the code paths.
TINY_QWEN3_MOE = dict(
    QWEN3_30B_A3B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=2048,
    max_position_embeddings=4096,
)
# DeepSeek-V4-Flash's routed-expert shape (hidden 4096, 256 experts top-6 of intermediate 2048, 43
# layers) on the Qwen3-MoE architecture: what the CPU experts see, until the V4 model is here.
V4_FLASH_EXPERTS = dict(
    QWEN3_30B_A3B, hidden_size=4096, num_hidden_layers=43, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, vocab_size=129280,
)
# A dense Qwen3 at the demo draft model's shape (tandem/assets/demo/draft): a decode whose every GEMV
# is bound by its launch, as a draft model's steps are.
DEMO_DRAFT = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 192, "num_hidden_layers": 4,
    "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 4672, "max_position_embeddings": 16384, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "v4-flash-experts": V4_FLASH_EXPERTS, "tiny": TINY_QWEN3_MOE,
          "demo-draft": DEMO_DRAFT}


def hbm_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * nbytes / seconds


def decode_bytes_per_token(cfg: dict, context: int) -> dict[str, float]:
    """Bytes a batch-1 decode step must read: the weights it touches and the KV cache it attends."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layers = cfg["num_hidden_layers"]
    attention = layers * (h * hq + 2 * h * hkv + hq * h + 2 * d + 2 * h)
    if cfg.get("num_experts"):
        e, k, i = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
        router, experts = layers * e * h, layers * k * 3 * h * i
    else:  # dense: every layer's feed-forward block ("experts" below)
        router, experts = 0, layers * 3 * h * cfg["intermediate_size"]
    lm_head = cfg["vocab_size"] * h + h
    weights = 2 * (attention + router + experts + lm_head)  # bf16
    kv = 2 * layers * 2 * hkv * context  # K and V, bf16
    return {"attention": 2 * attention, "router": 2 * router, "experts": 2 * experts, "lm_head": 2 * lm_head,
            "weights": weights, "kv_cache": kv, "total": weights + kv}


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norms
        else:
            p.normal_(0.0, 0.02)


def materialize_random(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A meta-device model on `device`, its buffers recomputed and its weights random, in eval mode."""
    model = model.to_empty(device=device)
    for module in model.modules():
        if callable(getattr(module, "reset_buffers", None)):
            module.reset_buffers()
    init_random_(model)
    return model.eval()


def bench_transformers(cfg: dict, prompt_len: int, new_tokens: int) -> dict:
    """`transformers` generate, batch 1, same shape and dtype: decode tok/s excluding the prefill."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")})
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16).eval()
    init_random_(model)
    results = {"experts_implementation": getattr(model.config, "_experts_implementation", None)}
    ids = torch.randint(0, cfg["vocab_size"], (1, prompt_len), device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    times = {}
    for n in (1, new_tokens + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t
    decode_s = times[new_tokens + 1] - times[1]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {**results, "batch": 1, "prompt": prompt_len, "new_tokens": new_tokens,
            "decode_tok_s": new_tokens / decode_s, "prefill_plus_one_token_s": times[1]}


def build_engine(cfg: dict, model_dir: Path, max_num_seqs: int, max_batched: int, kv_gib: float,
                 enforce_eager: bool, fused_ops: bool = True, device: str = "cuda", max_k: int = 0) -> LLMEngine:
    """An engine on random weights: bf16 on CUDA, fp32 on CPU (as the engine's "auto" dtype picks).
    `max_k` > 0 also captures CUDA graphs for query lengths 2 .. max_k + 1 (verify steps)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = get_model_class(cfg["model_type"])(cfg, dtype)
    model = materialize_random(model, device)
    config = EngineConfig(
        model=ModelConfig(str(model_dir), dtype, device, max_model_len=max_batched + 1024),
        cache=CacheConfig(kv_cache_memory=int(kv_gib * (1 << 30)), enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched),
        spec=SpecConfig(max_k=max_k),
        runner=RunnerConfig(enforce_eager=enforce_eager, fused_ops=fused_ops),
    )
    return LLMEngine(config, model=model)


def run_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{seed}-{b}", torch.randint(0, min(150000, engine.vocab_size), (prompt_len,),
                                                           generator=g).tolist(), params)
    graph_before = engine.metrics.model_steps.labels(model_name=engine.model_name, mode="cuda_graph")._value.get()
    first_tokens, t_first, steps = 0, None, 0
    while engine.has_unfinished:
        outs = engine.step()
        steps += 1
        first_tokens += sum(1 for o in outs if o.num_output_tokens == 1)
        if t_first is None and first_tokens == batch:
            sync(engine.device)
            t_first = time.perf_counter()
    sync(engine.device)
    t_end = time.perf_counter()
    graph_steps = engine.metrics.model_steps.labels(model_name=engine.model_name, mode="cuda_graph")._value.get() - graph_before
    decoded = batch * (new_tokens - 1)
    return {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens, "decode_tok_s": decoded / (t_end - t_first),
            "per_request_tok_s": (new_tokens - 1) / (t_end - t_first), "steps": steps, "graph_steps": int(graph_steps)}


def run_prefill(engine: LLMEngine, length: int, seed: int, reps: int = 3) -> dict:
    """The best of `reps` prefills of a random `length`-token prompt (one output token each); the
    first repetition compiles kernels for the shape."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = None
    for rep in range(reps):
        engine.add_request(f"p{seed}-{rep}", torch.randint(0, min(150000, engine.vocab_size), (length,),
                                                           generator=g).tolist(), params)
        sync(engine.device)
        t = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        sync(engine.device)
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return {"length": length, "prefill_tok_s": length / best, "seconds": best}


def bracket(engine: LLMEngine, batches: list[int], prompt: int, new_tokens: int, name: str,
            switch: Callable[[bool], None]) -> list[dict]:
    """Decode with `switch(True)` -> `switch(False)` -> `switch(True)` (same weights, graphs
    recaptured after each switch), labelled `name`; the switch is left on."""
    rows = []
    for phase, enabled in enumerate((True, False, True)):
        switch(enabled)
        engine.runner.graphs.clear()
        engine.runner.capture(engine.config.scheduler.max_num_seqs, {"decode": (1,)}, engine.max_model_len)
        for b in batches:
            run_decode(engine, b, prompt, 8, seed=500 + phase)  # warm-up
            r = run_decode(engine, b, prompt, new_tokens, seed=600 + phase)
            rows.append({name: enabled, "phase": phase, **r})
            print(f"{name}={'on ' if enabled else 'off'} batch {b}: {r['decode_tok_s']:.1f} tok/s", flush=True)
    return rows


def bracket_fused(engine: LLMEngine, batches: list[int], prompt: int, new_tokens: int) -> list[dict]:
    """Decode with the fused small kernels on -> off -> on."""
    from tandem.kernels.fused import set_fused_ops

    rows = bracket(engine, batches, prompt, new_tokens, "fused", set_fused_ops)
    set_fused_ops(engine.runner_config.fused_ops)
    return rows


def bracket_stacked(engine: LLMEngine, batches: list[int], prompt: int, new_tokens: int) -> list[dict]:
    """Decode with the stacked projections (q/k/v as one GEMM, a dense layer's gate/up as one:
    the default) -> separate -> stacked."""
    def switch(on: bool) -> None:
        for layer in engine.model.attention_layers():
            layer.stack_qkv() if on else layer.unstack_qkv()
        for mlp in engine.model.dense_mlps():
            mlp.stack_gate_up() if on else mlp.unstack_gate_up()

    return bracket(engine, batches, prompt, new_tokens, "stacked", switch)


# -- verify-step cost -------------------------------------------------------------------------------
VERIFY_WARMUP = 5  # untimed steps per (batch, q) before timing; graphs were already run at capture


def execute_step(runner: ModelRunner, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, bool]:
    """One forward step: (logits [R, V] float32, whether a CUDA graph ran)."""
    out = runner.execute(batch)
    return out.logits, out.graphed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def model_dir(cfg: dict) -> Iterator[Path]:
    """A temporary checkpoint directory holding only config.json and the tokenizer (weights are random)."""
    path = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    try:
        (path / "config.json").write_text(json.dumps(cfg))
        shutil.copy(TOKENIZER_ASSET, path / "tokenizer.json")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def prefill_requests(engine: LLMEngine, n: int, context: int, max_q: int, seed: int) -> list[Request]:
    """`n` requests with random `context`-token prompts, each prefilled by one eager runner step and
    given its first (greedy) token, with KV slots for `max_q` more: the next step of each is a decode,
    or a verify of up to max_q - 1 draft tokens, at position `context`. The benchmark drives the
    runner alone, so the requests never enter the scheduler; give their blocks back with kv.free."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_q, temperature=0.0, ignore_eos=True)
    reqs = []
    for i in range(n):
        prompt = torch.randint(0, engine.vocab_size, (context,), generator=g).tolist()
        req = engine.new_request(f"verify{seed}-{i}", prompt, params)
        if not engine.kv.allocate_slots(req, context + max_q):
            raise MemoryError(f"the KV cache has no room for {n} requests of {context + max_q} tokens; "
                              f"raise --kv-gib or lower --verify-batches / --prompt")
        logits, _ = execute_step(engine.runner, [ScheduledRequest.of(req, context)])  # [1, V]
        req.num_computed_tokens = context  # what the scheduler records after a step
        req.output_token_ids.append(int(logits[-1].argmax()))
        reqs.append(req)
    return reqs


def verify_batch(reqs: list[Request], drafts: int, g: torch.Generator, vocab: int) -> list[ScheduledRequest]:
    """Each request's next step carrying `drafts` random draft tokens: a query of 1 + drafts tokens
    (its last sampled token, then the draft) that needs 1 + drafts logits rows. Slots must be allocated."""
    return [ScheduledRequest.of(r, 1, draft=tuple(torch.randint(0, vocab, (drafts,), generator=g).tolist()))
            for r in reqs]


def time_steps(runner: ModelRunner, batch: list[ScheduledRequest], iters: int) -> tuple[list[float], bool]:
    """Seconds of each of `iters` runner steps on `batch`, after VERIFY_WARMUP untimed ones. A device
    sync brackets each step, so it counts what the engine's step pays for the forward: packing the
    inputs on the host, copying them into the graph's static buffers, the replay (or eager forward) and
    gathering the logits rows; not sampling or verifying. Also returns whether every step replayed a graph."""
    all_graphed = True
    for _ in range(VERIFY_WARMUP):
        all_graphed &= execute_step(runner, batch)[1]
    times = []
    for _ in range(iters):
        sync(runner.device)
        t = time.perf_counter()
        graphed = execute_step(runner, batch)[1]
        sync(runner.device)
        times.append(time.perf_counter() - t)
        all_graphed &= graphed
    return times, all_graphed


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fill each row's `ratio_to_q1` (step time over the plain decode's, same depth and batch) and
    `delta_ms` (what its last draft token added over q - 1). Rows come in q order per (layers, batch)."""
    decode: dict[tuple[int, int], float] = {}
    prev: dict[tuple[int, int], float] = {}
    for r in rows:
        key = (r["layers"], r["batch"])
        decode.setdefault(key, r["median_ms"])
        r["ratio_to_q1"] = r["median_ms"] / decode[key]
        r["delta_ms"] = r["median_ms"] - prev[key] if key in prev else None
        prev[key] = r["median_ms"]
    return rows


def marginal_costs(rows: list[dict]) -> list[dict]:
    """Per (layers, batch): the ms one draft token adds to a step, (t(q_max) - t(1)) / (q_max - 1), and
    that as a fraction of the plain decode step t(1)."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["layers"], r["batch"]), []).append(r)
    out = []
    for (layers, batch), rs in groups.items():
        first, last = min(rs, key=lambda r: r["q"]), max(rs, key=lambda r: r["q"])
        if last["q"] == first["q"]:
            continue
        ms = (last["median_ms"] - first["median_ms"]) / (last["q"] - first["q"])
        out.append({"layers": layers, "batch": batch, "ms_per_draft_token": ms,
                    "fraction_of_decode_step": ms / first["median_ms"]})
    return out


def bench_verify_cost(engine: LLMEngine, batches: list[int], max_q: int, context: int, iters: int,
                      require_graphs: bool, seed: int = 0) -> list[dict]:
    """Time one target forward step of B requests each carrying q query tokens — q = 1 a plain decode,
    q = 1 + K the verify of K draft tokens — for every B in `batches` and q in 1..max_q, at a context of
    `context` tokens (the requests of `prefill_requests`). With `require_graphs` (CUDA) a step that
    does not replay the runner's (bucket, q) graph raises RuntimeError: an eager fallback would time
    something else. One row per (B, q): median and min ms over `iters` steps, the graph bucket (None
    without graphs), whether the graph ran, the ratio to q = 1 and the ms the last draft token added."""
    runner = engine.runner
    layers = int(engine.model.hf_config["num_hidden_layers"])
    reqs = prefill_requests(engine, max(batches), context, max_q, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = []
    for b in batches:
        bucket = next((x for x in runner.buckets if x >= b), None)  # None: no graphs (CPU)
        for q in range(1, max_q + 1):
            times, graphed = time_steps(runner, verify_batch(reqs[:b], q - 1, g, engine.vocab_size), iters)
            if require_graphs and not graphed:
                raise RuntimeError(
                    f"batch {b}, q {q}: a step ran eagerly instead of replaying a CUDA graph (the engine captured "
                    f"batch buckets {list(runner.buckets)} x query lengths {sorted({k[1] for k in runner.graphs})}); "
                    f"an eager step is not the verify cost this measures: check that the runner still replays "
                    f"uniform decode/verify batches (ModelRunner._graph_key)")
            rows.append({"layers": layers, "batch": b, "bucket": bucket, "q": q, "draft_tokens": q - 1,
                         "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "graphed": graphed})
    for r in reqs:
        engine.kv.free(r)
    return add_ratios(rows)


def extrapolate_layers(rows: list[dict], full_layers: int) -> list[dict]:
    """Fit median_ms = fixed + layers * per_layer for each (B, q) over the measured depths (least
    squares) and evaluate it at `full_layers`. Linear in depth because every decoder layer does the
    same work on random weights, while the embedding, lm_head and host-side packing do not depend on it;
    `max_residual_ms` (three depths or more) says how well the measurements follow that line."""
    points: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        points.setdefault((r["batch"], r["q"]), []).append(r)
    out = []
    for (batch, q), rs in points.items():
        fit = statistics.linear_regression([r["layers"] for r in rs], [r["median_ms"] for r in rs])
        residual = max(abs(r["median_ms"] - fit.intercept - fit.slope * r["layers"]) for r in rs)
        out.append({"layers": full_layers, "batch": batch, "q": q, "draft_tokens": q - 1,
                    "median_ms": fit.intercept + fit.slope * full_layers, "per_layer_ms": fit.slope,
                    "fixed_ms": fit.intercept, "max_residual_ms": residual})
    return add_ratios(out)


def print_verify_table(title: str, rows: list[dict]) -> None:
    """One line per (layers, batch): each q's median ms with its ratio to q = 1, the ms one draft token
    adds (and its share of the decode step), and whether the steps replayed CUDA graphs ("fit": rows
    extrapolated, not run)."""
    groups: dict[tuple[int, int], dict[int, dict]] = {}
    for r in rows:
        groups.setdefault((r["layers"], r["batch"]), {})[r["q"]] = r
    marginal = {(m["layers"], m["batch"]): m for m in marginal_costs(rows)}
    qs = sorted({r["q"] for r in rows})
    print(title)
    print(f"{'layers':>6} {'batch':>5} " + " ".join(f"{f'q={q} ms (x q=1)':>16}" for q in qs)
          + f" {'+ms per draft':>16} {'graph':>5}")
    for (layers, batch), by_q in groups.items():
        cells = " ".join(f"{by_q[q]['median_ms']:>9.3f} ({by_q[q]['ratio_to_q1']:.2f})" for q in qs)
        m = marginal.get((layers, batch))
        extra = f"{m['ms_per_draft_token']:.3f} ({100 * m['fraction_of_decode_step']:.1f}%)" if m else "-"
        graphed = [r.get("graphed") for r in by_q.values()]
        graph = "fit" if None in graphed else "yes" if all(graphed) else "no"
        print(f"{layers:>6} {batch:>5} {cells} {extra:>16} {graph:>5}")
    print(flush=True)


def verify_cost(args: argparse.Namespace, shape: dict) -> dict:
    """The --verify-cost section: an engine (graphs for q = 1..--verify-max-q) per depth in
    --verify-layers, built, measured and freed in turn; with two depths or more, the fit to the
    shape's full depth as well."""
    batches = [int(x) for x in args.verify_batches.split(",")]
    depths = ([int(x) for x in args.verify_layers.split(",")] if args.verify_layers
              else [args.layers or shape["num_hidden_layers"]])
    rows: list[dict] = []
    for layers in depths:
        cfg = dict(shape, num_hidden_layers=layers)
        with model_dir(cfg) as path:
            t = time.perf_counter()
            engine = build_engine(cfg, path, max(batches), max(2048, args.prompt), args.kv_gib, enforce_eager=False,
                                  fused_ops=args.fused_ops, device=args.device, max_k=args.verify_max_q - 1)
            print(f"verify cost: engine of {layers} layers built in {time.perf_counter() - t:.1f} s "
                  f"({len(engine.runner.graphs)} CUDA graphs)", flush=True)
            rows += bench_verify_cost(engine, batches, args.verify_max_q, args.prompt, args.verify_iters,
                                      require_graphs=args.device == "cuda")
            del engine
            free_device_memory()
    eager = "" if args.device == "cuda" else "; CPU: no CUDA graphs, every step ran eagerly (a smoke check only)"
    print_verify_table(f"verify-step cost: median of {args.verify_iters} steps, context {args.prompt}{eager}", rows)
    result = {"shape": args.shape, "context": args.prompt, "iters": args.verify_iters, "warmup": VERIFY_WARMUP,
              "rows": rows, "marginal": marginal_costs(rows)}
    if len(set(depths)) >= 2:
        full = shape["num_hidden_layers"]
        fit = extrapolate_layers(rows, full)
        result["extrapolated"] = {"layers": full, "measured_layers": sorted(set(depths)), "rows": fit,
                                  "marginal": marginal_costs(fit)}
        worst = max(r["max_residual_ms"] for r in fit)
        print_verify_table(f"verify-step cost extrapolated to {full} layers (a linear fit over {sorted(set(depths))} "
                           f"layers; worst residual {worst:.3f} ms)", fit)
    return result


def save(results: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(results, indent=2))


def bench_throughput(args: argparse.Namespace, cfg: dict, results: dict) -> None:
    """HBM bandwidth, roofline, `transformers`, Tandem decode and prefill (and the fused bracket),
    into `results`; the engine is freed on return."""
    bw = hbm_bandwidth()
    need = decode_bytes_per_token(cfg, args.prompt + args.new_tokens // 2)
    results["hbm_bytes_per_s"] = bw
    results["bytes_per_token"] = need
    results["roofline_tok_s"] = bw / need["total"]
    results["roofline_weights_only_tok_s"] = bw / need["weights"]
    print(f"HBM copy bandwidth {bw / 1e12:.2f} TB/s; batch-1 decode reads {need['total'] / GB:.2f} GB/token "
          f"-> roofline {results['roofline_tok_s']:.0f} tok/s", flush=True)

    if not args.skip_hf:
        results["transformers"] = bench_transformers(cfg, args.prompt, args.hf_new_tokens)
        print(f"transformers generate, batch 1: {results['transformers']['decode_tok_s']:.1f} tok/s", flush=True)

    max_batched = max(int(x) for x in args.prefill.split(","))
    batches = [int(x) for x in args.batches.split(",")]
    with model_dir(cfg) as path:
        engine = build_engine(cfg, path, max(batches), max_batched, args.kv_gib, args.enforce_eager, args.fused_ops)
        results["decode"] = []
        for i, b in enumerate(batches):
            run_decode(engine, b, args.prompt, 8, seed=100 + i)  # warm-up
            r = run_decode(engine, b, args.prompt, args.new_tokens, seed=i)
            r["pct_of_roofline"] = 100 * r["per_request_tok_s"] / results["roofline_tok_s"] if b == 1 else None
            results["decode"].append(r)
            print(f"tandem decode batch {b}: {r['decode_tok_s']:.1f} tok/s aggregate ({r['per_request_tok_s']:.1f} "
                  f"per request; {r['graph_steps']}/{r['steps']} steps in CUDA graphs)", flush=True)
        results["prefill"] = []
        for i, n in enumerate(int(x) for x in args.prefill.split(",")):
            r = run_prefill(engine, n, seed=1000 + i)
            results["prefill"].append(r)
            print(f"tandem prefill {n}: {r['prefill_tok_s']:.0f} tok/s", flush=True)
        save(results, args.out)
        if args.compare_fused:
            results["fused_bracket"] = bracket_fused(engine, [b for b in batches if b in (1, max(batches))],
                                                     args.prompt, args.bracket_new_tokens)
        if args.compare_stacked:
            results["stacked_bracket"] = bracket_stacked(engine, [b for b in batches if b in (1, max(batches))],
                                                         args.prompt, args.bracket_new_tokens)
    b1 = results["decode"][0]
    if b1["batch"] == 1:
        print(f"batch-1 decode = {b1['pct_of_roofline']:.1f}% of roofline", flush=True)
    del engine
    free_device_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                    help="model shape; 'tiny' is the tests' tiny qwen3_moe, for CPU smoke runs")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu runs only --verify-only, eagerly: a smoke check of the code path")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length (the context of the verify steps too)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill", default="2048,16384")
    ap.add_argument("--hf-new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=True,
                    help="the fused small kernels (default on, as in the engine); --no-fused-ops measures without")
    ap.add_argument("--kv-gib", type=float, default=16.0)
    ap.add_argument("--compare-fused", action="store_true",
                    help="also bracket the fused small kernels: on -> off -> on, graphs recaptured each time")
    ap.add_argument("--compare-stacked", action="store_true",
                    help="also bracket decode with the stacked projections (q/k/v as one GEMM, a dense layer's "
                         "gate/up as one) -> separate -> stacked (batch 1 and the largest)")
    ap.add_argument("--bracket-new-tokens", type=int, default=128)
    ap.add_argument("--verify-cost", action="store_true",
                    help="also time one forward step of B requests with q = 1..--verify-max-q query tokens each "
                         "(a decode, then verifies of 1.. draft tokens), replaying CUDA graphs")
    ap.add_argument("--verify-only", action="store_true", help="--verify-cost and nothing else")
    ap.add_argument("--verify-batches", default="1,4,8,16")
    ap.add_argument("--verify-max-q", type=int, default=5, help="longest query: 1 + the most draft tokens")
    ap.add_argument("--verify-iters", type=int, default=50, help="timed steps per (batch, q); the median is reported")
    ap.add_argument("--verify-layers", default=None,
                    help="depths to measure, e.g. 4,12,24 (default: --layers); two or more also extrapolate "
                         "linearly to the shape's full depth")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args()
    if args.device == "cpu" and not args.verify_only:
        ap.error("--device cpu runs only the verify-cost smoke check (the rest needs CUDA); add --verify-only")
    if (args.verify_cost or args.verify_only) and args.enforce_eager and args.device == "cuda":
        ap.error("the verify cost is measured on CUDA graph replays; drop --enforce-eager")
    if args.verify_max_q < 1:
        ap.error("--verify-max-q must be at least 1 (a plain decode step)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    shape = SHAPES[args.shape]
    cfg = dict(shape, num_hidden_layers=args.layers or shape["num_hidden_layers"])
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict = {"config": cfg, "device": device_name, "torch": torch.__version__}
    if not args.verify_only:
        bench_throughput(args, cfg, results)
    if args.verify_cost or args.verify_only:
        results["verify_cost"] = verify_cost(args, shape)
    save(results, args.out)

if __name__ == "__main__":
    main()
