"""Speculation with async scheduling: a step the K policy drafts nothing for (adaptive auto at
K = 0, a `phase_k` of 0) goes ahead of the step in flight like a step without speculation, the
proposer catching up on it at launch; the steps that draft run synchronously. Greedy tokens stay
those of the engine without speculation, the drafter's state stays usable across the switch, and
the controller learns what a step at K = 0 costs with its host work overlapped."""

import sys
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.engine import HELD_STEPS_TIMED
from tandem.spec.goodput import hand_cost

sys.path.insert(0, str(Path(__file__).parent))
from test_spec_drafters import COMMON, DEMO, GREEDY, QUESTIONS  # noqa: E402
from test_spec_auto import seed_every_phase, tiny_dir  # noqa: E402, F401 - tiny_dir: the fixture
from test_spec_engine import NGRAM, THINK, counter, repetitive  # noqa: E402

AUTO = {"adaptive": "auto"}


@pytest.fixture(scope="module")
def demo_prompts() -> tuple[list[list[int]], list[list[int]]]:
    from tandem.server.chat_template import ChatTemplate

    llm = LLM(str(DEMO), **COMMON)
    tok = llm.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    ids = [tok.encode(template.render([{"role": "user", "content": q}], kwargs={})) for q in QUESTIONS[:3]]
    return ids, [o.token_ids for o in llm.generate(ids, GREEDY)]


def never_pays(auto) -> None:
    """Make drafting cost ten steps a verify token, with evidence in every phase that nothing is
    accepted (no probe for want of evidence)."""
    auto.cost = hand_cost({b: {1: 1.0, 2: 10.0, 3: 20.0, 4: 30.0} for b in auto.cost.buckets},
                          plain_overlaps=auto.cost.plain_overlaps)
    seed_every_phase(auto, accepted=0)


def pays(auto) -> None:
    """Make a verify token nearly free, and forget the evidence against drafting."""
    auto.cost = hand_cost({b: {1: 1.0, 2: 1.01, 3: 1.02, 4: 1.03} for b in auto.cost.buckets},
                          plain_overlaps=auto.cost.plain_overlaps)
    auto.stats = type(auto.stats)(auto.max_k)
    auto._choice.clear()  # searched again at once


def test_dspark_auto_goes_ahead_at_k0_then_drafts_from_windows_kept_by_the_steps_ahead(demo_prompts):
    """DSpark's windows of target hidden states are filled only by the steps ahead (prefill and
    decode at K = 0) until drafting starts to pay mid-request: its drafts then come from those
    windows, are accepted, and the tokens stay the reference's."""
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "dspark", "num_speculative_tokens": 3, **AUTO},
              async_scheduling=True, **COMMON)
    eng = llm.engine
    assert eng.async_scheduling and eng.spec.auto.cost.plain_overlaps
    never_pays(eng.spec.auto)
    for i, p in enumerate(ids):
        eng.add_request(f"r{i}", p, GREEDY)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ids))}
    steps = 0
    while eng.has_unfinished:
        steps += 1
        if steps == 20:
            assert counter(eng, "spec_decode_num_drafts") == 0 and eng.num_async_steps >= 15
            pays(eng.spec.auto)
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert list(got.values()) == ref
    assert counter(eng, "spec_decode_num_drafts") > 0 and counter(eng, "spec_decode_num_accepted_tokens") > 0
    assert eng.kv.usage == 0.0 and len(eng.spec.proposer) == 0


def test_auto_times_the_steps_ahead_and_learns_their_cost(demo_prompts):
    """The steps at K = 0 that went ahead are timed from the previous step's results: the cost
    model learns a residual for plain steps of its own (before one is seen it takes 0 with async
    scheduling, the other kind's without)."""
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "dspark", "num_speculative_tokens": 2, **AUTO},
              async_scheduling=True, **COMMON)
    auto = llm.engine.spec.auto
    never_pays(auto)
    auto.cost.residual[(1, True)] = 5.0  # drafting steps' host work: not what a step ahead costs
    assert auto.cost.learned([0]) == 0.0
    auto.cost.plain_overlaps = False
    assert auto.cost.learned([0]) == 5.0
    auto.cost.plain_overlaps = True
    timed = counter(llm.engine, "spec_decode_timed_steps")
    out = llm.generate(ids[:1], GREEDY)
    assert out[0].token_ids == ref[0]
    assert llm.engine.num_async_steps > 20
    # Steps are timed one in HELD_STEPS_TIMED once their kind was seen enough; every one before.
    assert counter(llm.engine, "spec_decode_timed_steps") - timed >= llm.engine.num_async_steps // HELD_STEPS_TIMED
    assert (1, False) in auto.cost.residual  # learned from the steps ahead


