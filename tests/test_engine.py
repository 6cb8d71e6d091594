"""The engine end to end on tiny random checkpoints, against `transformers` as the reference."""

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core import ParamError
from tiny_models import save_tiny_model

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    d = tmp_path_factory.mktemp("moe")
    return d, save_tiny_model(d, "qwen3_moe", seed=1)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    d = tmp_path_factory.mktemp("dense")
    return d, save_tiny_model(d, "qwen3", seed=2)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 37, 70, 18, 101, 9][:n]
    return [torch.randint(10, 2000, (length,), generator=g).tolist() for length in lengths]


def reference(hf: torch.nn.Module, prompt: list[int], n: int = 64) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_greedy_batch_is_token_identical_to_transformers(kind, request):
    model_dir, hf = request.getfixturevalue(kind)
    ps = prompts(4)
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == reference(hf, p)
        assert o.finish_reason == "length"


def test_chunked_prefill_and_prefix_hits_keep_greedy_identical(moe):
    model_dir, hf = moe
    ps = prompts(3, seed=1)
    refs = [reference(hf, p) for p in ps]
    # 16-token budget: every prompt is prefilled in chunks while the others decode.
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB", max_num_batched_tokens=16)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == refs
    # Same prompts again: their full blocks come from the prefix cache.
    again = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in again] == refs
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in ps]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_preemption_recompute_keeps_greedy_identical(moe):
    model_dir, hf = moe
    ps = prompts(4, seed=2)
    refs = [reference(hf, p) for p in ps]
    # A cache of 24 blocks (384 tokens) cannot hold all four sequences at full length.
    kv_bytes = 24 * 16 * 2 * 2 * 16 * 4 * 2  # blocks*bs * K,V * kv_heads * head_dim * fp32 * layers
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=kv_bytes, max_model_len=192, enable_prefix_caching=False)
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == refs


def test_logits_match_transformers_through_the_engine(dense):
    model_dir, hf = dense
    p = prompts(5)[4]
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    out = llm.generate([p], params)[0]
    full = torch.tensor([p + out.token_ids[:-1]])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full).logits[0, len(p) - 1 :].float(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.chosen.token_id == out.token_ids[i]
        assert abs(lp.chosen.logprob - float(ref[i, lp.chosen.token_id])) < 1e-4
        assert [t.token_id for t in lp.top] == torch.topk(ref[i], 5).indices.tolist()


def test_abort_frees_blocks(moe):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    eng = llm.engine
    eng.add_request("x", prompts(3)[2], SamplingParams(max_tokens=50))
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.num_blocks
    final = eng.abort("x")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert eng.abort("x") is None
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_unfinished


def test_seeded_sampling_is_reproducible_and_batch_independent(moe):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    p = prompts(1)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([p], params)[0].token_ids
    crowd = llm.generate([prompts(3, seed=5)[1], p, prompts(3, seed=6)[2]],
                         [SamplingParams(max_tokens=30, temperature=1.0), params, SamplingParams(max_tokens=5)])
    assert crowd[1].token_ids == alone
    other_seed = llm.generate([p], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_stop_conditions(moe):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    p = prompts(2)[1]
    free = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    # A stop token id taken from the free-running output stops right there.
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    # A stop string cuts the text before it (and is excluded by default).
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    out = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    out = llm.generate([p], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,),
                                           include_stop_str_in_output=True))[0]
    assert out.text == text[: text.index(stop) + len(stop)]
    # max_tokens
    out = llm.generate([p], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(moe):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    eng = llm.engine
    p = prompts(1)[0]
    free = llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    eng.tokenizer.eos_token_ids = frozenset({free.token_ids[3]})
    out = llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == free.token_ids[3]
    assert len(out.token_ids) == free.token_ids.index(free.token_ids[3]) + 1
    out = llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == free.token_ids


def test_context_length_is_enforced_with_vllm_wording(moe):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB", max_model_len=128)
    with pytest.raises(ParamError, match=r"This model's maximum context length is 128 tokens\. However, you "
                                         r"requested 150 tokens \(100 in the messages, 50 in the completion\)"):
        llm.engine.add_request("a", list(range(100)), SamplingParams(max_tokens=50))
    with pytest.raises(ParamError, match="token ids must be in"):
        llm.engine.add_request("b", [10**7], SamplingParams(max_tokens=5))
    # max_tokens=None fills the context.
    out = llm.generate([list(range(10, 110))], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 28 and out.finish_reason == "length"


def test_kv_budget_smaller_than_one_request_is_refused(moe):
    model_dir, _ = moe
    with pytest.raises(MemoryError, match="lower --max-model-len or raise --kv-cache-memory"):
        LLM(str(model_dir), device="cpu", kv_cache_memory="16KiB", max_model_len=512)


def test_offline_chat_renders_the_template(moe):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0.0),
                   enable_thinking=False)
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>") and prompt.endswith("<think>\n\n</think>\n\n")
    assert len(out.token_ids) == 4
