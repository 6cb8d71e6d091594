"""Train the demo models: the `qwen3_moe` target, the dense `qwen3` draft model, the DSpark drafter.

    python -m tandem.demo.train --out tandem/assets/demo            # the shipped run (one H200)
    python -m tandem.demo.train --out /tmp/demo --tiny --device cpu # a smoke test

Every stage has a wall-clock budget; its learning rate follows warm-up + cosine over the budget's
elapsed fraction, so a stage ends on time on any machine. Loss is taken on assistant tokens only.
The drafters learn the target's greedy choices (its argmax on the corpus, teacher-forced), which is
what greedy verification accepts. Outputs: an HF-format target directory (config.json, sharded
model.safetensors, tokenizer files, generation_config.json), `draft/` (a qwen3 checkpoint sharing
the tokenizer) and `dspark/` (model.safetensors + config.json of the block drafter).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tandem.demo.corpus import TRAIN_SEED, VOCAB_GROUPS, Mix, make_example
from tandem.demo.dspark import DSparkDrafter
from tandem.demo.modeling import CausalLM, hf_config
from tandem.demo import text

TARGET = dict(model_type="qwen3_moe", hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
              moe_intermediate_size=96, intermediate_size=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=text.MAX_POSITIONS, tie_word_embeddings=False)
DRAFT = dict(model_type="qwen3", hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
             num_key_value_heads=1, head_dim=64, intermediate_size=512, rms_norm_eps=1e-6,
             rope_theta=1000000.0, max_position_embeddings=text.MAX_POSITIONS, tie_word_embeddings=True)
DSPARK = dict(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512, block_size=7, window=8,
              markov_rank=32, target_layers=[1, 4, 7])
TINY = dict(hidden_size=64, num_hidden_layers=2, num_experts=4, moe_intermediate_size=32, head_dim=16,
            intermediate_size=64)


# ---- data ------------------------------------------------------------------------------------


def _encode_range(args: tuple[str, int, int, int, Mix]) -> list[tuple[np.ndarray, np.ndarray]]:
    tok_json, seed, start, n, mix = args
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    out = []
    for i in range(start, start + n):
        ids, mask = text.encode_example(tok, make_example(seed, i, mix=mix))
        out.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    return out


def build_data(tok_json: str, seed: int, n: int, workers: int, offset: int = 0,
               mix: Mix | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    chunk = 2000
    jobs = [(tok_json, seed, offset + s, min(chunk, n - s), mix or Mix()) for s in range(0, n, chunk)]
    if workers <= 1:
        return [x for j in jobs for x in _encode_range(j)]
    with mp.get_context("fork").Pool(workers) as pool:
        return [x for part in pool.map(_encode_range, jobs) for x in part]


def make_batches(data: list, max_tokens: int, seed: int) -> list[list[int]]:
    """Index batches of similar length with at most `max_tokens` padded tokens each."""
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(data[i][0]) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(data: list, idx: list[int], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, L], loss mask [B, L] (1 where token t+1 is an assistant token to predict at t)."""
    L = max(len(data[i][0]) for i in idx)
    ids = np.full((len(idx), L), pad, dtype=np.int64)
    mask = np.zeros((len(idx), L), dtype=np.float32)
    for r, i in enumerate(idx):
        a, m = data[i]
        ids[r, : len(a)] = a
        mask[r, : len(a) - 1] = m[1:]
    return torch.from_numpy(ids).to(device, non_blocking=True), torch.from_numpy(mask).to(device, non_blocking=True)


def lr_at(frac: float, peak: float) -> float:
    if frac < 0.03:
        return peak * frac / 0.03
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - 0.03) / 0.97))))


def _batches_forever(batches: list[list[int]]):
    while True:
        yield from batches


def _loop(name: str, params, budget_s: float, peak_lr: float, step_fn, batches, log: list) -> None:
    """Train for `budget_s` seconds. `step_fn(batch) -> (loss, info)`; info values may be tensors:
    they are read (one host sync) only on logged steps, so the GPU is not stalled every step."""
    # No weight decay on norm gains (1-D): decaying the q/k-norm gains caps how sharp attention can
    # get. v1 trained with them decayed; after ~13K steps they had shrunk to 0.7-0.85, and the model
    # could not pick one key out of a list or copy a record it had found.
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.05},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.95), fused=torch.cuda.is_available())
    t0, step, it = time.time(), 0, _batches_forever(batches)
    while True:
        frac = (time.time() - t0) / budget_s
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, peak_lr)
        loss, info = step_fn(next(it))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step == 1:
            vals = {k: round(float(v), 4) for k, v in info.items()}
            rec = {"stage": name, "step": step, "t": round(time.time() - t0, 1), "loss": round(loss.item(), 4), **vals}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    log.append({"stage": name, "steps": step, "seconds": round(time.time() - t0, 1)})
    print(json.dumps(log[-1]), flush=True)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


