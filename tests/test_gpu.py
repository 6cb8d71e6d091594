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