def test_a_batch_held_at_k0_repeats_without_a_look_until_its_requests_change(demo_prompts, monkeypatch):
    """While auto holds a batch at K = 0 and the scheduler's running set stays the same, a step
    ahead takes a step of the hold without looking at the batch (`SpecDecoder.repeat_zero`):
    `plan_ahead` runs once per hold, not once per step. A request that arrives ends that at once
    (it is looked at, and searched, with the others). Tokens unchanged."""
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "draft_model", "num_speculative_tokens": 2, **AUTO},
              async_scheduling=True, **COMMON)
    eng = llm.engine
    spec = eng.spec
    never_pays(spec.auto)
    looks: list[tuple[int, int]] = []  # (async steps so far, requests looked at)
    plan_ahead = spec.plan_ahead
    monkeypatch.setattr(spec, "plan_ahead", lambda reqs, changes=None: looks.append(
        (eng.num_async_steps, len(reqs))) or plan_ahead(reqs, changes))
    eng.add_request("r0", ids[0], GREEDY)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    arrived = None
    while eng.has_unfinished:
        if arrived is None and len(got["r0"]) >= 40:
            arrived = eng.num_async_steps
            eng.add_request("r1", ids[1], GREEDY)
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert list(got.values()) == ref[:2]
    alone = [at for at, n in looks if at < arrived]
    assert arrived >= 30 and len(alone) <= arrived // 8, (arrived, alone)
    assert any(n == 2 and at <= arrived + 4 for at, n in looks), looks  # r1 seen with r0 within steps


def test_draft_model_auto_catches_up_after_steps_ahead(demo_prompts):
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "draft_model", "num_speculative_tokens": 2, **AUTO},
              async_scheduling=True, **COMMON)
    eng = llm.engine
    never_pays(eng.spec.auto)
    for i, p in enumerate(ids[:2]):
        eng.add_request(f"r{i}", p, GREEDY)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    steps = 0
    while eng.has_unfinished:
        steps += 1
        if steps == 12:
            pays(eng.spec.auto)
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert list(got.values()) == ref[:2]
    assert eng.num_async_steps >= 8 and counter(eng, "spec_decode_num_accepted_tokens") > 0


