"""DeepSeek-V4-Flash's real shape with random weights, as many layers as fit, all on one GPU
(issue 18): Tandem's decode tok/s at batch 1 and 8 and its prefill at 8K, against `transformers`
on the same layers in the same run and against the HBM roofline (the bytes a batch-1 decode step
reads: the weights it touches plus its caches, over the measured copy bandwidth).

    python benchmarks/bench_v4.py --layers 4 --out v4.json                 # H200: ~13 GB per layer in bf16
    python benchmarks/bench_v4.py --shape tiny --device cpu --skip-hf      # a CPU smoke run of the code path

Decode runs twice per batch size in the same process, async scheduling off and on (the engine's
`async_scheduling` switched between runs; `--async-scheduling` picks one), each after its own warm-up.

Random weights spread tokens over experts evenly, and hash-routed layers route by token id; a
trained checkpoint reads fewer distinct experts per batch. The first `num_hash_layers` (3) layers
are hash-routed, so fewer layers than that measure only hash routing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import free_device_memory, hbm_bandwidth, materialize_random, model_dir, run_decode, run_prefill, sync  # noqa: E402
from profile_decode import decode_step_times, profile_graph  # noqa: E402

from tandem.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.kv.spec import group_layers  # noqa: E402
from tandem.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402

GB = 1e9


def shape(name: str, layers: int | None) -> dict:
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config().to_dict()  # transformers' defaults are V4-Flash's
    if name == "tiny":
        cfg.update(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
                   q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
                   index_n_heads=4, index_head_dim=32, index_topk=8, sliding_window=16,
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    n = layers or cfg["num_hidden_layers"]
    cfg.update(num_hidden_layers=n, layer_types=cfg["layer_types"][:n], mlp_layer_types=cfg["mlp_layer_types"][:n],
               model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], torch_dtype="bfloat16")
    return cfg


def randomize_routing_(model: torch.nn.Module, seed: int = 0) -> None:
    """Valid hash-routing tables and a zero selection bias (to_empty leaves the buffers undefined)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.args.n_routed_experts if hasattr(model, "args") else model.config.n_routed_experts
                b.copy_(torch.rand(b.shape[0], experts, generator=g).argsort(-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.zero_()


def decode_bytes_per_token(model: DeepseekV4ForCausalLM, context: int) -> dict[str, float]:
    """Bytes one batch-1 decode step reads: every weight but the routed experts and the embedding
    table, top-k of each layer's routed experts, one embedding row, and each layer's caches at
    `context` tokens (the window, the CSA top-k entries plus every index key, every HCA entry)."""
    a, elem = model.args, torch.empty((), dtype=model.dtype).element_size()
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n)
    embed = model.model.embed_tokens.weight.numel()
    other = sum(p.numel() for p in model.parameters()) - routed - embed
    experts = routed * a.num_experts_per_tok / a.n_routed_experts
    kv = 0.0
    for group in group_layers(model.kv_cache_specs()):
        s = group.spec
        if s.kind == "sliding_window":
            per_layer = min(context, s.window) * s.head_dim
        elif s.index_head_dim:  # CSA: the attention reads top-k entries, the indexer every key
            per_layer = min(context // s.ratio, a.index_topk) * s.head_dim + context // s.ratio * s.index_head_dim
        else:
            per_layer = context // s.ratio * s.head_dim
        kv += group.num_layers * per_layer * elem
    weights = (other + experts + a.hidden_size) * elem
    return {"weights_other": other * elem, "routed_experts_topk": experts * elem, "kv_cache": kv,
            "weights": weights, "total": weights + kv}


def bench_transformers(cfg: dict, device: str, prompt: int, new_tokens: int, prefill: int) -> dict:
    """`transformers` on the same shape: batch-1 decode tok/s (generate, prefill subtracted) and
    one prefill forward of `prefill` tokens."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM._from_config(hf_cfg, dtype=dtype)
    model = materialize_random(model, device)
    randomize_routing_(model)
    out = {"experts_implementation": getattr(model.config, "_experts_implementation", None)}
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.randint(0, cfg["vocab_size"], (1, prompt), device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        times = {}
        for n in (1, new_tokens + 1):
            sync(torch.device(device))
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
            sync(torch.device(device))
            times[n] = time.perf_counter() - t
        out.update(batch=1, prompt=prompt, new_tokens=new_tokens, decode_tok_s=new_tokens / (times[new_tokens + 1] - times[1]))
        long = torch.randint(0, cfg["vocab_size"], (1, prefill), device=device)
        best = None
        for _ in range(2):
            sync(torch.device(device))
            t = time.perf_counter()
            model(long, use_cache=False)
            sync(torch.device(device))
            best = min(best or 1e9, time.perf_counter() - t)
        out.update(prefill=prefill, prefill_tok_s=prefill / best)
    del model
    free_device_memory()
    return out


def build_engine(cfg: dict, path: Path, device: str, max_num_seqs: int, max_len: int, kv_gib: float,
                 chunk: int = 2048, prefix_caching: bool = False) -> LLMEngine:
    """Prompts are prefilled in `chunk`-token steps: the paged reference prefill builds dense
    [heads, chunk, window + chunk] logits per layer, 4 GiB at 8K in one step on V4-Flash."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, dtype)
    model = materialize_random(model, device)
    randomize_routing_(model)
    config = EngineConfig(
        model=ModelConfig(str(path), dtype, device, max_model_len=max_len + 1024),
        cache=CacheConfig(kv_cache_memory=int(kv_gib * (1 << 30)), enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=min(chunk, max_len)),
        runner=RunnerConfig(),
    )
    return LLMEngine(config, model=model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("v4-flash", "tiny"), default="v4-flash")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (V4-Flash has 43; ~13 GB each in bf16)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on, as `tandem serve` defaults (V4's compressors then also keep overlap "
                         "snapshots at every step); off by default, as in the earlier entries")
    ap.add_argument("--async-scheduling", choices=("both", "on", "off"), default="both",
                    help="decode with the host's step overlapping the GPU's (on), without (off), or both in turn")
    ap.add_argument("--profile", action="store_true",
                    help="also the batch-1 graph's GPU time against the engine step, and its kernels by GPU time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = shape(args.shape, args.layers)
    results: dict = {"shape": args.shape, "layers": cfg["num_hidden_layers"], "layer_types": cfg["layer_types"]}
    if args.device == "cuda":
        results["hbm_bytes_per_s"] = hbm_bandwidth()
    if not args.skip_hf:
        results["transformers"] = bench_transformers(cfg, args.device, args.prompt, args.new_tokens, args.prefill)
        print(f"transformers: decode {results['transformers']['decode_tok_s']:.2f} tok/s, prefill "
              f"{results['transformers']['prefill_tok_s']:.0f} tok/s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    with model_dir(cfg) as path:
        engine = build_engine(cfg, path, args.device, max(batches), args.prefill, args.kv_gib,
                              prefix_caching=args.prefix_caching)
        results["prefix_caching"] = args.prefix_caching
        need = decode_bytes_per_token(engine.model, args.prompt + args.new_tokens // 2)
        results["bytes_per_token"] = need
        if "hbm_bytes_per_s" in results:
            results["roofline_tok_s"] = results["hbm_bytes_per_s"] / need["total"]
            print(f"HBM {results['hbm_bytes_per_s'] / 1e12:.2f} TB/s; a batch-1 step reads {need['total'] / GB:.3f} GB "
                  f"-> roofline {results['roofline_tok_s']:.0f} tok/s", flush=True)
        results["decode"] = []
        modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.async_scheduling]
        for i, b in enumerate(batches):
            for on in modes:
                engine.async_scheduling = on
                run_decode(engine, b, args.prompt, 4, seed=100 + i)  # warm-up
                r = run_decode(engine, b, args.prompt, args.new_tokens, seed=i) | {"async_scheduling": on}
                if b == 1 and "roofline_tok_s" in results:
                    r["pct_of_roofline"] = 100 * r["per_request_tok_s"] / results["roofline_tok_s"]
                results["decode"].append(r)
                print(f"tandem decode batch {b}, async scheduling {'on' if on else 'off'}: {r['decode_tok_s']:.2f} "
                      f"tok/s ({r['graph_steps']}/{r['steps']} steps in CUDA graphs)", flush=True)
        if args.profile and args.device == "cuda":
            results["profile"] = {}
            for on in modes:
                engine.async_scheduling = on
                results["profile"][f"async_{'on' if on else 'off'}"], table = profile_graph(
                    engine, (1, 1), decode_step_times(engine, args.prompt, 64), rows=40)
            print(json.dumps(results["profile"], indent=2), "\n", table, flush=True)
            results["profile_table"] = table
        if args.device == "cuda":
            results["prefill"] = run_prefill(engine, args.prefill, seed=7)
            print(f"tandem prefill {args.prefill}: {results['prefill']['prefill_tok_s']:.0f} tok/s", flush=True)
        del engine
        free_device_memory()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "layer_types"}, indent=2))


if __name__ == "__main__":
    main()
