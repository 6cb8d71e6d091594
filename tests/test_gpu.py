"""CUDA checks (run on the GPU machine; skipped without CUDA)."""

import pytest
import torch

from tandem import LLM, SamplingParams
from tiny_models import save_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_cuda_fp32_greedy_matches_transformers(tmp_path, kind):
    hf = save_tiny_model(tmp_path, kind, seed=3).cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (7, 50, 130)]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_memory="256MiB")
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=64, min_new_tokens=64,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref


def test_cuda_bf16_logits_close_to_transformers(tmp_path):
    hf = save_tiny_model(tmp_path, "qwen3_moe", seed=4).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    p = torch.randint(10, 2000, (90,), generator=g).tolist()
    llm = LLM(str(tmp_path), device="cuda", kv_cache_memory="256MiB")  # auto dtype: bf16 on CUDA
    assert llm.engine.model.dtype == torch.bfloat16
    out = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
    assert abs(out.logprobs[0].chosen.logprob - float(ref[out.token_ids[0]])) < 0.05
    assert out.token_ids[0] in torch.topk(ref, 3).indices.tolist()


def test_cuda_memory_profile_sizes_the_kv_cache(tmp_path):
    save_tiny_model(tmp_path, "qwen3_moe", seed=5)
    llm = LLM(str(tmp_path), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4)
    eng = llm.engine
    assert eng.kv.num_blocks * eng.kv.block_size >= eng.max_model_len
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def _graph_steps(llm: LLM) -> float:
    eng = llm.engine
    return eng.metrics.model_steps.labels(model_name=eng.model_name, mode="cuda_graph")._value.get()


@pytest.mark.parametrize("fused_ops", [False, True])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_cuda_graph_replay_gives_the_eager_tokens(tmp_path, kind, fused_ops):
    save_tiny_model(tmp_path, kind, seed=6)
    g = torch.Generator().manual_seed(2)
    # Batch sizes equal to capture buckets (4, then 1), so eager and graph run identical shapes.
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (9, 40, 77, 130)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", kv_cache_memory="256MiB", max_num_seqs=8, fused_ops=fused_ops)
    eager = LLM(str(tmp_path), enforce_eager=True, **common)
    graphed = LLM(str(tmp_path), max_k=2, **common)
    assert set(graphed.engine.runner.graphs) == {(b, q) for b in (1, 2, 4, 8) for q in (1, 2, 3)}
    assert not eager.engine.runner.graphs
    for batch in (prompts, prompts[:1]):
        want = [o.token_ids for o in eager.generate(batch, params)]
        before = _graph_steps(graphed)
        got = [o.token_ids for o in graphed.generate(batch, params)]
        assert _graph_steps(graphed) - before >= 47  # every decode step replayed a graph
        assert got == want
    assert _graph_steps(eager) == 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_cuda_graph_replays_a_batch_of_mixed_draft_lengths_padded(tmp_path, kind):
    """A verify step whose requests have drafts of 0..3 tokens replays the (bucket 4, q 4) graph with
    each query padded to 4, and gives the logits rows of the same step run eagerly."""
    from tandem.engine.scheduler import ScheduledRequest

    save_tiny_model(tmp_path, kind, seed=8)
    dtype = "float32" if kind == "qwen3" else "bfloat16"  # MoE graphs need the grouped (bf16) experts
    # Synchronous steps: the batch below is built by hand once the prefill steps have landed (with
    # async scheduling the step after them would be in flight, its slots taken).
    llm = LLM(str(tmp_path), device="cuda", dtype=dtype, kv_cache_memory="256MiB", max_num_seqs=4, max_k=3,
              async_scheduling=False)
    eng = llm.engine
    assert (4, 4) in eng.runner.graphs
    g = torch.Generator().manual_seed(3)
    reqs = [eng.new_request(f"r{i}", torch.randint(10, 2000, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            for i, n in enumerate((5, 20, 33, 70))]
    for r in reqs:
        eng.add(r)
    while any(r.num_output_tokens == 0 for r in reqs):  # prefill: each request has its first token
        eng.step()
    batch = []
    for r, k in zip(reqs, (0, 2, 3, 1)):
        assert eng.kv.allocate_slots(r, 1 + k)
        batch.append(ScheduledRequest.of(r, 1, tuple(range(100, 100 + k))))
    out = eng.runner.execute(batch)
    graph_logits = out.logits
    assert out.graphed
    ids, pos, step = eng.runner.build_step(batch)
    with torch.inference_mode():
        eager_logits = eng.model.compute_logits(eng.model(ids, pos, step)[step.logits_indices])
    assert graph_logits.shape == eager_logits.shape == (1 + 3 + 4 + 2, eager_logits.shape[1])
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(graph_logits, eager_logits, atol=tol * eager_logits.abs().max().item(), rtol=tol)
    assert (graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean() >= (1.0 if dtype == "float32" else 0.9)


def _count(llm: LLM, name: str, mode: str) -> float:
    total = 0.0
    for metric in llm.engine.metrics.registry.collect():
        for s in metric.samples:
            if s.name == f"tandem:{name}_total" and s.labels.get("mode") == mode:
                total += s.value
    return total


@pytest.mark.parametrize("method", ["draft_model", "dspark"])
def test_drafters_and_verify_steps_replay_cuda_graphs(method):
    """On the demo pair (bf16), after start-up every decode and verify step of the target and every
    drafter forward replays a captured graph, greedy and sampled, with K mixed by phase."""
    from tandem.builtin import demo_model_dir

    llm = LLM(str(demo_model_dir()), device="cuda", kv_cache_memory="512MiB", max_num_seqs=4,
              speculative_config={"method": method, "num_speculative_tokens": 3, "adaptive": "phase",
                                  "phase_k": {"reasoning": 3, "content": 2}})
    eng = llm.engine
    assert {(b, q) for b in (1, 2, 4) for q in (1, 2, 3, 4)} <= set(eng.runner.graphs)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (9, 30, 64)]
    params = [SamplingParams(max_tokens=48, temperature=0.0), SamplingParams(max_tokens=48, temperature=0.8, seed=1),
              SamplingParams(max_tokens=48, temperature=0.0)]
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) > 0 for o in outs)
    assert _count(llm, "model_steps", "eager") == 0 and _count(llm, "model_steps", "cuda_graph") > 0
    assert _count(llm, "spec_decode_drafter_steps", "eager") == 0
    assert _count(llm, "spec_decode_drafter_steps", "cuda_graph") > 0
    if method == "draft_model":  # its prompt chunks replay its own prefill graphs, none eager
        assert eng.spec.proposer.runner.prefill_graphs
        assert _count(llm, "spec_decode_drafter_steps", "prefill_graph") > 0
        assert _count(llm, "spec_decode_drafter_steps", "prefill") == 0