# ---- stages ----------------------------------------------------------------------------------


def train_target(cfg: dict, data: list, batches: list, pad: int, budget_s: float, device: torch.device,
                 log: list, init: CausalLM | None = None, peak_lr: float = 2e-3) -> CausalLM:
    model = (init or CausalLM(cfg)).to(device)
    model.train()

    def step(idx):
        ids, mask = collate(data, idx, pad, device)
        with _autocast(device):
            logits, _ = model(ids)
        ce = F.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none")
        loss = (ce * mask.flatten()).sum() / mask.sum().clamp(min=1)
        aux = model.aux_loss()
        return loss + 0.01 * aux, {"ce": loss.detach(), "aux": aux.detach()}

    _loop("target", [p for p in model.parameters()], budget_s, peak_lr, step, batches, log)
    return model.eval()


@torch.no_grad()
def _teacher(target: CausalLM, ids: torch.Tensor, device: torch.device, layers: list[int] | None = None):
    with _autocast(device):
        logits, hidden = target(ids)
    feats = torch.cat([hidden[i] for i in layers], -1) if layers else None
    return logits.float(), feats


def train_draft(cfg: dict, target: CausalLM, data: list, batches: list, pad: int, budget_s: float,
                device: torch.device, log: list, init: CausalLM | None = None) -> CausalLM:
    draft = (init or CausalLM(cfg)).to(device)
    draft.train()

    def step(idx):
        ids, mask = collate(data, idx, pad, device)
        t_logits, _ = _teacher(target, ids, device)
        with _autocast(device):
            logits, _ = draft(ids)
        logits = logits.float().flatten(0, 1)
        t_logits = t_logits.flatten(0, 1)
        m = mask.flatten()
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1), log_target=True, reduction="none").sum(-1)
        ce = F.cross_entropy(logits, t_logits.argmax(-1), reduction="none")
        loss = ((0.5 * kl + 0.5 * ce) * m).sum() / m.sum().clamp(min=1)
        agree = ((logits.argmax(-1) == t_logits.argmax(-1)).float() * m).sum() / m.sum().clamp(min=1)
        return loss, {"agree": agree.detach()}

    _loop("draft", list(draft.parameters()), budget_s, 2e-3, step, batches, log)
    return draft.eval()


