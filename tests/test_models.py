"""Qwen3 / Qwen3-MoE against transformers on tiny random configs (fp32, CPU): a full prefill,
incremental decode through the paged KV cache, and two requests packed in one step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tandem.core import StepMetadata
from tandem.kv.tensors import LayerCache
from tandem.models.layers.moe import SparseMoeBlock, make_moe_executor, moe_executor_names
from tandem.models.loader import load_checkpoint

BLOCK_SIZE = 16
NUM_BLOCKS = 24
TOL = 1e-4

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}

# name -> (model_type, config overrides, config.json rewrite in the older "real checkpoint" spelling)
CASES = {
    "dense": ("qwen3", {}, None),
    "dense_tied_bias_yarn_oldform": (
        "qwen3",
        dict(tie_word_embeddings=True, attention_bias=True, rope_parameters=dict(YARN)),
        "old_rope",
    ),
    "moe_norm_topk_linear_rope": (
        "qwen3_moe",
        dict(MOE, num_hidden_layers=3, norm_topk_prob=True, mlp_only_layers=[1],
             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        None,
    ),
    "moe_no_norm_sparse_step2_num_experts": (
        "qwen3_moe",
        dict(MOE, num_hidden_layers=4, norm_topk_prob=False, decoder_sparse_step=2),
        "num_experts",
    ),
}  # fmt: skip


def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial weights everywhere (norm weights near 1, router included)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))


def _rewrite_config(path, how: str) -> None:
    cfg = json.loads(path.read_text())
    if how == "old_rope":  # rope_theta + rope_scaling {type: ...}, as real Qwen3 checkpoints write
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        params["type"] = params.pop("rope_type")
        cfg["rope_scaling"] = params
    elif how == "num_experts":  # real Qwen3-MoE checkpoints say num_experts
        cfg["num_experts"] = cfg.pop("num_local_experts")
    path.write_text(json.dumps(cfg))


def save_tiny(tmp_dir, model_type: str, overrides: dict, rewrite: str | None, seed: int = 0):
    """-> the transformers reference model, saved with a placeholder tokenizer.json in tmp_dir."""
    torch.manual_seed(seed)
    if model_type == "qwen3":
        config, cls = Qwen3Config(**{**BASE, **overrides}), Qwen3ForCausalLM
    else:
        config, cls = Qwen3MoeConfig(**{**BASE, **overrides}), Qwen3MoeForCausalLM
    config._attn_implementation = "eager"
    ref = cls(config).eval()
    _randomize(ref)
    ref.save_pretrained(tmp_dir)
    (tmp_dir / "tokenizer.json").write_text("{}")
    if rewrite:
        _rewrite_config(tmp_dir / "config.json", rewrite)
    return ref


class PagedRun:
    """Feeds chunks of requests through the model with a hand-built StepMetadata. Blocks are
    handed out from the top of the pool down and interleaved across requests, so block tables are
    non-contiguous and out of order."""

    def __init__(self, model, num_blocks: int = NUM_BLOCKS, bind: bool = True) -> None:
        """`bind`: give the model fresh caches in its dtype (False: it keeps the ones it was bound
        with, `num_blocks` of them)."""
        self.model = model
        if bind:
            specs = model.kv_cache_specs()
            caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, dtype=s.dtype) for s in specs]
            model.bind_kv_caches([(LayerCache(0, c),) for c in caches])
        self.free = list(range(num_blocks))[::-1]
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """chunks: request id -> its new token ids [n]. Returns request id -> logits [n, V]."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for rid, toks in chunks.items():
            table, start = self.tables.setdefault(rid, []), self.lens.get(rid, 0)
            end = start + len(toks)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop(0))
            for pos in range(start, end):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids.append(toks)
            positions.append(torch.arange(start, end))
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            self.lens[rid] = end
        width = max(len(self.tables[r]) for r in chunks)
        block_table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in chunks], dtype=torch.int32)
        step = StepMetadata(
            request_ids=tuple(chunks),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=(block_table,),
            slot_mappings=(torch.tensor(slots, dtype=torch.int64),),
            logits_indices=torch.arange(qsl[-1]),
            query_start_loc_cpu=tuple(qsl),
            seq_lens_cpu=tuple(seq_lens),
            block_size=BLOCK_SIZE,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        )
        with torch.no_grad():
            hidden = self.model(torch.cat(ids), torch.cat(positions), step)
            logits = self.model.compute_logits(hidden[step.logits_indices])
        assert logits.dtype == torch.float32
        return {rid: logits[qsl[i] : qsl[i + 1]] for i, rid in enumerate(chunks)}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    model_type, overrides, rewrite = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    ref = save_tiny(tmp, model_type, overrides, rewrite)
    ours, report = load_checkpoint(tmp, torch.float32, "cpu", progress=False)
    assert report.model_type == model_type
    return ref, ours


def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=ids[None]).logits[0].float()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_prefill_matches_transformers(pair):
    ref, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(0, BASE["vocab_size"], (70,))
    got = PagedRun(ours).step({"a": ids})["a"]
    want = ref_logits(ref, ids)
    assert want.abs().max() > 0.5  # the comparison is not trivially small
    assert _err(got, want) <= TOL


