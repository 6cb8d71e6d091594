"""DeepSeek-V4 (tandem/models/deepseek_v4*.py) against transformers' DeepseekV4ForCausalLM on tiny
random configs, fp32 on CPU: the cache-free full-sequence forward.

transformers accepts any compression ratio, so the "all kinds" and "hash" cases shrink HCA's 128 to
8 / 16 to cross several HCA boundaries in a short prompt; the "real ratios" case keeps 4 and 128
(and the real 128-token window) with a prompt that crosses 128."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")
from transformers import DeepseekV4Config
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from tandem.models.deepseek_v4 import (
    DeepseekV4Args,
    DeepseekV4ForCausalLM,
    hf_state_dict_to_tandem,
)
from tandem.models.deepseek_v4_attention import CSA, HCA, SLIDING

TOL = 1e-4
VOCAB = 160

BASE = {
    "vocab_size": VOCAB, "hidden_size": 48, "moe_intermediate_size": 24, "num_attention_heads": 4, "head_dim": 16,
    "partial_rotary_factor": 0.5, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 12, "n_routed_experts": 6,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "index_n_heads": 8, "index_head_dim": 12, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "routed_scaling_factor": 1.5, "swiglu_limit": 0.5, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip

# name -> (config overrides, prompt length)
CASES = {
    "all_kinds": (
        {"num_hidden_layers": 4, "layer_types": [SLIDING, CSA, HCA, CSA], "compress_rates": {CSA: 4, HCA: 8},
         "mlp_layer_types": ["moe"] * 4, "sliding_window": 6, "index_topk": 3,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        37,
    ),
    "hash": (
        {"num_hidden_layers": 3, "layer_types": [HCA, SLIDING, CSA], "compress_rates": {CSA: 4, HCA: 16},
         "mlp_layer_types": ["hash_moe", "hash_moe", "moe"], "sliding_window": 10, "index_topk": 2},
        41,
    ),
    "real_ratios": (
        {"num_hidden_layers": 3, "layer_types": [CSA, HCA, SLIDING], "compress_rates": {CSA: 4, HCA: 128},
         "mlp_layer_types": ["hash_moe", "moe", "moe"], "sliding_window": 128, "index_topk": 8},
        133,
    ),
}  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Wide random weights (std 0.02 gives near-uniform logits, where argmax ties mean nothing),
    norm weights near 1, and random values for the buffers that matter: distinct hash experts per
    token, a non-zero selection bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "embed" in name or "lm_head" in name else 0.1))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # sinks, position_bias, mHC base and scale
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = torch.rand(b.shape[0], BASE["n_routed_experts"], generator=g).argsort(dim=-1)
                b.copy_(experts[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _models(case: str) -> tuple[HFDeepseekV4, DeepseekV4ForCausalLM, int]:
    overrides, length = CASES[case]
    torch.manual_seed(0)
    hf = HFDeepseekV4(DeepseekV4Config(**BASE, **overrides)).eval()
    _randomize(hf, seed=len(case))
    ours = DeepseekV4ForCausalLM(hf.config.to_dict(), torch.float32).eval()
    ours.load_state_dict(hf_state_dict_to_tandem(hf.state_dict()), strict=True)
    return hf, ours, length


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, HFDeepseekV4, DeepseekV4ForCausalLM, int]:
    return (request.param, *_models(request.param))


@torch.no_grad()
def test_full_forward_matches_transformers(case) -> None:
    _name, hf, ours, length = case
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))  # batch 2
    ref = hf(ids, use_cache=False).logits
    got = ours.forward_full(ids)
    assert ref.std() > 0.5, "near-uniform logits: widen the random init"
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
    assert torch.equal(got[:, -1].argmax(-1), ref[:, -1].argmax(-1))
    # Every prefix length too (the compressor's trailing partial window changes with it).
    for t in (1, 3, 4, 5, length - 1):
        torch.testing.assert_close(ours.forward_full(ids[:, :t]), hf(ids[:, :t], use_cache=False).logits,
                                   rtol=TOL, atol=TOL)


@torch.no_grad()
def test_indexer_keeps_only_topk() -> None:
    """The CSA layers' selection is a real restriction in the test configs: late queries see
    exactly index_topk of their closed entries, early ones all of theirs."""
    _, ours, length = _models("all_kinds")
    attn = ours.model.layers[1].self_attn
    indexer = attn.compressor.indexer
    hidden = torch.randn(1, length, BASE["hidden_size"], generator=torch.Generator().manual_seed(2))
    positions = torch.arange(length)
    visible = indexer.select(hidden, attn.q_a_norm(attn.q_a_proj(hidden)), positions, ours.model.rotary_emb["compress"])
    closed = (positions + 1) // indexer.ratio  # [T]
    assert torch.equal(visible[0].sum(-1), closed.clamp(max=indexer.topk))
    assert (closed > indexer.topk).any()


def test_args_from_saved_and_native_config(tmp_path) -> None:
    """config.json as save_pretrained writes it, and the native spelling (compress_ratios,
    num_hash_layers, qk_rope_head_dim, compress_rope_theta + rope_scaling), read the same."""
    hf, ours, _ = _models("all_kinds")
    hf.config.save_pretrained(tmp_path)
    saved = DeepseekV4Args.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert saved == ours.args
    native = {k: v for k, v in BASE.items() if k != "partial_rotary_factor"}
    native.update(
        num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, qk_rope_head_dim=8,
        sliding_window=6, index_topk=3, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    args = DeepseekV4Args.from_hf(native)
    via_hf = DeepseekV4Args.from_hf(DeepseekV4Config(**native).to_dict())
    assert args == via_hf
    assert args.layer_types == (SLIDING, CSA, HCA, CSA) and args.mlp_layer_types == ("hash_moe",) + ("moe",) * 3
    assert args.rope_dim == 8 and args.compress_rope.rope_type == "yarn" and args.compress_rope.attention_factor == 1.0


def test_refuses_unsupported_configs() -> None:
    cfg = DeepseekV4Config(**BASE, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"]).to_dict()
    for bad, msg in (({"num_key_value_heads": 2}, "one shared K=V head"), ({"scoring_func": "softmax"}, "scoring_func"),
                     ({"partial_rotary_factor": 2.0}, "rotary dim"), ({"layer_types": ["full_attention"]}, "layer_types")):
        with pytest.raises(ValueError, match=msg):
            DeepseekV4ForCausalLM({**cfg, **bad}, torch.float32)


def _tiny_checkpoint(tmp_path: Path) -> Path:
    cfg = DeepseekV4Config(**BASE, **CASES["all_kinds"][0])
    HFDeepseekV4(cfg).save_pretrained(tmp_path)
    from tiny_models import TOKENIZER_JSON

    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    return tmp_path


def test_cache_groups_of_every_layer_kind() -> None:
    from tandem.kv.spec import group_layers

    cfg = DeepseekV4Config(**BASE, **CASES["all_kinds"][0]).to_dict()
    groups = group_layers(DeepseekV4ForCausalLM(cfg, torch.float32).kv_cache_specs())
    kinds = {(g.spec.kind, g.spec.ratio): g.layer_indices for g in groups}
    assert kinds == {("sliding_window", 1): (0, 1, 2, 3), ("compressed", 4): (1, 3), ("compressed", 8): (2,)}
    csa = next(g.spec for g in groups if g.spec.ratio == 4)
    assert csa.overlap and csa.index_head_dim == BASE["index_head_dim"]
    assert all(g.spec.k_is_v and g.spec.window == 6 for g in groups if g.spec.kind == "sliding_window")


def test_plan_of_deepseek_v4_flash_from_its_config(tmp_path) -> None:
    """The real shape (transformers' defaults are V4-Flash's): the expert placement for a 32 GiB GPU
    with every routed expert in RAM as MXFP4, and the 1M-token cache (issue 18's goal: <= 10 GiB
    in fp8; bf16 here)."""
    from tandem.config import OffloadConfig
    from tandem.offload.planner import GiB, plan_memory

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DeepseekV4Config().to_dict()))
    plan = plan_memory(cfg, torch.bfloat16, "cuda", device_bytes=32 * GiB, max_model_len=1 << 20, max_num_seqs=1,
                       offload=OffloadConfig(cpu_moe=True, cpu_moe_dtype="mxfp4", cpu_memory=256 * GiB))
    assert plan.fits, plan.problems
    assert plan.chunk_tokens == 8192  # auto: 16K chunks' activations would not leave room for 1M tokens of cache
    assert 130 * GiB < plan.weights["routed experts in RAM (mxfp4)"] < 140 * GiB  # 43 x 256 x 13.4 MB
    assert plan.placement.cpu_layers == tuple(range(43)) and plan.placement.gpu_bytes < 16 * GiB
    text = plan.render()
    assert "compressed 1/4 + indexer keys (128), 20 layers: 6400 B per token" in text
    million = next(line for line in text.splitlines() if line.startswith("  1M tokens"))
    assert float(million.split(":")[1].split()[0]) < 10  # GiB, in bf16 already
    assert plan.kv_tokens >= 1 << 20
    fp8 = plan_memory(cfg, torch.bfloat16, "cuda", device_bytes=32 * GiB, max_model_len=1 << 20, max_num_seqs=1,
                      offload=OffloadConfig(cpu_moe=True, cpu_moe_dtype="mxfp4", cpu_memory=256 * GiB),
                      kv_cache_dtype="fp8").render()
    # 20 CSA layers: (512 + 128) B of fp8 plus two float32 scales per 4 tokens.
    assert "compressed 1/4 + indexer keys (128), 20 layers: 3240 B per token" in fp8
    million = next(line for line in fp8.splitlines() if line.startswith("  1M tokens"))
    assert float(million.split(":")[1].split()[0]) < 4 and "in fp8" in million


def test_routed_experts_on_the_cpu_kernel_give_the_same_logits() -> None:
    """The offload path on a V4 model (fp32, CPU): experts detached, packed from the state dict
    one tensor at a time as the loader would, run by the CPU kernel with the SwiGLU clamp."""
    pytest.importorskip("tandem.offload.cpu_experts")
    from tandem.config import OffloadConfig
    from tandem.offload.cpu_executor import CpuMoEExecutor, OffloadedExperts
    from tandem.offload.placement import plan_placement

    _, model, length = _models("hash")
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.forward_full(ids)
    tensors = {n: t.clone() for n, t in model.state_dict().items() if ".experts." in n and "shared" not in n}
    sink = OffloadedExperts(plan_placement(model, torch.float32, OffloadConfig(cpu_moe=True), None, 0))
    sink.prepare(model)
    assert not any(".experts." in n and "shared" not in n for n in model.state_dict())
    for name, tensor in tensors.items():
        assert sink.wants(name)
        sink.take(name, tensor)
    sink.install(model, torch.device("cpu"), torch.float32)
    blocks = model.moe_blocks().values()
    assert all(isinstance(b.executor, CpuMoEExecutor) and b.executor.layer.swiglu_limit == BASE["swiglu_limit"]
               for b in blocks)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_full(ids), want, rtol=1e-4, atol=1e-4)
