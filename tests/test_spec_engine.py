"""N-gram speculative decoding through the engine: lossless against the non-speculative engine,
with mixed K in one batch, stops inside accepted drafts, prefix hits, chunked prefill, preemption;
KV rollback; metrics; config errors."""

import json
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.cli import build_configs, build_parser
from tandem.config import SpecConfig
from tandem.engine.engine import LLMEngine
from tiny_models import save_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
THINK, TOOL_CALL = "<think>", "<tool_call>"  # added tokens of the test tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("moe")
    save_tiny_model(d, "qwen3_moe", seed=1)
    return d


@pytest.fixture(scope="module")
def plain(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB")


def make(model_dir: Path, spec: dict | str | None = None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "32MiB")
    return LLM(str(model_dir), device="cpu", speculative_config=NGRAM if spec is None else spec, **kw)


def repetitive(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a short random phrase said four times: n-gram lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (length,), generator=g).tolist() * 4 for length in (7, 11, 5, 13, 9, 6)[:n]]


def counter(eng: LLMEngine, name: str, **labels: str) -> float:
    """Sum of a spec counter over its phases (and positions), or over the labels given."""
    total = 0.0
    for metric in eng.metrics.registry.collect():
        for s in metric.samples:
            if s.name == f"tandem:{name}_total" and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_drafted_and_accepted(eng: LLMEngine) -> None:
    assert counter(eng, "spec_decode_num_drafts") > 0
    assert counter(eng, "spec_decode_num_accepted_tokens") > 0


def assert_all_free(eng: LLMEngine) -> None:
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_unfinished
    assert len(eng.spec.proposer) == 0 and not eng.spec._tracked


def record_drafts(eng: LLMEngine, monkeypatch) -> list[list[int]]:
    """Each step's draft lengths, in batch order (None for a request that does not sample)."""
    steps: list[list[int]] = []
    execute = eng.runner.execute

    def spy(batch):  # noqa: ANN001, ANN202
        steps.append([len(s.draft) if s.samples else None for s in batch])
        return execute(batch)

    monkeypatch.setattr(eng.runner, "execute", spy)
    return steps


def deltas(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    eng.add_request("probe", prompt, params)
    out = []
    while eng.has_unfinished:
        out += [o.new_token_ids for o in eng.step()]
    return out


def inside_a_draft(chunks: list[list[int]]) -> list[int]:
    """Output positions whose token is the first occurrence of its id and came in a multi-token
    delta without being its last token (stopping there cuts the tokens after it in that step)."""
    seen, pos, out = set(), 0, []
    for chunk in chunks:
        for j, t in enumerate(chunk):
            if t not in seen and j < len(chunk) - 1:
                out.append(pos)
            seen.add(t)
            pos += 1
    return out


# ---- lossless greedy ----------------------------------------------------------------------------


def test_mixed_k_batch_is_token_identical(model_dir, plain, monkeypatch):
    # Phase decides K: a prompt ending in <think> reasons (K=1), one ending in <tool_call> is in
    # a tool call (K=0: no drafting), the rest are content (Kmax = 3).
    spec = dict(NGRAM, adaptive="phase", phase_k={"reasoning": 1, "tool_call": 0})
    llm = make(model_dir, spec)
    tok = llm.tokenizer
    ps = repetitive(5)
    ps[1] = ps[1] + [tok.token_to_id(THINK)]
    ps[3] = ps[3] + [tok.token_to_id(TOOL_CALL)]
    steps = record_drafts(llm.engine, monkeypatch)
    got = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(ps, GREEDY)]
    eng = llm.engine
    assert_drafted_and_accepted(eng)
    assert counter(eng, "spec_decode_num_drafts", phase="reasoning") > 0
    assert counter(eng, "spec_decode_num_drafts", phase="tool_call") == 0
    # One step verified drafts of different lengths next to a request decoding one token.
    assert any(len({k for k in s if k is not None}) >= 3 and 0 in s for s in steps)
    assert max(k for s in steps for k in s if k is not None) == 3
    assert counter(eng, "spec_decode_num_accepted_tokens_per_pos", position="0") > 0
    assert_all_free(eng)