def dspark_inputs(feats: torch.Tensor, ids: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor,
                  window: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For anchors (b, t): the fused features of positions t-window+1..t [N, W, F], the known token
    ids[b, t+1] [N], and the labels greedy[b, t+1 .. t+block] [N, K] (-1 past the end)."""
    b, t = anchors[:, 0], anchors[:, 1]
    L = ids.shape[1]
    w = (t[:, None] - torch.arange(window - 1, -1, -1, device=ids.device)).clamp(min=0)  # [N, W]
    f = feats[b[:, None], w]
    known = ids[b, (t + 1).clamp(max=L - 1)]
    pos = t[:, None] + 1 + torch.arange(block, device=ids.device)  # [N, K]
    labels = torch.where(pos < L, greedy[b[:, None], pos.clamp(max=L - 1)], torch.full_like(pos, -1))
    return f, known, labels


def train_dspark(cfg: dict, target: CausalLM, data: list, batches: list, pad: int, budget_s: float,
                 device: torch.device, log: list, init: DSparkDrafter | None = None) -> DSparkDrafter:
    drafter = (init or DSparkDrafter(cfg)).to(device)
    drafter.train()
    emb, lm_head, final_norm = target.embed_tokens, target.lm_head.weight.detach(), target.norm
    K = cfg["block_size"]

    def step(idx):
        ids, mask = collate(data, idx, pad, device)
        t_logits, feats = _teacher(target, ids, device, cfg["target_layers"])
        greedy = t_logits.argmax(-1)  # [B, L] target's choice for token t+1
        # Anchors: positions t whose known token ids[t+1] and first draft label are assistant tokens.
        cand = (mask[:, :-1] > 0) & (mask[:, 1:] > 0)
        anchors = cand.nonzero()
        if anchors.shape[0] > 4096:
            anchors = anchors[torch.randperm(anchors.shape[0], device=device)[:4096]]
        f, known, labels = dspark_inputs(feats, ids, greedy, anchors, cfg["window"], K)
        valid = (labels >= 0) & (mask[anchors[:, :1], (anchors[:, 1:] + 1 + torch.arange(K, device=device)).clamp(
            max=ids.shape[1] - 1)] > 0)
        with _autocast(device):
            z = drafter.block_states(f, emb(known).detach())
            base = drafter.base_logits(z, lm_head, final_norm)
            prev = torch.cat([known[:, None], labels[:, :-1].clamp(min=0)], 1)  # teacher-forced Markov input
            logits = (base.float() + drafter.markov_bias(prev).float())
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view_as(labels)
        wpos = 0.8 ** torch.arange(K, device=device, dtype=torch.float32)  # early positions matter most
        vm = valid.float()
        loss = (ce * vm * wpos).sum() / (vm * wpos).sum().clamp(min=1)
        hit = (logits.argmax(-1) == labels).float()
        conf = drafter.confidence(z)
        bce = (F.binary_cross_entropy(conf.clamp(1e-5, 1 - 1e-5), hit, reduction="none") * vm).sum() / vm.sum().clamp(min=1)
        acc1 = (hit[:, 0] * vm[:, 0]).sum() / vm[:, 0].sum().clamp(min=1)
        return loss + 0.1 * bce, {"acc_pos1": acc1.detach(), "bce": bce.detach()}

    for p in target.parameters():
        p.requires_grad_(False)
    _loop("dspark", list(drafter.parameters()), budget_s, 1.5e-3, step, batches, log)
    return drafter.eval()


# ---- token groups --------------------------------------------------------------------------


def group_token_ids(tok_json: str, group: str) -> list[int]:
    """Ids of the words of a `VOCAB_GROUPS` group that are one token each (as written after a quote
    or at a line start, the way the corpus writes them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    ids = [tok.encode(w, add_special_tokens=False).ids for w in VOCAB_GROUPS[group]]
    return sorted({i[0] for i in ids if len(i) == 1})


def _mean_cos(rows: torch.Tensor) -> float:
    x = F.normalize(rows.float(), dim=-1)
    n = x.shape[0]
    return round(float(((x @ x.T).sum() - n) / max(1, n * n - n)), 3)


def token_group_cosines(model: CausalLM, tok_json: str) -> dict[str, dict[str, float]]:
    """Mean pairwise cosine of each word group's input-embedding rows and output (lm_head) rows.
    Near 1 means the model can no longer tell the group's words apart: the demo model v2's 26 names
    had collapsed to 0.84 (embedding) / 0.93 (lm_head), and it wrote a wrong name in nearly every
    JSON record even when copying a line it had just written; its cities, which tool calls taught
    it to copy early, stayed at 0.34 / 0.49."""
    out = {}
    for group in VOCAB_GROUPS:
        ids = group_token_ids(tok_json, group)
        if len(ids) < 2:
            continue
        rows = {"embed": model.embed_tokens.weight[ids]}
        if model.lm_head is not None:
            rows["head"] = model.lm_head.weight[ids]
        out[group] = {k: _mean_cos(v.detach()) for k, v in rows.items()}
    return out


@torch.no_grad()
def reinit_token_rows(model: CausalLM, ids: list[int], seed: int = 0) -> None:
    """Give rows `ids` of the input embedding and of lm_head a fresh random offset each around the
    rows' mean, as long as a typical row, each row keeping its norm: the shared direction (what the
    network has learned about the group) stays, and the rows are distinct again (mean pairwise
    cosine about 0.5 from 0.84-0.93), so attention can match and copy them one by one. Rows a model
    never learned to tell apart get almost the same gradient (along the hidden state that predicts
    "some name here"), and weight decay erodes what distinguished them at initialisation, so they
    do not recover on their own (the demo's names stayed collapsed through three runs)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor(ids, dtype=torch.long)
    mats = [model.embed_tokens.weight] + ([model.lm_head.weight] if model.lm_head is not None else [])
    for w in mats:
        rows = w[idx].float()
        mean = rows.mean(0, keepdim=True)
        norms = rows.norm(dim=-1, keepdim=True)
        noise = torch.randn(rows.shape, generator=g)
        new = mean + noise * norms.mean() / noise.norm(dim=-1, keepdim=True)
        w[idx] = (new * norms / new.norm(dim=-1, keepdim=True)).to(w.dtype)  # each row keeps its norm


# ---- saving ----------------------------------------------------------------------------------


def save_hf(model: CausalLM, out: Path, tok_json: str, shard_bytes: int = 14 * 2**20) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    special = text.special_ids(tok_json)
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, special), indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok_json)
    (out / "tokenizer_config.json").write_text(json.dumps(text.tokenizer_config(tok_json), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": special["<|endoftext|>"], "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "pad_token_id": special["<|endoftext|>"], "do_sample": False}, indent=2) + "\n")
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    sd = model.hf_state_dict()
    shards, cur, size = [], {}, 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += n
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def save_dspark(drafter: DSparkDrafter, out: Path, special: dict[str, int]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architecture": "tandem_dspark_v1", **drafter.cfg, "torch_dtype": "bfloat16",
           "shares_target": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tandem.demo.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n-train", type=int, default=400_000, help="corpus examples (seed TRAIN_SEED)")
    ap.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    ap.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per step")
    ap.add_argument("--target-s", type=float, default=270)
    ap.add_argument("--draft-s", type=float, default=50)
    ap.add_argument("--dspark-s", type=float, default=60)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, for a CPU smoke test")
    ap.add_argument("--tokenizer", help="an existing tokenizer.json (default: train one)")
    ap.add_argument("--init", help="continue training the target saved in this directory (weights only; "
                                   "fresh optimizer with warm-up), e.g. to train over several device calls")
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--quick-eval", type=int, default=16, metavar="N",
                    help="after the target stage, greedy accuracy on N held-out examples per family "
                         "(training-side model, no engine; 0 = skip)")
    ap.add_argument("--mix", default=None, metavar="FAMILY=W,...",
                    help="override family weights of the corpus (default: tandem.demo.corpus.WEIGHTS)")
    ap.add_argument("--lookup-long", type=float, default=None, metavar="SHARE",
                    help="share of lookup examples with long haystacks (default: corpus.LOOKUP_LONG_SHARE)")
    ap.add_argument("--data-offset", type=int, default=0, help="first corpus index (continue on fresh data)")
    ap.add_argument("--init-drafters", action="store_true",
                    help="with --init: continue the draft model and DSpark drafter saved there (draft/, dspark/) "
                         "instead of training them from scratch")
    ap.add_argument("--reinit-tokens", default=None, metavar="GROUP,...",
                    help="with --init: give these word groups' token rows fresh distinct values around their mean "
                         f"before training (groups: {', '.join(VOCAB_GROUPS)}); see token_group_cosines")
    args = ap.parse_args(argv)
    if args.target_s <= 0 and not args.init:
        ap.error("--target-s 0 needs --init (the target the drafters learn from)")
    if args.init_drafters:
        if not args.init:
            ap.error("--init-drafters needs --init (the directory whose draft/ and dspark/ to continue)")
        files = [Path(args.init) / sub / f for sub in ("draft", "dspark") for f in ("config.json", "model.safetensors")]
        if missing := [str(f) for f in files if not f.is_file()]:
            ap.error(f"--init-drafters: {args.init} has no trained drafters (missing {', '.join(missing)})")
    groups = [g.strip() for g in (args.reinit_tokens or "").split(",") if g.strip()]
    if groups and not args.init:
        ap.error("--reinit-tokens needs --init (a trained target whose rows have collapsed)")
    if unknown := [g for g in groups if g not in VOCAB_GROUPS]:
        ap.error(f"--reinit-tokens: unknown group(s) {', '.join(unknown)}; groups: {', '.join(VOCAB_GROUPS)}")
    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log: list[dict[str, Any]] = []
    t0 = time.time()
    if args.tokenizer is None and args.init:
        args.tokenizer = str(Path(args.init) / "tokenizer.json")  # continue with the init's own ids
    tok_json = Path(args.tokenizer).read_text() if args.tokenizer else text.train_tokenizer()
    special = text.special_ids(tok_json)
    vocab = -(-(max(special.values()) + 1) // 64) * 64
    try:
        mix = Mix.parse(args.mix, args.lookup_long)
    except ValueError as e:
        ap.error(str(e))
    data = build_data(tok_json, TRAIN_SEED, args.n_train, args.workers, args.data_offset, mix)
    n_tok = int(sum(len(a) for a, _ in data))
    n_loss = int(sum(int(m.sum()) for _, m in data))
    log.append({"stage": "data", "mix": dict(mix.weights), "lookup_long_share": mix.lookup_long_share,
                "offset": args.data_offset, "examples": len(data), "tokens": n_tok, "loss_tokens": n_loss,
                "seconds": round(time.time() - t0, 1)})
    print(json.dumps(log[-1]), flush=True)
    batches = make_batches(data, args.batch_tokens, 0)
    pad = special["<|endoftext|>"]
    tcfg, dcfg, scfg = dict(TARGET, vocab_size=vocab), dict(DRAFT, vocab_size=vocab), dict(DSPARK)
    if args.tiny:
        tcfg.update(TINY)
        dcfg.update(TINY, model_type="qwen3", num_hidden_layers=1)
        scfg.update(hidden_size=64, num_layers=1, intermediate_size=64, target_layers=[0, 1])
    scfg.update(vocab_size=vocab, target_hidden_size=tcfg["hidden_size"])

    init = None
    if args.init:
        from tandem.demo.eval import load_causal_lm

        init = load_causal_lm(args.init)
        tcfg = {k: init.cfg[k] for k in tcfg}
        rec: dict[str, Any] = {"stage": "init", "from": args.init, "token_groups": token_group_cosines(init, tok_json)}
        if groups:
            ids = [i for g in groups for i in group_token_ids(tok_json, g)]
            reinit_token_rows(init, ids)
            rec.update(reinit=groups, reinit_rows=len(ids), token_groups_after=token_group_cosines(init, tok_json))
        log.append(rec)
        print(json.dumps(rec), flush=True)
    init_draft = init_dspark = None
    if args.init_drafters:
        from tandem.demo.eval import load_causal_lm, load_dspark

        init_draft, init_dspark = load_causal_lm(Path(args.init) / "draft"), load_dspark(Path(args.init) / "dspark")
        log.append({"stage": "init_drafters", "from": args.init})

    def write_log() -> None:
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")

    models: dict[str, torch.nn.Module] = {}
    if args.target_s > 0:
        target = train_target(tcfg, data, batches, pad, args.target_s, device, log, init, args.target_lr)
        save_hf(target, out, tok_json)
    else:  # drafters only, against the given target (--init is required then, checked above)
        target = init.to(device).eval()
        save_hf(target, out, tok_json)
    models["target"] = target
    if args.target_s > 0:
        log.append({"stage": "token_groups", **token_group_cosines(target, tok_json)})
        print(json.dumps(log[-1]), flush=True)
    if args.quick_eval > 0:
        log.append({"stage": "quick_eval", **quick_eval(target, tok_json, args.quick_eval, device)})
        print(json.dumps(log[-1]), flush=True)
    write_log()
    if args.draft_s > 0:
        models["draft"] = train_draft(dcfg, target, data, batches, pad, args.draft_s, device, log, init_draft)
        save_hf(models["draft"], out / "draft", tok_json)
        write_log()
    if args.dspark_s > 0:
        models["dspark"] = train_dspark(scfg, target, data, batches, pad, args.dspark_s, device, log, init_dspark)
        save_dspark(models["dspark"], out / "dspark", special)
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    log.append({"stage": "done", "params": n_params, "seconds": round(time.time() - t0, 1),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"})
    print(json.dumps(log[-1]), flush=True)
    write_log()


def quick_eval(target: CausalLM, tok_json: str, n: int, device: torch.device) -> dict[str, Any]:
    """Greedy accuracy on `n` held-out examples of each family (lookup: short haystacks only)."""
    from tokenizers import Tokenizer

    from tandem.demo.corpus import EVAL_SEED, FAMILIES
    from tandem.demo.eval import quick_accuracy

    t0 = time.time()
    exs = [make_example(EVAL_SEED, i, fam) for fam in FAMILIES for i in range(n)]
    exs = [ex for ex in exs if ex.family != "lookup" or ex.meta["n_lines"] <= 120]
    rep = quick_accuracy(target, Tokenizer.from_str(tok_json), exs, device)
    return {**rep, "seconds": round(time.time() - t0, 1)}


if __name__ == "__main__":
    main()
