"""The engine end to end on tiny random checkpoints, against `transformers` as the reference."""

import asyncio
import logging
import time
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core import ParamError
from tandem.engine.async_engine import AsyncEngine, EngineDeadError
from tandem.engine.engine import MAX_FAILED_STEPS, EngineFatalError, LLMEngine
from tandem.engine.sampler import Sampler
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


@pytest.mark.parametrize(("prompt", "params", "param"), [
    ([1, "2", 3], SamplingParams(), "prompt"),
    ([1, True], SamplingParams(), "prompt"),
    ([1, 2.0], SamplingParams(), "prompt"),
    ([-1, 5], SamplingParams(), "prompt"),
    ("hello", SamplingParams(), "prompt"),
    ([1, 2], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
])
def test_validate_refuses_what_the_model_cannot_take(moe, prompt, params, param):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    with pytest.raises(ParamError) as e:
        llm.engine.add_request("a", prompt, params)
    assert e.value.param == param and not llm.engine.has_unfinished


def test_cpu_threads_are_set_for_torch(moe, caplog):
    model_dir, _ = moe
    with caplog.at_level(logging.INFO, logger="tandem"):
        LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB", cpu_threads=1)
    assert torch.get_num_threads() == 1
    assert "CPU threads: 1 for torch (of " in caplog.text


def gauges(eng: LLMEngine) -> tuple[float, float, float]:
    def get(name: str) -> float:
        return eng.metrics.registry.get_sample_value(f"tandem:{name}", {"model_name": eng.model_name})
    return get("num_requests_running"), get("num_requests_waiting"), get("kv_cache_usage_perc")


def test_gauges_follow_adds_and_aborts_while_idle(moe):
    model_dir, _ = moe
    eng = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB").engine
    eng.add_request("x", prompts(3)[2], SamplingParams(max_tokens=50))
    assert gauges(eng)[:2] == (0, 1)
    eng.step()
    running, waiting, usage = gauges(eng)
    assert (running, waiting) == (1, 0) and usage > 0
    eng.abort("x")  # no step runs after this: the abort itself must bring the gauges down
    assert gauges(eng) == (0, 0, 0)


# -- failures ---------------------------------------------------------------------------------


def fail_when(rid: str, fn, after: bool = False):  # noqa: ANN001, ANN201
    """Wrap fn(self, x, batch) to raise when request `rid` is in the batch (after fn ran, if
    `after`: e.g. once the sampler has drawn from the batch's generators)."""
    def ids(batch) -> set[str]:  # noqa: ANN001
        return {getattr(x, "request", x).request_id for x in batch}

    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = fn(*args, **kwargs) if after else None
        if rid in ids(args[-1]):
            raise RuntimeError(f"injected failure for {rid}\n" + "a long traceback-like dump\n" * 500)
        return out if after else fn(*args, **kwargs)
    return wrapped


def run_all(eng: LLMEngine) -> dict[str, list]:
    """Step until idle; returns each request's outputs."""
    outs: dict[str, list] = {}
    while eng.has_unfinished:
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_internal_error(outs: list) -> None:
    last = outs[-1]
    assert last.finished and last.finish_reason == "error" and last.error_kind == "internal"
    assert "injected failure" in last.error and len(last.error) <= 200


def test_a_request_failing_in_the_sampler_fails_alone(moe, monkeypatch, caplog):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    eng = llm.engine
    ps = prompts(3, seed=3)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_k=50, seed=2**64 - 1, ignore_eos=True)
    alone_greedy = llm.generate([ps[0]], GREEDY)[0].token_ids
    alone_seeded = llm.generate([ps[1]], seeded)[0].token_ids
    # The sampler raises after drawing for the whole batch: the retry must not draw a second time
    # from the seeded request's generator.
    monkeypatch.setattr(Sampler, "__call__", fail_when("bad", Sampler.__call__, after=True))
    eng.add_request("greedy", ps[0], GREEDY)
    eng.add_request("seeded", ps[1], seeded)
    eng.add_request("bad", ps[2], GREEDY)
    with caplog.at_level(logging.ERROR, logger="tandem"):
        outs = run_all(eng)
    assert_internal_error(outs["bad"])
    assert tokens(outs["bad"]) == []
    assert tokens(outs["greedy"]) == alone_greedy and outs["greedy"][-1].finish_reason == "length"
    assert tokens(outs["seeded"]) == alone_seeded
    assert "Request bad failed while sampling" in caplog.text
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.states and not eng.sampler.generators


