"""The quality cost of `--kv-cache-dtype fp8` on DeepSeek-V4's caches, against the same model with
its cache in the model's dtype (issue 18, part 4). Deterministic math, so any machine gives the
same figures.

A random tiny DeepSeek-V4 (every layer kind: sliding, CSA with its indexer, HCA; built and saved
by `transformers`) serves each prompt twice through Tandem's engine, once per cache dtype: the
prompt is prefilled into the paged cache, then one verify step teacher-forces a fixed continuation
of `--continuation` tokens, so every row's logits read the prompt's keys, entries and index keys
back from the pages (fp8 or not) at the same inputs. Reported per row, over all prompts: the KL
divergence of the fp8 run's next-token distribution from the reference run's, the share of rows
whose argmax agrees, and the largest |logit difference| relative to the logits' spread.

    python benchmarks/bench_kv_fp8.py --dtype bfloat16 --prompts 16 --prompt-len 300 --continuation 32

`--model demo` measures the trained demo model instead (Qwen3-MoE, full-attention caches): its
held-out chats (`--prompts` per task family, thinking on), each prompt in the cache and its
reference answer teacher-forced, which is a real model's distribution rather than a random one's.

    python benchmarks/bench_kv_fp8.py --model demo --dtype bfloat16 --prompts 2 --accuracy-n 5

`--accuracy-n N` (demo) also generates greedily for N held-out chats per family (all but the long
"lookup" family) with each cache and checks the answers with the demo's own checker.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# A tiny V4 whose layers cover every cache kind; ratios 4 and 16 so a 300-token prompt closes 75
# CSA and 18 HCA windows; the sliding window (64) is shorter than the prompt.
CONFIG = {
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 8, "head_dim": 64,
    "partial_rotary_factor": 0.25, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "sliding_window": 64,
}  # fmt: skip


def save_model(out: Path, seed: int) -> None:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**CONFIG)).eval()
    with torch.no_grad():  # std 0.02 gives near-uniform logits; a trained model's are peaked
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_bytes((ROOT / "tandem/assets/builtin_tokenizer.json").read_bytes())


def demo_chats(per_family: int, continuation: int) -> tuple[list[list[int]], list[int]]:
    """The demo's held-out chats: token ids of the prompt and the first `continuation` tokens of
    the reference answer, and each prompt's length."""
    from tandem.demo import text
    from tandem.demo.corpus import EVAL_SEED, FAMILIES, make_example

    tok = text.load_tokenizer(ROOT / "tandem" / "assets" / "demo" / "tokenizer.json")
    seqs, lens = [], []
    for fam in FAMILIES:
        for i in range(per_family):
            ids, mask = text.encode_example(tok, make_example(EVAL_SEED, i, fam))
            start = mask.index(1)  # the first assistant token
            seqs.append(ids[: start + continuation])
            lens.append(start)
    return seqs, lens


def demo_accuracy(dtype: str, kv_cache_dtype: str, per_family: int) -> dict[str, float]:
    """Greedy answers to the demo's held-out chats, checked by its checker: accuracy per family."""
    from tandem import LLM
    from tandem.demo import text
    from tandem.demo.corpus import EVAL_SEED, FAMILIES, make_example
    from tandem.demo.eval import generate_and_check

    demo = ROOT / "tandem" / "assets" / "demo"
    llm = LLM(str(demo), device="cpu", dtype=dtype, kv_cache_memory="2GiB", max_model_len=16384,
              kv_cache_dtype=kv_cache_dtype)
    families = [f for f in FAMILIES if f != "lookup"]  # its 6K-token prompts take long on a CPU
    examples = [make_example(EVAL_SEED, i, fam) for fam in families for i in range(per_family)]
    results = generate_and_check(llm, text.load_tokenizer(demo / "tokenizer.json"), examples, max_tokens=768)
    out = {fam: sum(r["ok"] for r in results if r["family"] == fam) / per_family for fam in families}
    out["overall"] = sum(r["ok"] for r in results) / len(results)
    return out


def teacher_forced_logits(model_dir: Path, dtype: str, kv_cache_dtype: str, seqs: list[list[int]],
                          prompt_lens: list[int]) -> list[torch.Tensor]:
    """Per sequence: logits [continuation + 1, V] of its rows after its prompt, the prompt in the cache."""
    from tandem import LLM
    from tandem.core import Request, SamplingParams
    from tandem.engine.scheduler import ScheduledRequest

    eng = LLM(str(model_dir), device="cpu", dtype=dtype, kv_cache_memory="64MiB", max_num_batched_tokens=4096,
              max_model_len=4096, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False).engine
    out = []
    for i, (seq, prompt_len) in enumerate(zip(seqs, prompt_lens)):
        req = Request(f"r{i}", seq[:prompt_len], SamplingParams(max_tokens=1))
        draft = tuple(seq[prompt_len:])
        assert eng.kv.allocate_slots(req, prompt_len - 1)
        eng.runner.execute([ScheduledRequest.of(req, prompt_len - 1)])  # the prompt but its last token
        req.num_computed_tokens = prompt_len - 1
        assert eng.kv.allocate_slots(req, 1 + len(draft))
        out.append(eng.runner.execute([ScheduledRequest.of(req, 1, draft)]).logits.float().clone())
        eng.kv.free(req)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (the reference cache's too)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--continuation", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("tiny-v4", "demo"), default="tiny-v4")
    ap.add_argument("--accuracy-n", type=int, default=0, help="demo: held-out chats per family to answer and check")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "demo":
            model_dir, (seqs, lens) = ROOT / "tandem" / "assets" / "demo", demo_chats(args.prompts, args.continuation)
        else:
            g = torch.Generator().manual_seed(args.seed)
            total = args.prompt_len + args.continuation
            seqs = [torch.randint(0, CONFIG["vocab_size"], (total,), generator=g).tolist() for _ in range(args.prompts)]
            lens = [args.prompt_len] * len(seqs)
            model_dir = Path(tmp)
            save_model(model_dir, args.seed)
        ref = teacher_forced_logits(model_dir, args.dtype, "auto", seqs, lens)
        fp8 = teacher_forced_logits(model_dir, args.dtype, "fp8", seqs, lens)
        exact = teacher_forced_logits(model_dir, "float32", "auto", seqs, lens)
    report = {"config": {k: v for k, v in vars(args).items()}, "rows": sum(r.shape[0] for r in ref)}
    for name, got, base in (("fp8 cache vs its dtype's cache", fp8, ref),
                            (f"{args.dtype} model+cache vs float32 (scale of the dtype's own rounding)", ref, exact)):
        a, b = torch.cat(base), torch.cat(got)  # [rows, V]
        kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        spread = a.std(dim=-1, keepdim=True)
        report[name] = {
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "max_abs_logit_diff_over_std": ((a - b).abs() / spread).max().item(),
            "mean_abs_logit_diff_over_std": ((a - b).abs() / spread).mean().item(),
        }
    if args.model == "demo" and args.accuracy_n:
        report["accuracy"] = {kv: demo_accuracy(args.dtype, kv, args.accuracy_n) for kv in ("auto", "fp8")}
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