def test_phase_k_of_zero_goes_ahead_and_a_request_that_drafts_runs_synchronously(tiny_dir):
    """ngram with `phase_k` 0 for content: requests in content decode ahead; a request reasoning
    (its prompt opened <think>) drafts at 2 and its steps with a draft run synchronously. Tokens
    unchanged."""
    prompts = repetitive(3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(str(tiny_dir), device="cpu", kv_cache_memory="32MiB").generate(prompts, params)
    spec = dict(NGRAM, adaptive="phase", phase_k={"content": 0, "reasoning": 2, "tool_call": 0})
    llm = LLM(str(tiny_dir), device="cpu", kv_cache_memory="32MiB", speculative_config=spec, async_scheduling=True)
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert llm.engine.num_async_steps > 30 and counter(llm.engine, "spec_decode_num_drafts") == 0
    think = llm.tokenizer.token_to_id(THINK)
    mixed = [prompts[0], prompts[1] + [think]]
    ref = LLM(str(tiny_dir), device="cpu", kv_cache_memory="32MiB").generate(mixed, params)
    before = llm.engine.num_async_steps
    out = llm.generate(mixed, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert counter(llm.engine, "spec_decode_num_drafts") > 0  # the reasoning request drafted
    # Steps with a draft to verify waited for the tokens; those where the lookup found nothing
    # (nothing to verify) went ahead.
    drafted_steps = counter(llm.engine, "spec_decode_num_drafts")
    assert 0 < llm.engine.num_async_steps - before <= 41 - drafted_steps


def test_the_choice_plan_ahead_makes_is_the_one_the_next_propose_drafts_at(tiny_dir):
    """When the policy drafts for the step after the one in flight, that step waits for the
    tokens, and drafts at the K chosen then: the controller is not asked twice (a probe it
    chose would be lost, its step counters counted twice)."""
    llm = LLM(str(tiny_dir), device="cpu", kv_cache_memory="32MiB", speculative_config=dict(NGRAM, **AUTO),
              async_scheduling=True)
    spec = llm.engine.spec
    asked: list[list[int]] = []

    def choose(ids, phases, limits):
        asked.append(list(limits))
        return [min(2, limit) for limit in limits]

    spec.auto.choose = choose
    req = llm.engine.new_request("r", repetitive(1)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    req.num_computed_tokens = req.num_tokens  # its last token is in flight
    assert not spec.plan_ahead([req])
    assert asked == [[18]]  # room for the draft and the token after it, less the token in flight
    req.output_token_ids.append(req.prompt_token_ids[0])  # that token lands
    req.num_computed_tokens = req.num_tokens - 1
    drafts = spec.propose([req])
    assert len(asked) == 1 and spec.chosen_k == [("content", 2)]
    assert len(drafts["r"].tokens) == 2  # the phrase repeats: the lookup finds two tokens


def test_a_held_k_choice_is_counted_once_per_run_of_repeats(demo_prompts):
    """auto's held all-zero choice keeps the same K counts object step after step: its repeats are
    counted in one go (at the next other choice, the stats line, or when the engine runs dry), and
    the totals are those of counting every step."""
    from collections import Counter

    llm = LLM(str(DEMO), speculative_config={"method": "dspark", "num_speculative_tokens": 2, **AUTO},
              async_scheduling=True, **COMMON)
    eng = llm.engine

    def k0() -> float:
        return sum(s.value for m in eng.metrics.registry.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("k") == "0" and s.labels.get("phase") == "content")

    start = k0()
    held = Counter({("content", 0): 3})
    eng.spec.k_counts = held
    for _ in range(5):
        eng._count_spec_step()
    assert k0() - start == 3  # the first step counted, four repeats waiting
    eng.spec.k_counts = Counter({("content", 0): 2})  # another choice: the repeats are counted first
    eng._count_spec_step()
    assert k0() - start == 5 * 3 + 2
    eng.spec.k_counts = held
    for _ in range(3):
        eng._count_spec_step()
    eng.stats_line()  # the stats line counts what waits
    assert k0() - start == 5 * 3 + 2 + 3 * 3


def test_a_step_ahead_carries_the_drafters_prompt_work_to_its_landing_and_is_not_a_plain_steps_cost(
        demo_prompts, monkeypatch):
    # A draft model fed a prompt chunk when a plain step went ahead (`_observe` at its launch):
    # that work is queued before the step's sampling, so the step's landing waits for it. The
    # flag goes with the step (`InFlightStep.drafter_prefilled`), and its time refines what
    # leaving K = 0 costs, not the plain steps' cost (learned as one, at 16 requests it made
    # K = 0 look dearer than drafting on the H100 box).
    import tandem.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "HELD_STEPS_TIMED", 1)
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "draft_model", "num_speculative_tokens": 3, **AUTO},
              async_scheduling=True, **COMMON)
    eng, spec = llm.engine, llm.engine.spec
    never_pays(spec.auto)
    observe = spec.observe

    def prompt_work_on_every_launch(sched, accepted, aux):  # as if each plain step fed a prompt chunk
        observe(sched, accepted, aux)
        spec._drafter_prefilled = True

    monkeypatch.setattr(spec, "observe", prompt_work_on_every_launch)
    landed, caught_up = [], []
    time_step = eng._time_step
    monkeypatch.setattr(eng, "_time_step", lambda sched, since, drafted=None, prefilled=None: (
        landed.append(prefilled), time_step(sched, since, drafted, prefilled))[-1])
    catch_up = spec.auto.observe_catch_up
    monkeypatch.setattr(spec.auto, "observe_catch_up", lambda *a: caught_up.append(a) or catch_up(*a))
    out = llm.generate(ids[:1], GREEDY)
    assert out[0].token_ids == ref[0]
    assert eng.num_async_steps > 10 and landed.count(True) > 10  # the steps ahead carried it
    assert len(caught_up) > 10
    assert not any(not drafting for _, drafting in spec.auto.cost.observed)  # no plain step learned
    # The same steps without the prompt work are plain steps' cost.
    monkeypatch.setattr(spec, "observe", observe)
    llm.generate(ids[1:2], GREEDY)
    assert any(not drafting for _, drafting in spec.auto.cost.observed)