def test_stop_token_eos_stop_string_and_max_tokens_inside_a_draft(model_dir, plain):
    llm = make(model_dir)
    eng, ref_eng = llm.engine, plain.engine
    # The prompt holds a phrase, the model's own continuation of it, then the phrase again: the
    # n-gram draft proposes that continuation, so the model accepts tokens it has not output yet.
    p = repetitive(1, seed=2)[0]
    p = p + plain.generate([p], GREEDY)[0].token_ids[:24] + p
    chunks = deltas(eng, p, GREEDY)
    free = [t for c in chunks for t in c]
    assert free == plain.generate([p], GREEDY)[0].token_ids
    cuts = inside_a_draft(chunks)
    assert cuts, "no token inside an accepted draft: the test would prove nothing"
    pos = cuts[len(cuts) // 2]

    def same(params: SamplingParams) -> None:
        a, b = llm.generate([p], params)[0], plain.generate([p], params)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)

    same(SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(free[pos],)))
    assert len(llm.generate([p], SamplingParams(max_tokens=48, temperature=0.0,
                                                stop_token_ids=(free[pos],)))[0].token_ids) == pos + 1
    same(SamplingParams(max_tokens=pos + 1, temperature=0.0, ignore_eos=True))
    # EOS: the model's argmax hits it inside the draft.
    saved = eng.tokenizer.eos_token_ids, ref_eng.tokenizer.eos_token_ids
    try:
        eng.tokenizer.eos_token_ids = ref_eng.tokenizer.eos_token_ids = frozenset({free[pos]})
        same(SamplingParams(max_tokens=48, temperature=0.0))
        out = llm.generate([p], SamplingParams(max_tokens=48, temperature=0.0))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == pos + 1
    finally:
        eng.tokenizer.eos_token_ids, ref_eng.tokenizer.eos_token_ids = saved
    # A stop string starting in text a draft produced (excluded and included).
    text = plain.generate([p], GREEDY)[0].text
    prefix = llm.tokenizer.decode(free[:pos])
    stop = text[len(prefix) : len(prefix) + 2]
    assert len(stop) == 2 and text.index(stop) == len(prefix)
    for include in (False, True):
        same(SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=(stop,),
                            include_stop_str_in_output=include))
    assert llm.generate([p], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                            stop=(stop,)))[0].finish_reason == "stop"
    assert_drafted_and_accepted(eng)
    assert_all_free(eng)