def test_draft_model_chains_replay_graphs_and_give_its_greedy_tokens():
    """The draft model's chained draft steps (ModelRunner.execute_chain) on CUDA graphs (bf16: in
    fp32 the demo target's MoE runs on the torch executor, which turns graphs off): each request's
    drafts, at its own K, before and after the target kept part of a draft, are its drafter's greedy
    tokens by transformers' fp32 forward over the same tokens, up to bf16 noise (3% of the row's
    largest logit; a wrong token's gap is typically the size of that logit); every drafter forward
    a replay."""
    transformers = pytest.importorskip("transformers")
    from tandem.builtin import demo_model_dir
    from tandem.core import Request

    llm = LLM(str(demo_model_dir()), device="cuda", kv_cache_memory="256MiB", max_num_seqs=8,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 7})
    proposer = llm.engine.spec.proposer
    ref = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir() / "draft", dtype=torch.float32)
    ref = ref.cuda().eval()
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [Request(f"chain-{i}", torch.randint(10, 4000, (n,), generator=g).tolist(), params)
            for i, n in enumerate((9, 30, 64, 17, 5))]
    checked = 0
    for ks in ([7, 1, 3, 0, 5], [2, 6, 0, 7, 4]):
        drafts = proposer.propose(reqs, ks)
        for req, k, d in zip(reqs, ks, drafts):
            assert len(d.tokens) == k, (req.request_id, k)
            if not k:
                continue
            ids = req.all_token_ids
            with torch.no_grad():
                logits = ref(torch.tensor([ids + d.tokens], device="cuda")).logits[0, len(ids) - 1 : len(ids) - 1 + k]
            picked = logits.gather(1, torch.tensor(d.tokens, device="cuda")[:, None])[:, 0]
            slack = 3e-2 * logits.abs().amax(dim=-1)
            assert (picked >= logits.amax(dim=-1) - slack).all(), (req.request_id, k, d.tokens)
            checked += k
        for req, d in zip(reqs, drafts):
            req.output_token_ids += d.tokens[:1] + [(d.tokens[1] + 1) % 100 if len(d.tokens) > 1 else 7]
    assert checked == sum([7, 1, 3, 0, 5]) + sum([2, 6, 0, 7, 4])
    # propose() outside an engine step: the forwards are still the SpecDecoder's, not yet counted in /metrics
    forwards = llm.engine.spec.take_drafter_forwards()
    assert forwards.get("eager", 0) == 0 and forwards.get("cuda_graph", 0) >= 6 + 6, forwards


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_speculative_tokens": 3}])
def test_structured_output_masks_graph_logits_on_cuda(spec):
    """A json_schema grammar on the demo (bf16, CUDA graphs, with and without DSpark): every answer
    after the reasoning parses and has the schema's keys, greedy and sampled, and the steps still
    replay graphs (the mask is applied to the graph's logits, outside it)."""
    import json

    from tandem.builtin import demo_model_dir
    from tandem.server.chat_template import ChatTemplate
    from tandem.engine.structured import json_schema_grammar

    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 10**9},
                                               "unit": {"enum": ["none", "m", "kg"]}},
              "required": ["answer", "unit"], "additionalProperties": False}
    grammar = json_schema_grammar(schema, ("<think>", "</think>"))
    llm = LLM(str(demo_model_dir()), device="cuda", kv_cache_memory="512MiB", max_num_seqs=4, max_model_len=4096,
              speculative_config=spec)
    tok = llm.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    questions = ["What is 48213 + 37795?", "What is 812 * 7?", "Convert 3 km to m.", "Sort 5, 3, 9, 1."]
    prompts = [tok.encode(template.render([{"role": "user", "content": q}])) for q in questions]
    params = [SamplingParams(max_tokens=400, temperature=0.0, grammar=grammar),
              SamplingParams(max_tokens=400, temperature=1.0, seed=3, grammar=grammar)] * 2
    outs = llm.generate(prompts, params)
    for o in outs:
        assert o.finish_reason == "stop", o.text[-200:]
        assert set(json.loads(o.text.split("</think>", 1)[1])) == {"answer", "unit"}
    assert _count(llm, "model_steps", "eager") == 0 and _count(llm, "model_steps", "cuda_graph") > 0