def test_a_step_landing_while_a_prompt_step_launches_is_not_a_plain_steps_cost(demo_prompts, monkeypatch):
    # A step ahead lands in the call that launches the next one, and its time (from the last
    # landing) holds that launch: a new request's prompt chunk staged, run and fed to a draft
    # model. That is no plain step's cost (learned as one, it made K = 0 look dear at 16
    # requests on the H100 box). Here each prompt forward sleeps 0.8 s: no plain step auto
    # learns from may hold one.
    import time

    import tandem.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "HELD_STEPS_TIMED", 1)
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "draft_model", "num_speculative_tokens": 3, **AUTO},
              **{**COMMON, "async_scheduling": True, "max_num_seqs": 2})
    eng, auto = llm.engine, llm.engine.spec.auto
    never_pays(auto)
    execute, ahead_prompts = eng.runner.execute, []

    def slow_prompts(batch, pending=None):  # noqa: ANN001, ANN202 - the runner's own
        if any(s.num_tokens > 1 and not s.draft for s in batch):
            ahead_prompts.append(pending is not None)
            time.sleep(0.8)
        return execute(batch, pending)

    monkeypatch.setattr(eng.runner, "execute", slow_prompts)
    plain = []
    observe_step = auto.observe_step
    monkeypatch.setattr(auto, "observe_step", lambda ks, drafted, seconds: (
        plain.append(seconds) if not any(ks) else None, observe_step(ks, drafted, seconds))[-1])
    out = llm.generate(ids[:4], GREEDY)
    assert [o.token_ids for o in out] == ref[:4]
    assert any(ahead_prompts), ahead_prompts  # a prompt chunk went ahead of a step in flight
    assert len(plain) > 10 and max(plain) < 0.6, sorted(plain)[-3:]


def test_steps_are_timed_one_in_held_steps_timed_across_k_changes(demo_prompts, monkeypatch):
    # The cost model learns from a sample of steps once their kind (batch bucket, drafting or
    # not) is known, counted across changes of the K counts: timing every step after a change
    # timed mostly the steps that hold the change's own host work (at 8-16 requests the batch
    # changes every few steps). Here every step is a change.
    ids, ref = demo_prompts
    llm = LLM(str(DEMO), speculative_config={"method": "draft_model", "num_speculative_tokens": 2, **AUTO},
              async_scheduling=True, **COMMON)
    eng, spec = llm.engine, llm.engine.spec
    never_pays(spec.auto)
    for bucket in spec.auto.cost.buckets:  # every kind of step known already
        spec.auto.cost.observed[(bucket, False)] = spec.auto.cost.observed[(bucket, True)] = 100
    count_spec_step = eng._count_spec_step

    def every_step_a_change() -> None:
        eng._k_seen = None
        count_spec_step()

    monkeypatch.setattr(eng, "_count_spec_step", every_step_a_change)
    eligible, given = [], []
    time_step, observe_step = eng._time_step, spec.observe_step
    monkeypatch.setattr(eng, "_time_step", lambda sched, since, drafted=None, prefilled=None: (
        eligible.append(since is not None), time_step(sched, since, drafted, prefilled))[-1])
    monkeypatch.setattr(spec, "observe_step", lambda *a, **k: given.append(1) or observe_step(*a, **k))
    out = llm.generate(ids[:2], GREEDY)
    assert [o.token_ids for o in out] == ref[:2]
    n = sum(eligible)
    assert n > 4 * HELD_STEPS_TIMED and len(given) <= n // HELD_STEPS_TIMED + 2, (n, len(given))
