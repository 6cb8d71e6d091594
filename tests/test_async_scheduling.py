"""Async scheduling (tandem/engine/inflight.py): steps launched before the previous step's tokens
are on the host give the same tokens, stops, logprobs and prefix-cache state as synchronous steps. On the CPU a launch computes at once, but the engine's bookkeeping is the one CUDA runs."""

from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from test_engine import prompts, reference  # the engine tests' prompts and transformers' greedy tokens
from tiny_models import save_tiny_model

KW = dict(device="cpu", kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    d = tmp_path_factory.mktemp("moe_async")
    return d, save_tiny_model(d, "qwen3_moe", seed=1)


def run(model_dir: Path, ps, params, async_scheduling: bool, **kw):
    llm = LLM(str(model_dir), async_scheduling=async_scheduling, **(KW | kw))
    return llm, llm.generate(ps, params)


def test_greedy_with_staggered_lengths_matches_transformers_and_goes_ahead(moe):
    model_dir, hf = moe
    ps = prompts(4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 30, 1, 18)]
    llm, outs = run(model_dir, ps, params, True)
    for p, sp, o in zip(ps, params, outs):
        assert o.token_ids == reference(hf, p, sp.max_tokens) and o.finish_reason == "length"
    assert llm.engine.num_async_steps > 10  # most decode steps went ahead
    assert not llm.engine.has_unfinished and llm.engine.kv.usage == 0.0


def test_stops_found_after_the_step_ahead_end_at_the_same_token(moe):
    """A stop token or stop string that the pending token hits is only seen after the next step
    launched: that row is dropped, and the request ends exactly where the synchronous engine ends it."""
    model_dir, _ = moe
    ps = prompts(3, seed=3)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, base = run(model_dir, ps, free, False)
    stop_token = base[0].token_ids[9]  # the first request stops at its 10th token (or earlier)
    stop_text = base[1].text[5:9]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop_text]), free]
    _, sync = run(model_dir, ps, params, False)
    llm, ahead = run(model_dir, ps, params, True)
    assert [(o.token_ids, o.text, o.finish_reason) for o in ahead] == \
           [(o.token_ids, o.text, o.finish_reason) for o in sync]
    assert sync[0].finish_reason == "stop" and sync[1].finish_reason == "stop" and len(sync[0].token_ids) <= 10
    assert llm.engine.num_async_steps > 0 and llm.engine.kv.usage == 0.0


def test_seeded_sampling_is_reproduced(moe):
    model_dir, _ = moe
    ps = prompts(3, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    _, sync = run(model_dir, ps, params, False)
    llm, ahead = run(model_dir, ps, params, True)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in sync]
    assert llm.engine.num_async_steps > 0


def test_a_request_arriving_or_aborted_mid_decode(moe):
    """A new request is admitted into a step planned ahead (its prefill beside the pending
    decodes), an abort drops its request from the next step; the others' tokens are unchanged."""
    model_dir, hf = moe
    ps = prompts(3, seed=7)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), async_scheduling=True, **KW)
    engine = llm.engine
    for i in (0, 1):
        engine.add_request(f"r{i}", ps[i], greedy)
    got: dict[str, list[int]] = {"r0": [], "r1": [], "r2": []}
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 6:
            engine.add_request("r2", ps[2], greedy)
        if steps == 12:
            final = engine.abort("r1")
            assert final is not None and final.finish_reason == "abort"
    assert got["r0"] == reference(hf, ps[0], 30) and got["r2"] == reference(hf, ps[2], 30)
    cut = got["r1"]
    assert 0 < len(cut) < 30 and cut == reference(hf, ps[1], 30)[: len(cut)]
    assert engine.num_async_steps > 10 and engine.kv.usage == 0.0


def test_chunked_prefill_and_admissions_are_planned_ahead(moe):
    """With a 16-token budget every prompt is prefilled in chunks beside the others' decodes, and
    requests arrive while others run: every step but the first goes ahead of the one before, and
    the tokens equal transformers'."""
    model_dir, hf = moe
    ps = prompts(4, seed=23)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=2, **KW)
    outs = llm.generate(ps, greedy)  # 4 requests, 2 at a time: two arrive as the first two end
    engine = llm.engine
    assert [o.token_ids for o in outs] == [reference(hf, p, 24) for p in ps]
    steps = sum(engine.metrics.model_steps.labels(model_name=engine.model_name, mode=m)._value.get()
                for m in ("prefill", "eager", "cuda_graph"))
    assert engine.num_async_steps >= steps - 2 and engine.kv.usage == 0.0


