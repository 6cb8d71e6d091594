"""The serving DSpark drafter (`tandem/spec/dspark.py`) against the training-side module
(`tandem/demo/dspark.py`), on the shipped demo drafter fed the demo target's real hidden states."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.kv.tensors import LayerCache
from tandem.spec.dspark import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    DSparkConfig,
    DSparkDrafter,
    DSparkFormatError,
)

DEMO_DIR = Path(__file__).resolve().parent.parent / "tandem" / "assets" / "demo"
TOL = {"rtol": 1e-5, "atol": 1e-5}
# Requests of one batch: (chat, anchor t, k). Anchors below W-1 exercise the clamped window; k 0 and
# the full block (7) are included.
BATCH = [(0, 0, 7), (1, 3, 1), (2, 40, 4), (0, 25, 0), (1, 60, 7), (2, 9, 2), (3, 30, 5)]
CHATS = [("arithmetic", 0), ("json", 2), ("tool", 1), ("sort", 5)]


@pytest.fixture(scope="module")
def ref():
    """The training-side target and drafter (fp32) and real hidden states of held-out chats."""
    from tandem.demo import text
    from tandem.demo.corpus import EVAL_SEED, make_example
    from tandem.demo.eval import load_causal_lm, load_dspark

    tk = text.load_tokenizer(DEMO_DIR / "tokenizer.json")
    target, drafter = load_causal_lm(DEMO_DIR), load_dspark(DEMO_DIR / "dspark")
    chats = []
    for family, index in CHATS:
        ids = torch.tensor([text.encode_example(tk, make_example(EVAL_SEED, index, family))[0]])  # [1, L]
        with torch.no_grad():
            _, hidden = target(ids)  # hidden[l]: output of decoder layer l, [1, L, Ht]
        chats.append((ids, hidden))
    return target, drafter, chats


@pytest.fixture(scope="module")
def drafter(ref):
    target = ref[0]
    d = DSparkDrafter.from_dir(DEMO_DIR / "dspark", torch.float32, "cpu")
    d.bind_target({EMBED: target.embed_tokens.weight, FINAL_NORM: target.norm.weight,
                   LM_HEAD: target.lm_head.weight}, target.cfg["rms_norm_eps"])
    return d


def serving_inputs(drafter: DSparkDrafter, chats, batch=BATCH):
    """The engine's side of the contract: fuse the captured layer outputs, take the window ending
    at each anchor t (clamped at 0) and the token at t+1."""
    feats, known = [], []
    for c, t, _ in batch:
        ids, hidden = chats[c]
        fused = drafter.fuse([h[0] for h in hidden])  # [L, F]
        feats.append(fused[drafter.window_positions(torch.tensor([t]))[0]])  # [W, F]
        known.append(ids[0, t + 1])
    return torch.stack(feats), torch.stack(known), [k for _, _, k in batch]


def reference(ref_drafter, target, ids, hidden, t: int, k: int, temperature: float = 0.0, gen=None):
    """The training-side module on one request: its `dspark_inputs`, `block_states`, `base_logits`,
    `markov_bias` and `draft` -> (tokens [k], logits [k, V], confidences [k])."""
    from tandem.demo.train import dspark_inputs

    cfg = ref_drafter.cfg
    feats = torch.cat([hidden[i] for i in cfg["target_layers"]], -1)
    f, known, _ = dspark_inputs(feats, ids, ids, torch.tensor([[0, t]]), cfg["window"], k)
    with torch.no_grad():
        emb = target.embed_tokens(known)
        z = ref_drafter.block_states(f, emb)
        base = ref_drafter.base_logits(z[:, :k], target.lm_head.weight, target.norm).float()
        prev, toks, logits = known, [], []
        for i in range(k):
            logit = base[:, i] + ref_drafter.markov_bias(prev).float()
            logits.append(logit[0])
            if temperature == 0:
                prev = logit.argmax(-1)
            else:
                prev = torch.multinomial(torch.softmax(logit / temperature, -1)[0], 1, generator=gen)
            toks.append(prev[0])
        if temperature == 0 and k:
            dtoks, _ = ref_drafter.draft(f, known, emb, target.lm_head.weight, target.norm, k)
            assert torch.equal(dtoks[0], torch.stack(toks))  # the loop above is `draft`
        conf = ref_drafter.confidence(z[:, :k])[0]
    if not k:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, cfg["vocab_size"]), conf
    return torch.stack(toks), torch.stack(logits), conf


def test_greedy_batch_of_different_k_matches_the_training_side_module(ref, drafter):
    target, ref_drafter, chats = ref
    feats, known, ks = serving_inputs(drafter, chats)
    out = drafter.propose(feats, known, ks)
    kmax = max(ks)
    assert out.tokens.shape == (len(BATCH), kmax) and out.probs.shape == (len(BATCH), kmax, 4672)
    assert out.confidence.shape == (len(BATCH), kmax) and out.k == tuple(ks)
    for i, (c, t, k) in enumerate(BATCH):
        ids, hidden = chats[c]
        toks, logits, conf = reference(ref_drafter, target, ids, hidden, t, k)
        mine_t, mine_q, mine_c = out.request(i)
        assert torch.equal(mine_t, toks), (i, mine_t, toks)
        torch.testing.assert_close(out.logits[i, :k], logits, **TOL)
        torch.testing.assert_close(mine_c, conf, **TOL)
        assert torch.equal(mine_q, torch.nn.functional.one_hot(toks, 4672).float())  # greedy: q is one-hot
        # Padding past a request's k.
        assert (out.tokens[i, k:] == -1).all() and not out.probs[i, k:].any() and not out.confidence[i, k:].any()
    drafted = out.tokens >= 0
    assert ((out.confidence[drafted] > 0) & (out.confidence[drafted] < 1)).all()


def test_sampled_drafts_with_per_request_generators_match_the_training_side_draws(ref, drafter):
    target, ref_drafter, chats = ref
    feats, known, ks = serving_inputs(drafter, chats)
    temps = [0.8, 0.0, 1.0, 0.7, 1.3, 0.0, 0.9]
    gens = [torch.Generator().manual_seed(100 + i) if temp else None for i, temp in enumerate(temps)]
    out = drafter.propose(feats, known, ks, temperature=torch.tensor(temps), generator=gens)
    for i, (c, t, k) in enumerate(BATCH):
        ids, hidden = chats[c]
        gen = torch.Generator().manual_seed(100 + i)
        toks, logits, conf = reference(ref_drafter, target, ids, hidden, t, k, temps[i], gen)
        mine_t, mine_q, mine_c = out.request(i)
        assert torch.equal(mine_t, toks), (i, mine_t, toks)
        torch.testing.assert_close(out.logits[i, :k], logits, **TOL)
        torch.testing.assert_close(mine_c, conf, **TOL)
        want_q = torch.softmax(logits / temps[i], -1) if temps[i] else torch.nn.functional.one_hot(toks, 4672).float()
        torch.testing.assert_close(mine_q, want_q, **TOL)
    # Each draft is one q puts mass on; the sampled rows did sample (not all argmax).
    drafted = out.tokens >= 0
    q_at = out.probs.gather(2, out.tokens.clamp(min=0)[..., None])[..., 0]
    assert (q_at[drafted] > 0).all()
    assert (out.tokens != out.logits.argmax(-1))[drafted].any()


def test_shared_generator_is_repeatable_and_draws_from_q(ref, drafter):
    _, _, chats = ref
    feats, known, ks = serving_inputs(drafter, chats)
    a = drafter.propose(feats, known, ks, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = drafter.propose(feats, known, ks, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs, torch.softmax(a.logits, -1) * (a.tokens >= 0)[..., None], **TOL)
    cold = drafter.propose(feats, known, ks, temperature=1e-4, generator=torch.Generator().manual_seed(7))
    assert torch.equal(cold.tokens, drafter.propose(feats, known, ks).tokens)  # T -> 0 is greedy


def test_drafts_are_prefix_consistent_and_k_zero_is_empty(ref, drafter):
    _, _, chats = ref
    feats, known, _ = serving_inputs(drafter, chats)
    n = feats.shape[0]
    full = drafter.propose(feats, known, [7] * n)
    short = drafter.propose(feats, known, [3] * n)
    assert torch.equal(full.tokens[:, :3], short.tokens)
    torch.testing.assert_close(full.confidence[:, :3], short.confidence, **TOL)
    none = drafter.propose(feats, known, [0] * n, temperature=1.0)
    assert none.tokens.shape == (n, 0) and none.probs.shape == (n, 0, 4672) and none.confidence.shape == (n, 0)
    assert none.request(2)[0].numel() == 0
    with pytest.raises(ValueError, match="0..7 drafts"):
        drafter.propose(feats, known, [8] * n)
    with pytest.raises(ValueError, match=r"feats \[N, 8, 768\]"):
        drafter.propose(feats[:, :4], known, [1] * n)


def test_features_captured_from_tandems_serving_model_give_the_same_drafts(ref, drafter):
    """What the engine will do: hook the serving Qwen3-MoE's decoder layers (each returns
    (mlp_out, residual); the layer's output is their sum), fuse, and draft from that."""
    from tandem.core import StepMetadata
    from tandem.models.loader import load_checkpoint

    target, ref_drafter, chats = ref
    model, _ = load_checkpoint(DEMO_DIR, torch.float32, "cpu", progress=False)
    specs, bs = model.kv_cache_specs(), 16
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda _m, _i, out, l=l: captured.__setitem__(l, out[0] + out[1]))
             for l, layer in enumerate(model.model.layers)]
    ids = chats[2][0][0]  # [L]
    n_blocks = -(-len(ids) // bs)
    model.bind_kv_caches([(LayerCache(0, torch.zeros(2, n_blocks, bs, s.num_kv_heads, s.head_dim)),) for s in specs])
    step = StepMetadata(request_ids=("r",), query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
                        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
                        block_tables=(torch.arange(n_blocks, dtype=torch.int32)[None],),
                        slot_mappings=(torch.arange(len(ids)),), logits_indices=torch.arange(len(ids)),
                        query_start_loc_cpu=(0, len(ids)), seq_lens_cpu=(len(ids),), block_size=bs,
                        max_query_len=len(ids))
    with torch.no_grad():
        model(ids, torch.arange(len(ids)), step)
    for h in hooks:
        h.remove()
    for l in drafter.cfg.target_layers:  # the same hidden states as the training-side target's
        torch.testing.assert_close(captured[l], chats[2][1][l][0], rtol=1e-4, atol=1e-4)

    served = DSparkDrafter.from_dir(DEMO_DIR, torch.float32, "cpu")  # a model directory: its dspark/
    served.check_target(model.args.num_hidden_layers, model.args.hidden_size, model.args.vocab_size)
    served.bind_target(dict(model.named_parameters()), model.args.rms_norm_eps)
    anchors = torch.tensor([2, 17, 33, 50])
    fused = served.fuse(captured)  # [L, F]
    out = served.propose(fused[served.window_positions(anchors)], ids[anchors + 1], [7, 4, 7, 1])
    for i, (t, k) in enumerate(zip(anchors.tolist(), [7, 4, 7, 1])):
        toks, _, conf = reference(ref_drafter, target, chats[2][0], chats[2][1], t, k)
        assert torch.equal(out.request(i)[0], toks)
        torch.testing.assert_close(out.request(i)[2], conf, rtol=1e-4, atol=1e-4)


def test_format_agrees_with_the_training_side_and_the_target():
    from tandem.demo.dspark import tensor_shapes

    raw = json.loads((DEMO_DIR / "dspark" / "config.json").read_text())
    cfg = DSparkConfig.from_file(DEMO_DIR / "dspark" / "config.json")
    assert cfg.tensor_shapes() == tensor_shapes(raw)
    d = DSparkDrafter.from_dir(DEMO_DIR / "dspark", torch.bfloat16, "cpu")
    assert d.fc.weight.dtype == torch.bfloat16 and d.source == DEMO_DIR / "dspark"
    target = json.loads((DEMO_DIR / "config.json").read_text())
    d.check_target(target["num_hidden_layers"], target["hidden_size"], target["vocab_size"])
    with pytest.raises(ValueError, match="layers \\[1, 4, 7\\] but the target has 6 layers"):
        d.check_target(6, 256, 4672)
    with pytest.raises(ValueError, match="size 256.*hidden_size is 512"):
        d.check_target(8, 512, 4672)
    with pytest.raises(RuntimeError, match="bind_target"):
        d.propose(torch.zeros(1, 8, 768, dtype=torch.bfloat16), torch.tensor([1]), [1])
    with pytest.raises(ValueError, match="float32 on cpu but the drafter is torch.bfloat16"):
        d.bind_target({EMBED: torch.zeros(4672, 256), FINAL_NORM: torch.ones(256)}, 1e-6)


def _copy_drafter(tmp_path: Path) -> Path:
    out = tmp_path / "dspark"
    shutil.copytree(DEMO_DIR / "dspark", out)
    return out


def test_a_drafter_for_another_vocab_is_refused_with_both_sizes(tmp_path):
    raw = json.loads((DEMO_DIR / "dspark" / "config.json").read_text())
    raw.update(vocab_size=100, hidden_size=32, num_heads=2, intermediate_size=48, num_layers=1)
    out = tmp_path / "small"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=gen) for k, s in DSparkConfig(**{
        k: raw[k] for k in DSparkConfig.__dataclass_fields__ if k != "target_layers"},
        target_layers=tuple(raw["target_layers"])).tensor_shapes().items()}, str(out / "model.safetensors"))
    d = DSparkDrafter.from_dir(out)
    with pytest.raises(ValueError, match="vocab_size is 100 but the target's is 4672"):
        d.check_target(8, 256, 4672)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight is \[4672, 256\] but the drafter expects \[100, 256\]"):
        d.bind_target({EMBED: torch.zeros(4672, 256), FINAL_NORM: torch.ones(256)}, 1e-6)