def test_incremental_decode_matches_transformers(pair):
    ref, ours = pair
    torch.manual_seed(2)
    ids = torch.randint(0, BASE["vocab_size"], (70,))
    want = ref_logits(ref, ids)
    run = PagedRun(ours)
    got = [run.step({"a": ids[:35]})["a"], run.step({"a": ids[35:60]})["a"]]  # chunked prefill
    got += [run.step({"a": ids[t : t + 1]})["a"] for t in range(60, 70)]  # decode, crossing a block edge
    assert _err(torch.cat(got), want) <= TOL


def test_packed_requests_match_transformers(pair):
    ref, ours = pair
    torch.manual_seed(3)
    a = torch.randint(0, BASE["vocab_size"], (70,))
    b = torch.randint(0, BASE["vocab_size"], (38,))
    want_a, want_b = ref_logits(ref, a), ref_logits(ref, b)
    run = PagedRun(ours)
    s1 = run.step({"a": a[:40], "b": b[:37]})  # two prefills of different lengths
    s2 = run.step({"b": b[37:], "a": a[40:]})  # a decode packed with a prefill chunk, order swapped
    assert _err(s1["a"], want_a[:40]) <= TOL and _err(s1["b"], want_b[:37]) <= TOL
    assert _err(s2["a"], want_a[40:]) <= TOL and _err(s2["b"], want_b[37:]) <= TOL


def test_stacked_projections_keep_the_weights_and_the_logits(pair):
    """q/k/v as one GEMM (`Attention.stack_qkv`) and a dense layer's gate/up as one
    (`SwiGLUMLP.stack_gate_up`), as every engine installs them: the same parameter names, each
    weight held once (the projections' weights are views of the stack), biases stacked too, and
    the logits of the separate GEMMs."""
    ref, ours = pair
    torch.manual_seed(4)
    ids = torch.randint(0, BASE["vocab_size"], (70,))
    three = PagedRun(ours).step({"a": ids})["a"]
    keys = set(ours.state_dict())
    layers, mlps = ours.attention_layers(), ours.dense_mlps()
    moe = ours.moe_blocks() if ref.config.model_type == "qwen3_moe" else {}
    assert mlps and len(mlps) + len(moe) == ref.config.num_hidden_layers  # every case has a dense layer
    for layer in layers:
        layer.stack_qkv()
    for mlp in mlps:
        mlp.stack_gate_up()
    try:
        for mlp in mlps:
            inter = mlp.gate_proj.weight.shape[0]
            stack, bias = mlp._gate_up
            assert bias is None and stack.shape[0] == 2 * inter
            assert mlp.gate_proj.weight.data_ptr() == stack.data_ptr()
            assert mlp.up_proj.weight.data_ptr() == stack[inter:].data_ptr()
            mlp.stack_gate_up()
            assert mlp._gate_up[0].data_ptr() == stack.data_ptr()
        assert set(ours.state_dict()) == keys
        for layer in layers:
            weight, bias = layer._qkv
            rows = [p.weight.shape[0] for p in (layer.q_proj, layer.k_proj, layer.v_proj)]
            assert weight.shape[0] == sum(rows)
            assert layer.q_proj.weight.data_ptr() == weight.data_ptr()
            assert layer.v_proj.weight.data_ptr() == weight[rows[0] + rows[1]:].data_ptr()
            assert (bias is None) == (layer.q_proj.bias is None)
            if bias is not None:
                assert layer.k_proj.bias.data_ptr() == bias[rows[0]:].data_ptr()
            layer.stack_qkv()  # again (an engine built again on the model): the same stack
            assert layer._qkv[0].data_ptr() == weight.data_ptr()
        one = PagedRun(ours).step({"a": ids})["a"]
        assert _err(one, ref_logits(ref, ids)) <= TOL
        assert _err(one, three) <= 1e-5
    finally:
        for layer in layers:
            layer.unstack_qkv()
        for mlp in mlps:
            mlp.unstack_gate_up()


def test_structure_and_kv_specs(pair):
    ref, ours = pair
    specs = ours.kv_cache_specs()
    assert len(specs) == ref.config.num_hidden_layers
    assert {(s.kind, s.num_kv_heads, s.head_dim) for s in specs} == {("full", 2, 16)}
    if ref.config.model_type == "qwen3_moe":
        blocks = ours.moe_blocks()
        expected = [
            i for i in range(ref.config.num_hidden_layers)
            if i not in ref.config.mlp_only_layers and (i + 1) % ref.config.decoder_sparse_step == 0
        ]  # fmt: skip
        assert sorted(blocks) == expected


def test_moe_executor_is_swappable():
    torch.manual_seed(4)
    block = SparseMoeBlock(32, 16, num_experts=6, top_k=2, norm_topk_prob=True)
    x = torch.randn(9, 32)
    base = block(x)

    calls = []

    def spy(hidden, topk_ids, topk_weights):
        calls.append(topk_ids.shape)
        return make_moe_executor("torch", block.experts)(hidden, topk_ids, topk_weights)

    block.set_executor(spy)
    assert torch.equal(block(x), base) and calls == [(9, 2)]
    assert "torch" in moe_executor_names()
    # Dense check of the reference executor: every token through its k experts, weighted.
    ids, w = block.route(x)
    dense = torch.stack([sum(w[t, j] * block.experts[int(ids[t, j])](x[t]) for j in range(2)) for t in range(9)])
    assert _err(base, dense) <= 1e-5
    assert math.isclose(w.sum(-1).mean().item(), 1.0, rel_tol=1e-5)