def test_blocks_written_ahead_serve_prefix_hits(moe):
    """The blocks a request completes while decoding ahead are registered once their tokens land:
    a later prompt that extends its output reuses them and still decodes exactly."""
    model_dir, hf = moe
    prompt = prompts(1, seed=9)[0] + list(range(100, 130))  # 35 tokens
    llm = LLM(str(model_dir), async_scheduling=True, **KW)
    first = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    longer = prompt + first.token_ids[:33]  # 68 tokens: 4 full blocks of 16, the last from the output
    second = llm.generate([longer], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert second.num_cached_tokens == 64
    assert second.token_ids == reference(hf, longer, 12) and second.token_ids[:7] == first.token_ids[33:]


def test_preemption_falls_back_to_the_synchronous_step(moe):
    model_dir, hf = moe
    ps = prompts(4, seed=11)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    # 24 blocks (384 tokens) cannot hold the four sequences at full length: some are preempted.
    kv_bytes = 24 * 16 * 2 * 2 * 16 * 4 * 2  # blocks*bs * K,V * kv_heads * head_dim * fp32 * layers
    llm, outs = run(model_dir, ps, greedy, True, kv_cache_memory=kv_bytes, max_model_len=192,
                    enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_async_steps > 0
    for p, o in zip(ps, outs):
        assert o.token_ids == reference(hf, p, 64)


def test_penalties_and_min_tokens_count_the_pending_token(moe):
    """Penalties read the request's history and min_tokens its output count: a step scheduled
    ahead counts the token still on the device, so the tokens equal the synchronous engine's."""
    model_dir, _ = moe
    ps = prompts(4, seed=17)
    sync_eos = run(model_dir, ps[:1], SamplingParams(max_tokens=30, temperature=0.0), False)[1][0].token_ids
    params = [SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.6, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=1.5, frequency_penalty=1.2,
                             ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.8,
                             ignore_eos=True),
              # EOS banned until 12 tokens, then free: the first token the ban held back is drawn late
              SamplingParams(max_tokens=30, temperature=0.0, min_tokens=12, stop_token_ids=list(sync_eos[:3]))]
    _, sync = run(model_dir, ps, params, False)
    llm, ahead = run(model_dir, ps, params, True)
    assert [(o.token_ids, o.finish_reason) for o in ahead] == [(o.token_ids, o.finish_reason) for o in sync]
    assert llm.engine.num_async_steps > 10
    plain = run(model_dir, ps[:2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), False)[1]
    assert sync[0].token_ids != plain[0].token_ids and sync[1].token_ids != plain[1].token_ids  # the penalties bite


def test_logprobs_travel_with_the_tokens(moe):
    """Logprobs of steps scheduled ahead are computed on the device and copied with the tokens:
    the same chosen logprobs and top alternatives as the synchronous sampler's, each request
    getting as many alternatives as it asks for."""
    model_dir, _ = moe
    ps = prompts(3, seed=13)
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=0, ignore_eos=True)]
    _, sync = run(model_dir, ps, params, False)
    llm, ahead = run(model_dir, ps, params, True)
    assert llm.engine.num_async_steps > 5
    assert [o.token_ids for o in ahead] == [o.token_ids for o in sync]
    for a, b, sp in zip(ahead, sync, params):
        assert len(a.logprobs) == (12 if sp.logprobs is not None else 0)
        assert all(len(lp.top) == sp.logprobs for lp in a.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.chosen == y.chosen and [t.token_id for t in x.top] == [t.token_id for t in y.top]
            assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=1e-6)