def test_prefix_hits_and_chunked_prefill_stay_identical(model_dir, monkeypatch):
    ps = repetitive(4, seed=1)
    ref = LLM(str(model_dir), device="cpu", kv_cache_memory="32MiB").generate(ps, GREEDY)
    # A 16-token budget: prompts are prefilled in chunks next to requests verifying drafts.
    llm = make(model_dir, max_num_batched_tokens=16)
    steps = record_drafts(llm.engine, monkeypatch)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == [o.token_ids for o in ref]
    assert any(None in s and any(k for k in s if k) for s in steps)  # a prefill chunk beside a draft
    again = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in again) > 0
    # The output of the first round is cached too (its blocks were complete and accepted): a
    # prompt extending one with its output hits past the original prompt.
    longer = ps[0] + ref[0].token_ids[:32]
    hit = llm.generate([longer], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert hit.num_cached_tokens > len(ps[0]) // 16 * 16
    assert_drafted_and_accepted(llm.engine)
    assert_all_free(llm.engine)


def test_preemption_recompute_stays_identical(model_dir):
    ps = repetitive(4, seed=2)
    kv_bytes = 24 * 16 * 2 * 2 * 16 * 4 * 2  # 24 blocks of 16 tokens (see test_engine)
    common = {"kv_cache_memory": kv_bytes, "max_model_len": 192, "enable_prefix_caching": False}
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ref = LLM(str(model_dir), device="cpu", **common).generate(ps, params)
    llm = make(model_dir, **common)
    assert [o.token_ids for o in llm.generate(ps, params)] == [o.token_ids for o in ref]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drafted_and_accepted(llm.engine)
    assert_all_free(llm.engine)


def test_logprobs_are_the_targets(model_dir, plain):
    p = repetitive(1, seed=4)[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = make(model_dir)
    a, b = llm.generate([p], params)[0], plain.generate([p], params)[0]
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 24
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.chosen.token_id == y.chosen.token_id and abs(x.chosen.logprob - y.chosen.logprob) < 1e-4
        assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
    assert_drafted_and_accepted(llm.engine)


def test_abort_mid_draft_frees_everything(model_dir):
    eng = make(model_dir).engine
    eng.add_request("x", repetitive(1)[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while counter(eng, "spec_decode_num_drafts") == 0:
        eng.step()
    assert eng.has_unfinished
    assert eng.abort("x").finish_reason == "abort"
    assert_all_free(eng)


# ---- sampling -----------------------------------------------------------------------------------


def test_seeded_sampling_with_speculation_is_reproducible(model_dir):
    ps = repetitive(3, seed=5)
    params = [SamplingParams(max_tokens=32, temperature=0.3, top_k=20, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        llm = make(model_dir)
        runs.append([o.token_ids for o in llm.generate(ps, params)])
        assert_drafted_and_accepted(llm.engine)
        assert_all_free(llm.engine)
    assert runs[0] == runs[1]
    assert all(len(t) == 32 for t in runs[0])


# ---- K policy, metrics, config ------------------------------------------------------------------


def test_phase_policy_picks_k_from_the_generated_phase(model_dir):
    spec = dict(NGRAM, adaptive="phase", phase_k={"reasoning": 1, "content": 2})
    eng = make(model_dir, spec).engine
    tok = eng.tokenizer
    req = eng.new_request("r", [11, 12, tok.token_to_id(THINK)], SamplingParams(max_tokens=20))
    assert eng.spec.choose_k(req) == 1 and eng.spec.phase(req) == "reasoning"
    req.output_token_ids += [40, tok.token_to_id("</think>"), 41]
    assert eng.spec.choose_k(req) == 2 and eng.spec.phase(req) == "content"
    req.output_token_ids += [tok.token_to_id(TOOL_CALL)]
    assert eng.spec.choose_k(req) == 3  # tool_call is not listed: Kmax
    # An old </think> in the prompt does not switch: only generated tokens (and the trailing marker) do.
    old = eng.new_request("o", [tok.token_to_id(THINK), tok.token_to_id("</think>"), 5, tok.token_to_id(THINK)],
                          SamplingParams(max_tokens=20))
    assert eng.spec.choose_k(old) == 1
    # K never reaches past max_tokens: the draft plus the token after it must fit.
    short = eng.new_request("s", [11, 12], SamplingParams(max_tokens=2))
    assert eng.spec.choose_k(short) == 1
    short.output_token_ids.append(7)
    assert eng.spec.choose_k(short) == 0


def test_stats_line_has_spec_decoding_part(model_dir, plain):
    llm = make(model_dir)
    llm.generate(repetitive(2), GREEDY)
    line = llm.engine.stats_line()
    assert "SpecDecoding metrics: Mean acceptance length: " in line and "Per-position acceptance rate: " in line
    drafted = counter(llm.engine, "spec_decode_num_draft_tokens")
    assert f"Drafted: {int(drafted)} tokens" in line
    assert "SpecDecoding" not in llm.engine.stats_line()  # a new window with no drafts
    plain.generate(repetitive(1), GREEDY)
    assert "SpecDecoding" not in plain.engine.stats_line()


def test_good_configs_parse():
    c = SpecConfig.parse(json.dumps(dict(NGRAM, prompt_lookup_max=4, adaptive="phase", phase_k={"reasoning": 1})))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 1, 4)
    assert c.max_k == 3 and c.k_for("reasoning") == 1 and c.k_for("content") == 3
    assert SpecConfig.parse(None).max_k == 0 and not SpecConfig.parse(None).enabled
    assert SpecConfig.parse(None, max_k=2).max_k == 2  # graphs only, no speculation
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}).prompt_lookup_max == 5


@pytest.mark.parametrize(("config", "key"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "foo": 1}, "unknown key 'foo'"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of"),
    ({"num_speculative_tokens": 3}, "method must be one of"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "'mtp' is reserved for DeepSeek-V4"),
    ({"method": "ngram"}, "num_speculative_tokens (Kmax) is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 8]"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens must be an integer in [1, 8]"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be at most prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "goodput"}, "adaptive must be 'off', 'phase' or 'auto'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "phase_k": {"content": 1}}, 'phase_k needs "adaptive"'),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "phase", "phase_k": {"answer": 1}},
     "unknown phase 'answer'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "phase", "phase_k": {"content": 3}},
     "phase_k.content must be an integer in [0, 2]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "phase", "phase_k": [1, 2]}, "phase_k must be"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_configs_fail_with_one_line_naming_the_key(model_dir, config, key):
    text = config if isinstance(config, str) else json.dumps(config)
    for build in (lambda: SpecConfig.parse(config), lambda: LLM(str(model_dir), device="cpu",
                                                                 speculative_config=config)):
        with pytest.raises(ValueError) as e:
            build()
        message = str(e.value)
        assert key in message and "\n" not in message and message.startswith("--speculative-config")
    args = build_parser().parse_args(["serve", str(model_dir), "--device", "cpu", "--speculative-config", text])
    with pytest.raises(ValueError, match="--speculative-config"):
        build_configs(args, str(model_dir))


def test_serve_flag_maps_to_the_engine_config(model_dir):
    args = build_parser().parse_args(["serve", str(model_dir), "--device", "cpu",
                                      "--speculative-config", json.dumps(NGRAM)])
    engine_cfg, _ = build_configs(args, str(model_dir))
    assert engine_cfg.spec.method == "ngram" and engine_cfg.spec.max_k == 3
    args = build_parser().parse_args(["serve", str(model_dir), "--device", "cpu"])
    assert not build_configs(args, str(model_dir))[0].spec.enabled


@pytest.mark.parametrize("spec, extra", [({"method": "ngram", "num_speculative_tokens": 3}, ()),
                                         ({"method": "dspark", "num_speculative_tokens": 3}, ("--async-scheduling",))],
                         ids=["ngram", "dspark-steps-ahead"])
def test_tandem_serve_with_speculation_end_to_end(spec, extra):
    """A real `tandem serve --speculative-config` (n-gram with synchronous steps; DSpark with its
    verify steps going ahead): streamed and non-streamed greedy answers agree, usage counts the
    streamed tokens, and the spec_decode counters in /metrics move."""
    import httpx

    from serve_proc import start_serve

    proc, url = start_serve("tandem-demo", "--device", "cpu", "--kv-cache-memory", "256MiB",
                            "--speculative-config", json.dumps(spec), *extra)
    try:
        body = {"model": "tandem-demo", "max_tokens": 120, "temperature": 0,
                "messages": [{"role": "user", "content": "Sort these numbers: 41, 7, 93, 18, 66, 25"}]}
        whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        streamed = "".join(d.get("reasoning_content") or "" for d in deltas) + "".join(d.get("content") or "" for d in deltas)
        message = whole["choices"][0]["message"]
        assert streamed == (message["reasoning_content"] or "") + (message["content"] or "")
        usage = events[-1]["usage"]  # the second request hits the prefix cache: cached_tokens differ
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"],
                                                                        whole["usage"]["completion_tokens"])
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        drafted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("tandem:spec_decode_num_draft_tokens_total{"))
        accepted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("tandem:spec_decode_num_accepted_tokens_total{"))
        assert drafted > 0 and accepted > 0
        # Fewer deltas than tokens: accepted drafts arrive several tokens at a time.
        assert len(deltas) < whole["usage"]["completion_tokens"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_k_changes_are_logged_at_info_at_most_once_a_second(model_dir, caplog):
    import logging

    from tandem.spec.controller import K_LOG_INTERVAL_S

    spec = dict(NGRAM, adaptive="phase", phase_k={"reasoning": 1, "content": 2, "tool_call": 3})
    eng = make(model_dir, spec).engine
    tok = eng.tokenizer
    req = eng.new_request("r", [11, 12, tok.token_to_id(THINK)], SamplingParams(max_tokens=50))

    def generated(*tokens: int) -> None:  # as if the request kept these tokens and is ready to decode
        req.output_token_ids.extend(tokens)
        req.num_computed_tokens = req.num_tokens - 1

    generated()
    with caplog.at_level(logging.INFO, logger="tandem"):
        eng.spec.propose([req])  # the first K (1, reasoning): no change to report
        generated(40, tok.token_to_id("</think>"))
        eng.spec.propose([req])  # 1 -> 2
        generated(tok.token_to_id(TOOL_CALL))
        eng.spec.propose([req])  # 2 -> 3 within the interval: DEBUG only
        eng.spec._last_k_log -= K_LOG_INTERVAL_S
        generated(tok.token_to_id("</tool_call>"))
        eng.spec.propose([req])  # 3 -> 2 after the interval: INFO, counting the unlogged one
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and ": K " in r.getMessage()]
    assert info == ["request r: K 1 -> 2 (phase=content)",
                    "request r: K 3 -> 2 (phase=content) (+1 more K changes since the last line)"]