def test_a_failing_forward_fails_its_step_and_the_engine_goes_on(moe, monkeypatch):
    model_dir, hf = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    eng = llm.engine
    ps = prompts(3, seed=4)
    monkeypatch.setattr(eng.runner, "execute", fail_when("bad", eng.runner.execute))
    eng.add_request("early", ps[0], GREEDY)
    eng.step()
    eng.step()
    eng.add_request("bad", ps[1], GREEDY)  # joins early's batch: the step cannot be pinned on one
    outs = {o.request_id: o for o in eng.step()}
    assert set(outs) == {"early", "bad"}
    for o in outs.values():
        assert_internal_error([o])
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_unfinished
    # bad's blocks were registered as cached prefix before its forward failed: a later request with
    # the same prompt must not reuse their unwritten K/V.
    monkeypatch.undo()
    again = llm.generate([ps[1], ps[0]], GREEDY)
    assert [o.token_ids for o in again] == [reference(hf, ps[1]), reference(hf, ps[0])]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_persistent_failures_and_device_errors_are_fatal(moe, monkeypatch):
    model_dir, _ = moe
    eng = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB").engine

    def broken(batch):  # noqa: ANN001, ANN202
        raise RuntimeError("the runner is broken")

    monkeypatch.setattr(eng.runner, "execute", broken)
    for i in range(MAX_FAILED_STEPS - 1):
        eng.add_request(f"r{i}", prompts(1)[0], GREEDY)
        assert [o.finish_reason for o in eng.step()] == ["error"]
    eng.add_request("last", prompts(1)[0], GREEDY)
    with pytest.raises(EngineFatalError, match=f"{MAX_FAILED_STEPS} steps in a row failed"):
        eng.step()

    eng = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB").engine

    def device_assert(batch):  # noqa: ANN001, ANN202
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(eng.runner, "execute", device_assert)
    eng.add_request("a", prompts(1)[0], GREEDY)
    with pytest.raises(EngineFatalError, match="device error while running the model"):
        eng.step()


def test_async_engine_survives_a_failing_request_then_dies_on_persistent_failure(moe, monkeypatch):
    model_dir, _ = moe
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")
    ps = prompts(2, seed=7)
    alone = llm.generate([ps[0]], GREEDY)[0].token_ids
    reasons: list[str] = []
    engine = AsyncEngine(llm.engine, on_fatal=reasons.append)
    engine.start()

    async def collect(rid: str, prompt: list[int]) -> list:
        return [o async for o in engine.generate(rid, prompt, GREEDY)]

    async def scenario() -> None:
        with monkeypatch.context() as m:
            m.setattr(Sampler, "__call__", fail_when("bad", Sampler.__call__))
            good, bad = await asyncio.gather(collect("good", ps[0]), collect("bad", ps[1]))
        assert tokens(good) == alone and good[-1].finish_reason == "length"
        assert_internal_error(bad)
        assert not engine.is_dead

        def broken(batch):  # noqa: ANN001, ANN202
            raise RuntimeError("the runner is broken")

        monkeypatch.setattr(llm.engine.runner, "execute", broken)
        for i in range(MAX_FAILED_STEPS - 1):
            outs = await collect(f"r{i}", ps[0])
            assert outs[-1].finish_reason == "error" and not engine.is_dead
        with pytest.raises(EngineDeadError, match="steps in a row failed"):
            await collect("last", ps[0])
        with pytest.raises(EngineDeadError):
            await collect("after", ps[0])

    asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while not reasons and time.monotonic() < deadline:  # on_fatal runs on the engine thread
        time.sleep(0.01)
    assert engine.is_dead
    assert len(reasons) == 1 and f"{MAX_FAILED_STEPS} steps in a row failed" in reasons[0]