def test_a_wrong_format_or_incomplete_weights_are_refused_naming_the_file(tmp_path):
    d = _copy_drafter(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "architecture": "eagle3"}))
    with pytest.raises(DSparkFormatError, match=r"dspark/config.json: architecture is 'eagle3', expected 'tandem_dspark_v1'"):
        DSparkDrafter.from_dir(d)
    (d / "config.json").write_text(json.dumps({**raw, "window": "8"}))
    with pytest.raises(DSparkFormatError, match="config.json: 'window' must be a positive integer"):
        DSparkDrafter.from_dir(d)
    (d / "config.json").write_text(json.dumps({**raw, "target_layers": []}))
    with pytest.raises(DSparkFormatError, match="'target_layers' must be a non-empty list"):
        DSparkDrafter.from_dir(d)
    (d / "config.json").write_text(json.dumps(raw))

    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "conf_head.bias"}, str(d / "model.safetensors"))
    with pytest.raises(DSparkFormatError, match=r"dspark/model.safetensors: .*missing \['conf_head.bias'\]"):
        DSparkDrafter.from_dir(d)
    save_file({**tensors, "slots": torch.zeros(9, 256)}, str(d / "model.safetensors"))
    with pytest.raises(DSparkFormatError, match=r"model.safetensors: slots is torch.float32 \[9, 256\], expected .*\[8, 256\]"):
        DSparkDrafter.from_dir(d)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DSparkFormatError, match="model.safetensors: cannot read it as safetensors"):
        DSparkDrafter.from_dir(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(DSparkFormatError, match="no model.safetensors"):
        DSparkDrafter.from_dir(d)
    with pytest.raises(DSparkFormatError, match="no config.json"):
        DSparkDrafter.from_dir(tmp_path / "nowhere")


def test_serving_drafter_does_not_import_the_demo():
    code = ("import sys, tandem.spec.dspark; "
            "bad = [m for m in sys.modules if m.startswith('tandem.demo')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)