def test_speculation_keeps_async_scheduling_on_for_steps_without_drafts(moe):
    """With speculation async scheduling stays on; a step with a draft to verify waits for the
    tokens (tests/test_spec_async.py covers the steps that go ahead)."""
    model_dir, _ = moe
    ps = prompts(2, seed=21)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm, outs = run(model_dir, ps, greedy, True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert llm.engine.async_scheduling
    assert [o.token_ids for o in outs] == [o.token_ids for o in run(model_dir, ps, greedy, False)[1]]


def test_v4_prefix_hits_after_steps_ahead(tmp_path):
    """DeepSeek-V4's sliding window gives back blocks behind the window when the next step's slots
    are planned, which with async scheduling is before the step in flight lands: they must be
    registered at launch, or a later request sharing the prefix misses them (it did)."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from test_deepseek_v4_engine import GREEDY as V4_GREEDY, prompts as v4_prompts, reference as v4_reference, save_v4

    hf = save_v4(tmp_path, "all_kinds")
    shared = v4_prompts((150,), seed=1)[0]
    ps = [shared + tail for tail in v4_prompts((10, 7), seed=2)]
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB", block_size=8, async_scheduling=True)
    outs = [llm.generate([p], V4_GREEDY)[0] for p in ps]
    assert [o.num_cached_tokens for o in outs] == [0, 128] and llm.engine.num_async_steps > 20
    assert [o.token_ids for o in outs] == [v4_reference(hf, p) for p in ps]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graph_steps_go_ahead_with_the_synchronous_tokens(moe):
    """bf16 in decode graphs: the steps that go ahead read their input tokens from the previous
    replay's sampled tokens on the device; the tokens equal the synchronous engine's."""
    model_dir, _ = moe
    ps = prompts(4, seed=15)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 40, 3, 25)]
    params.append(SamplingParams(max_tokens=30, temperature=0.8, seed=4, ignore_eos=True))
    params.append(SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0,
                                 ignore_eos=True))
    params.append(SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, ignore_eos=True))
    ps += [ps[0], ps[1], ps[2]]
    runs, logprobs = [], []
    for on in (False, True):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", kv_cache_memory="64MiB", async_scheduling=on)
        outs = llm.generate(ps, params)
        runs.append([o.token_ids for o in outs])
        logprobs.append([lp.chosen.logprob for lp in outs[-1].logprobs])
        engine = llm.engine
        graphed = engine.metrics.model_steps.labels(model_name=engine.model_name, mode="cuda_graph")._value.get()
        assert graphed > 20 and (engine.num_async_steps > 20) == on
    assert runs[0] == runs[1]
    assert len(logprobs[1]) == 30 and logprobs[1] == pytest.approx(logprobs[0], abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_v4_graph_steps_go_ahead_with_the_reference_tokens(tmp_path):
    """DeepSeek-V4 (its compressed caches' state advanced by steps launched ahead) in decode graphs:
    the tokens against transformers."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from test_deepseek_v4_engine import GREEDY as V4_GREEDY, prompts as v4_prompts, reference as v4_reference, save_v4

    hf = save_v4(tmp_path, "all_kinds")
    ps = v4_prompts((5, 37, 70, 18))
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_memory="64MiB", attention_backend="triton",
              cpu_moe=True, async_scheduling=True)
    assert llm.engine.runner.graphs, "no graph was captured"
    for p, o in zip(ps, llm.generate(ps, V4_GREEDY)):
        assert o.token_ids == v4_reference(hf, p), len(p)
    assert llm.engine.num_async_steps > 10


def test_a_failure_in_a_step_launched_ahead_ends_only_its_requests(moe):
    """The forward of a step scheduled ahead raises: the step in flight still lands (its tokens
    are delivered), the requests of the failed step end with an error, and the engine serves the
    next request exactly. A sampling failure there falls back to the synchronous sampler: the
    tokens are unchanged."""
    model_dir, hf = moe
    ps = prompts(3, seed=19)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), async_scheduling=True, **KW)
    engine, runner = llm.engine, llm.engine.runner
    execute, calls = runner.execute, []

    def flaky(batch, pending=None):  # noqa: ANN001, ANN202
        calls.append(pending is not None)
        if sum(calls) == 5 and pending is not None:
            raise RuntimeError("injected failure")
        return execute(batch, pending)

    runner.execute = flaky
    outs = llm.generate(ps[:2], greedy)
    assert [o.finish_reason for o in outs] == ["error", "error"] and all("injected failure" in o.error for o in outs)
    assert all(0 < len(o.token_ids) < 20 for o in outs)
    assert [o.token_ids for o in outs] == [reference(hf, p, 20)[: len(o.token_ids)] for p, o in zip(ps, outs)]
    assert llm.generate([ps[2]], greedy)[0].token_ids == reference(hf, ps[2], 20)
    runner.execute = execute

    sample, failures = engine.sampler.sample, []

    def flaky_sample(logits, requests, pending=None):  # noqa: ANN001, ANN202
        if pending is not None and not failures:
            failures.append(1)
            raise RuntimeError("injected sampling failure")
        return sample(logits, requests, pending)

    engine.sampler.sample = flaky_sample
    before = engine.num_async_steps
    outs = llm.generate(ps[:2], greedy)
    assert failures and engine.num_async_steps > before
    assert [o.token_ids for o in outs] == [reference(hf, p, 20) for p in ps[:2]]
