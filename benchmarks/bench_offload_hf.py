"""The baseline a user has today for a MoE model larger than the GPU: `transformers` with
`accelerate`'s big-model offload (layers that do not fit the GPU budget stay in RAM and are copied
to the GPU for every forward), on the same shape as benchmarks/bench_offload.py.

    python benchmarks/bench_offload_hf.py --gpu-budget 8GiB --new-tokens 6 --out hf_offload.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--gpu-budget", default="8GiB")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = SHAPES[args.shape]
    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")})
    start = time.perf_counter()
    with init_empty_weights():
        model = Qwen3MoeForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16)
    # Left as the OS gives fresh pages (zeros): accelerate copies every offloaded layer's weights to
    # the GPU on each forward whatever their values, and random-filling 57 GB on the CPU takes minutes.
    model = model.to_empty(device="cpu").eval()
    print(f"weights in RAM in {time.perf_counter() - start:.0f} s", flush=True)
    device_map = infer_auto_device_map(model, max_memory={0: args.gpu_budget, "cpu": "120GiB"},
                                       no_split_module_classes=["Qwen3MoeDecoderLayer"], dtype=torch.bfloat16)
    on_gpu = sum(1 for v in device_map.values() if v == 0)
    print(f"device map: {on_gpu} of {len(device_map)} modules on the GPU", flush=True)
    model = dispatch_model(model, device_map=device_map)
    ids = torch.randint(0, cfg["vocab_size"], (1, args.prompt), device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    times = {}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)  # warm-up: first touch of the RAM pages
        for n in (1, args.new_tokens + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t
            print(f"generate {n} tokens: {times[n]:.1f} s", flush=True)
    decode_s = (times[args.new_tokens + 1] - times[1]) / args.new_tokens
    result = {"impl": "transformers+accelerate offload", "shape": args.shape, "gpu_budget": args.gpu_budget,
              "modules_on_gpu": on_gpu, "modules": len(device_map), "batch": 1,
              "decode_s_per_token": decode_s, "decode_tok_s": 1 / decode_s}
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
