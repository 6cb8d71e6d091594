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
