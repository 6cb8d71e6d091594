"""Measure the demo models: held-out greedy accuracy per task family, key lookup by length and
depth, and drafter acceptance by draft position and phase (teacher-forced, greedy verification).

    python -m tandem.demo.eval tandem/assets/demo --out results.json

Accuracy runs the target through Tandem's own engine (`tandem.LLM`, greedy), on examples from a
seed the training corpus does not use. Acceptance is measured offline on the target's own greedy
outputs: along such a sequence every next token IS the target's greedy choice, so a draft token at
position i is accepted exactly when it equals the next token and drafts 1..i-1 were accepted —
what greedy verification does, without running the verify loop.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tandem.demo.checker import check, check_tool_call, strip_reasoning
from tandem.demo.corpus import EVAL_SEED, FAMILIES, LOOKUP_LINES_PER_1K_TOKENS, Example, gen_lookup, make_example
from tandem.demo.dspark import DSparkDrafter
from tandem.demo.modeling import CausalLM
from tandem.demo import text


# ---- loading our training-side models from saved checkpoints ------------------------------------


def load_causal_lm(model_dir: str | Path, device: str = "cpu") -> CausalLM:
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    model = CausalLM(cfg)
    own = {}
    for name in model.state_dict():
        key = name if name.startswith("lm_head") else "model." + name
        if ".mlp.w_" in name:
            proj = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[name.rsplit(".", 1)[1]]
            base = key.rsplit(".", 1)[0]
            own[name] = torch.stack([sd[f"{base}.experts.{j}.{proj}.weight"] for j in range(cfg["num_experts"])])
        else:
            own[name] = sd[key]
    model.load_state_dict({k: v.float() for k, v in own.items()})
    return model.to(device).eval()


def load_dspark(model_dir: str | Path, device: str = "cpu") -> DSparkDrafter:
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    drafter = DSparkDrafter(cfg)
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(d / "model.safetensors")).items()})
    return drafter.to(device).eval()


# ---- greedy accuracy through Tandem ----------------------------------------------------------


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False).replace("<|im_end|>", "").replace("<|endoftext|>", "")


def generate_and_check(llm, tok, examples: list[Example], max_tokens: int = 768) -> list[dict[str, Any]]:
    """Greedy answers for `examples` (tool examples get a second turn with the tool result)."""
    from tandem import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    prompts = [tok.encode(text.render_prompt(ex), add_special_tokens=False).ids for ex in examples]
    outs = llm.generate(prompts, sp)
    results = []
    second: list[tuple[int, list[int]]] = []
    for i, (ex, p, o) in enumerate(zip(examples, prompts, outs)):
        gen = list(o.token_ids)  # Completion.token_ids holds the generated tokens only
        r = {"family": ex.family, "prompt_ids": p, "output_ids": gen, "text": _decode(tok, gen),
             "thinking": ex.enable_thinking, "meta": ex.meta}
        if ex.family == "tool":
            r["call_ok"] = check_tool_call(ex, r["text"])
            turn = {"role": "assistant", "content": strip_reasoning(r["text"]).split("<tool_call>")[0].strip()}
            msgs = ex.messages[:2 if ex.messages[0]["role"] != "system" else 3]
            if r["call_ok"]:
                turn["tool_calls"] = [{"type": "function", "function": ex.expected["call"]}]
                reason = r["text"].split("</think>")[0].split("<think>")[-1].strip("\n")
                turn["reasoning_content"] = reason
                tool_msg = next(m for m in ex.messages if m["role"] == "tool")
                msgs2 = msgs + [turn, tool_msg]
                ids2 = tok.encode(text.render(msgs2, ex.tools, add_generation_prompt=True),
                                  add_special_tokens=False).ids
                second.append((i, ids2))
            r["ok"] = False
        else:
            r["ok"] = check(ex, r["text"])
        results.append(r)
    if second:
        outs2 = llm.generate([ids for _, ids in second], sp)
        for (i, ids), o in zip(second, outs2):
            gen = list(o.token_ids)
            results[i]["text2"] = _decode(tok, gen)
            results[i]["ok"] = check(examples[i], results[i]["text2"])
    return results


def lookup_examples(tok, lengths=(1000, 4000, 8000), depths=(0.25, 0.5, 0.75), n: int = 8) -> list[Example]:
    out = []
    for L in lengths:
        for d in depths:
            for j in range(n):
                rng = random.Random(f"lookup-eval:{L}:{d}:{j}")
                ex = gen_lookup(rng, True, n_lines=max(4, round(L / 1000 * LOOKUP_LINES_PER_1K_TOKENS)), depth=d)
                ex.enable_thinking = True
                ex.meta.update(target_tokens=L, target_depth=d)
                out.append(ex)
    return out


@torch.no_grad()
def quick_accuracy(model: CausalLM, tok, examples: list[Example], device: str | torch.device,
                   max_new: int = 400, batch: int = 64) -> dict[str, Any]:
    """Greedy accuracy of a training-side model on `examples`, decoded without a KV cache (every
    step reruns the whole padded batch): a progress check during training that needs no engine.
    Rows are right-padded; under causal attention the padding after a row's last token cannot
    change its logits, so each row decodes exactly as it would alone. Tool examples count the
    first turn only (the call). The reported figures come from `main` (through Tandem)."""
    end = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    ok: dict[str, list[bool]] = {}
    for s in range(0, len(examples), batch):
        exs = examples[s:s + batch]
        rows = [tok.encode(text.render_prompt(ex), add_special_tokens=False).ids for ex in exs]
        n0 = [len(r) for r in rows]
        # One device buffer for the batch: each step writes every row's next token at its own end
        # (rows that already ended keep going; what follows their <|im_end|> is cut below).
        ids = torch.full((len(rows), max(n0) + max_new), pad, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        ids = ids.to(device)
        at = torch.arange(len(rows), device=ids.device)
        ends = torch.tensor(n0, device=ids.device)  # the next free position of each row
        done = torch.zeros(len(rows), dtype=torch.bool, device=ids.device)
        for step in range(max_new):
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
                h = model(ids[:, :max(n0) + step], logits=False)[1][-1]
            nxt = model.head(h[at, ends - 1]).argmax(-1)
            ids[at, ends] = nxt
            ends += 1
            done |= nxt == end
            if bool(done.all()):
                break
        for ex, r, n, e in zip(exs, ids.tolist(), n0, ends.tolist()):
            gen = r[n:e]
            gen = gen[:gen.index(end) + 1] if end in gen else gen
            out = _decode(tok, gen)
            good = check_tool_call(ex, out) if ex.family == "tool" else check(ex, out)
            ok.setdefault(ex.family, []).append(bool(good))
    fam = {f: round(sum(v) / len(v), 4) for f, v in ok.items()}
    allv = [x for v in ok.values() for x in v]
    return {"by_family": fam, "overall": round(sum(allv) / max(1, len(allv)), 4), "n": len(allv)}


# ---- drafter acceptance ----------------------------------------------------------------------


def phases(ids: list[int], think: int, end_think: int, start_reasoning: bool) -> list[str]:
    """Phase of each output token: 'reasoning' inside <think>..</think> (the closing tag included)."""
    state, out = ("reasoning" if start_reasoning else "answer"), []
    for t in ids:
        if t == think:
            state = "reasoning"
        out.append(state)
        if t == end_think:
            state = "answer"
    return out


def _accept_lengths(hits: torch.Tensor) -> torch.Tensor:
    """hits [N, K] bool (draft i equals the next greedy token) -> leading run length [N]."""
    return hits.int().cumprod(1).sum(1)


@torch.no_grad()
def acceptance(target: CausalLM, draft: CausalLM | None, drafter: DSparkDrafter | None,
               seqs: list[tuple[list[int], list[str | None]]], kmax: int = 4, device: str = "cpu") -> dict[str, Any]:
    """seqs: (token ids, phase of each position: 'reasoning' / 'answer' / None outside assistant turns).

    Anchor t: the target just produced token t+1; the drafter proposes tokens t+2 .. t+1+K, and
    draft i is accepted when it equals the target's greedy choice at that position (its argmax
    given the sequence, teacher-forced) and drafts 1..i-1 were accepted. On the target's own
    greedy outputs this is exactly greedy verification. Anchors are the positions whose first
    drafted token lies in an assistant turn; the phase is that token's."""
    stats: dict[str, dict[str, list[torch.Tensor]]] = {"draft": {}, "dspark": {}}
    for ids_l, ph in seqs:
        L = len(ids_l)
        anchors_l = [t for t in range(L - 2) if ph[t + 2] is not None and ph[t + 1] is not None]
        if not anchors_l:
            continue
        ids = torch.tensor([ids_l], device=device)
        anchors = torch.tensor(anchors_l, device=device)
        pos = anchors[:, None] + 2 + torch.arange(kmax, device=device)  # [N, K] positions drafted
        phase = [ph[t + 2] for t in anchors_l]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            t_logits, hidden = target(ids)
            greedy = t_logits[0].float().argmax(-1)  # [L] target's choice of token j+1 at j
            in_turn = torch.tensor([p is not None for p in ph] + [False], device=device)
            want = torch.where((pos < L) & in_turn[pos.clamp(max=L)], greedy[(pos - 1).clamp(max=L - 1)],
                               torch.full_like(pos, -1))
            results = {}
            if draft is not None:
                d_pred = draft(ids)[0][0].float().argmax(-1)  # [L] prediction of token j+1 at j
                results["draft"] = d_pred[(pos - 1).clamp(max=L - 1)]
            if drafter is not None:
                feats = torch.cat([hidden[i] for i in drafter.cfg["target_layers"]], -1)
                from tandem.demo.train import dspark_inputs

                f, known, _ = dspark_inputs(feats, ids, ids, torch.stack([torch.zeros_like(anchors), anchors], 1),
                                            drafter.cfg["window"], kmax)
                toks, _ = drafter.draft(f, known, target.embed_tokens(known), target.lm_head.weight, target.norm, kmax)
                results["dspark"] = toks
        for name, pred in results.items():
            hits = (pred == want) & (want >= 0)
            for p in ("reasoning", "answer"):
                sel = torch.tensor([x == p for x in phase], device=device)
                if sel.any():
                    stats[name].setdefault(p, []).append(hits[sel].cpu())
    report: dict[str, Any] = {}
    for name, by_phase in stats.items():
        if not by_phase:
            continue
        report[name] = {}
        for p, chunks in by_phase.items():
            hits = torch.cat(chunks)  # [N, kmax]
            run = _accept_lengths(hits)
            by_pos = [round(float((run >= i + 1).sum() / max(1, int((run >= i).sum()))), 4) for i in range(kmax)]
            per_k = {f"K={k}": {"mean_accepted": round(float(run.clamp(max=k).float().mean()), 4),
                                "acceptance_rate": round(float(run.clamp(max=k).float().mean() / k), 4)}
                     for k in range(1, kmax + 1)}
            report[name][p] = {"anchors": int(hits.shape[0]), "by_position": by_pos, **per_k}
    return report


