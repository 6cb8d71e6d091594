"""GPU decode and prefill throughput on a Qwen3-30B-A3B-shaped model with random bf16 weights.

Measured in one run, on one GPU: the HBM bandwidth (device-to-device copy), the batch-1 roofline
(weight bytes read per decoded token / that bandwidth), `transformers` generate on the same
architecture, and Tandem's decode at several batch sizes and prefill at several lengths.

    python benchmarks/bench_gpu.py --out results.json          # the full 48-layer shape (~61 GB)
    python benchmarks/bench_gpu.py --layers 4 --quick           # a smoke run

Random weights make the router spread tokens over experts roughly uniformly; real checkpoints
route less evenly, which changes how many distinct experts a batch reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.builtin import TOKENIZER_ASSET  # noqa: E402
from tandem.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from tandem.core import SamplingParams  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
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
    layers, e, k, i = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    attention = layers * (h * hq + 2 * h * hkv + hq * h + 2 * d + 2 * h)
    router = layers * e * h
    experts = layers * k * 3 * h * i
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
                 enforce_eager: bool, fused_ops: bool = True) -> LLMEngine:
    with torch.device("meta"):
        model = get_model_class(cfg["model_type"])(cfg, torch.bfloat16)
    model = model.to_empty(device="cuda")
    for module in model.modules():
        if callable(getattr(module, "reset_buffers", None)):
            module.reset_buffers()
    init_random_(model)
    model.eval()
    config = EngineConfig(
        model=ModelConfig(str(model_dir), torch.bfloat16, "cuda", max_model_len=max_batched + 1024),
        cache=CacheConfig(kv_cache_memory=int(kv_gib * (1 << 30)), enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched),
        runner=RunnerConfig(enforce_eager=enforce_eager, fused_ops=fused_ops),
    )
    return LLMEngine(config, model=model)


def run_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{seed}-{b}", torch.randint(0, 150000, (prompt_len,), generator=g).tolist(), params)
    graph_before = engine.metrics.model_steps.labels(model_name=engine.model_name, mode="cuda_graph")._value.get()
    first_tokens, t_first, steps = 0, None, 0
    while engine.has_unfinished:
        outs = engine.step()
        steps += 1
        first_tokens += sum(1 for o in outs if o.num_output_tokens == 1)
        if t_first is None and first_tokens == batch:
            torch.cuda.synchronize()
            t_first = time.perf_counter()
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    graph_steps = engine.metrics.model_steps.labels(model_name=engine.model_name, mode="cuda_graph")._value.get() - graph_before
    decoded = batch * (new_tokens - 1)
    return {"batch": batch, "prompt": prompt_len, "new_tokens": new_tokens, "decode_tok_s": decoded / (t_end - t_first),
            "per_request_tok_s": (new_tokens - 1) / (t_end - t_first), "steps": steps, "graph_steps": int(graph_steps)}


def run_prefill(engine: LLMEngine, length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = None
    for rep in range(3):  # the first repetition compiles kernels for the shape
        engine.add_request(f"p{seed}-{rep}", torch.randint(0, 150000, (length,), generator=g).tolist(), params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return {"length": length, "prefill_tok_s": length / best, "seconds": best}


def bracket_fused(engine: LLMEngine, batches: list[int], prompt: int, new_tokens: int) -> list[dict]:
    """Decode with the fused small kernels on -> off -> on (same weights, graphs recaptured)."""
    from tandem.kernels.fused import set_fused_ops

    rows = []
    for phase, enabled in enumerate((True, False, True)):
        set_fused_ops(enabled)
        engine.runner.graphs.clear()
        engine.runner.capture(engine.config.scheduler.max_num_seqs, (1,), engine.max_model_len)
        for b in batches:
            run_decode(engine, b, prompt, 8, seed=500 + phase)  # warm-up
            r = run_decode(engine, b, prompt, new_tokens, seed=600 + phase)
            rows.append({"fused": enabled, "phase": phase, **r})
            print(f"fused={'on ' if enabled else 'off'} batch {b}: {r['decode_tok_s']:.1f} tok/s", flush=True)
    set_fused_ops(engine.runner_config.fused_ops)
    return rows


def save(results: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=512)
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
    ap.add_argument("--bracket-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    results: dict = {"config": cfg, "device": torch.cuda.get_device_name(), "torch": torch.__version__}

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

    model_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TOKENIZER_ASSET, model_dir / "tokenizer.json")
    max_batched = max(int(x) for x in args.prefill.split(","))
    batches = [int(x) for x in args.batches.split(",")]
    engine = build_engine(cfg, model_dir, max(batches), max_batched, args.kv_gib, args.enforce_eager, args.fused_ops)
    results["decode"] = []
    for i, b in enumerate(batches):
        run_decode(engine, b, args.prompt, 8, seed=100 + i)  # warm-up
        r = run_decode(engine, b, args.prompt, args.new_tokens, seed=i)
        r["pct_of_roofline"] = 100 * r["per_request_tok_s"] / results["roofline_tok_s"] if b == 1 else None
        results["decode"].append(r)
        print(f"tandem decode batch {b}: {r['decode_tok_s']:.1f} tok/s aggregate "
              f"({r['per_request_tok_s']:.1f} per request; {r['graph_steps']}/{r['steps']} steps in CUDA graphs)", flush=True)
    results["prefill"] = []
    for i, n in enumerate(int(x) for x in args.prefill.split(",")):
        r = run_prefill(engine, n, seed=1000 + i)
        results["prefill"].append(r)
        print(f"tandem prefill {n}: {r['prefill_tok_s']:.0f} tok/s", flush=True)
    save(results, args.out)
    if args.compare_fused:
        results["fused_bracket"] = bracket_fused(engine, [b for b in batches if b in (1, max(batches))],
                                                 args.prompt, args.bracket_new_tokens)
    b1 = results["decode"][0]
    if b1["batch"] == 1:
        print(f"batch-1 decode = {b1['pct_of_roofline']:.1f}% of roofline", flush=True)
    save(results, args.out)
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