def corpus_sequences(tok, examples: list[Example], special: dict[str, int]) -> list[tuple[list[int], list]]:
    """Held-out chats as (ids, phase per position), phases over the assistant turns only."""
    out = []
    for ex in examples:
        ids, mask = text.encode_example(tok, ex)
        ph: list[str | None] = []
        state = "answer"
        for t, m in zip(ids, mask):
            if t == special["<think>"]:
                state = "reasoning"
            ph.append(state if m else None)
            if t == special["</think>"] or t == special["<|im_end|>"]:
                state = "answer"
        out.append((ids, ph))
    return out


def output_sequences(res: list[dict[str, Any]], special: dict[str, int]) -> list[tuple[list[int], list]]:
    """Prompt + the target's greedy output, phases over the output."""
    out = []
    for r in res:
        o = r["output_ids"]
        ph = [None] * len(r["prompt_ids"]) + phases(o, special["<think>"], special["</think>"], r["thinking"])
        out.append((r["prompt_ids"] + o, ph))
    return out


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tandem.demo.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=100, help="held-out examples per family")
    ap.add_argument("--lookup-n", type=int, default=8, help="examples per (length, depth) cell")
    ap.add_argument("--lookup-lengths", default="1000,4000,8000")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--skip-acceptance", action="store_true", help="accuracy only (no drafter measurement)")
    ap.add_argument("--teacher-forced-only", action="store_true",
                    help="skip generation: acceptance on held-out corpus chats, labels = the target's argmax")
    args = ap.parse_args(argv)
    from tandem import LLM

    t0 = time.time()
    d = Path(args.model_dir)
    tok = text.load_tokenizer(d / "tokenizer.json")
    if args.teacher_forced_only:
        special = text.special_ids((d / "tokenizer.json").read_text())
        target = load_causal_lm(d, args.device)
        draft = load_causal_lm(d / "draft", args.device) if (d / "draft").is_dir() else None
        drafter = load_dspark(d / "dspark", args.device) if (d / "dspark").is_dir() else None
        exs = [make_example(EVAL_SEED, i, fam) for fam in args.families.split(",") for i in range(args.n)]
        rep = {"device": args.device, "mode": "teacher-forced on held-out corpus chats",
               "acceptance": acceptance(target, draft, drafter, corpus_sequences(tok, exs, special), device=args.device)}
        rep["seconds"] = round(time.time() - t0, 1)
        Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
        print(json.dumps(rep), flush=True)
        return
    llm = LLM(str(d), device=args.device, kv_cache_memory=args.kv_cache_memory, max_num_seqs=256,
              max_num_batched_tokens=16384)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    families = args.families.split(",")
    examples = [make_example(EVAL_SEED, i, fam) for fam in families for i in range(args.n)]
    res = generate_and_check(llm, tok, examples, max_tokens=args.max_tokens)
    fam_acc = {}
    for fam in families:
        rs = [r for r in res if r["family"] == fam]
        fam_acc[fam] = {"n": len(rs), "accuracy": round(sum(r["ok"] for r in rs) / len(rs), 4)}
    report["accuracy"] = fam_acc
    report["accuracy_overall"] = round(sum(r["ok"] for r in res) / len(res), 4)
    report["accuracy_seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report), flush=True)
    lengths = tuple(int(x) for x in args.lookup_lengths.split(","))
    lk = lookup_examples(tok, lengths=lengths, n=args.lookup_n)
    lres = generate_and_check(llm, tok, lk, max_tokens=64) if lk else []
    grid = {}
    for ex, r in zip(lk, lres):
        key = f"{ex.meta['target_tokens']}@{ex.meta['target_depth']}"
        g = grid.setdefault(key, {"n": 0, "ok": 0, "prompt_tokens": 0})
        g["n"] += 1
        g["ok"] += int(r["ok"])
        g["prompt_tokens"] += len(r["prompt_ids"])
    report["lookup"] = {k: {"accuracy": round(g["ok"] / g["n"], 4), "n": g["n"],
                            "mean_prompt_tokens": g["prompt_tokens"] // g["n"]} for k, g in grid.items()}
    print(json.dumps(report["lookup"]), flush=True)
    del llm
    # Acceptance on the target's own greedy outputs (the first turn of every held-out example).
    special = text.special_ids((d / "tokenizer.json").read_text())
    target = load_causal_lm(d, args.device)
    draft = load_causal_lm(d / "draft", args.device) if (d / "draft").is_dir() else None
    drafter = load_dspark(d / "dspark", args.device) if (d / "dspark").is_dir() else None
    report["acceptance"] = {} if args.skip_acceptance else acceptance(target, draft, drafter, output_sequences(res, special), device=args.device)
    report["seconds"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    # Every held-out answer, with its corpus index (make_example(EVAL_SEED, index, family)).
    samples = [{"index": i % args.n, **{k: r[k] for k in ("family", "ok", "text", "text2") if k in r}}
               for i, r in enumerate(res)]
    Path(args.out).with_suffix(".samples.json").write_text(json.dumps(samples, indent=1) + "\n")
    print(json.dumps(report["acceptance"]), flush=True)


if __name__ == "__main__":
    main()
