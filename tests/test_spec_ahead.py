"""Speculative steps that go ahead (tandem/engine/spec_ahead.py): the device-side pieces against
their host-side counterparts (the graph inputs shifted on the device vs staged exactly, greedy
acceptance, DSpark's ring), and the engine with DSpark and async scheduling against the engine
without speculation, token for token."""

import random
import sys
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.runner_ahead import AheadInputs
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.spec_ahead import SpecAheadStep, accept_on_device, accept_sampled_on_device
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import KVCacheSpec, group_layers
from tandem.spec.dspark_proposer import DSparkProposer
from tandem.spec.verify import accept_greedy

sys.path.insert(0, str(Path(__file__).parent))
from test_spec_drafters import COMMON, DEMO, QUESTIONS  # noqa: E402
from test_spec_engine import counter  # noqa: E402

BS = 4
FULL = KVCacheSpec("full", 1, 8, torch.float32)
FULL2 = KVCacheSpec("full", 2, 8, torch.float32)  # a second group: each has its own block table


class _EchoModel:
    """Stands in for the target: its hidden state is each row's (token, position), its aux rows
    the token; compute_logits is the identity."""

    def forward_with_aux(self, ids, pos, step, layers):
        self.seen = (ids.clone(), pos.clone(), step.seq_lens.clone())
        return torch.stack([ids, pos], dim=1).float(), ids[:, None].float().repeat(1, 3)

    def compute_logits(self, hidden):
        return hidden


class _Hooks:
    zero_row = 9

    def __init__(self, shift, known, drafts):
        self.given = (shift, known, drafts)

    def depth(self, q):
        return q - 1

    def before(self, meta, depth, sampled):
        shift, known, drafts = self.given
        return AheadInputs(shift, known, meta["start"] + shift, drafts[:, :depth])

    def after(self, q, logits, aux, inputs, meta, sampled):
        self.logits, self.aux = logits, aux


def full_runner(max_b: int, max_q: int) -> tuple[ModelRunner, KVCacheManager]:
    kv = KVCacheManager(group_layers([FULL, FULL2]), 64, BS, True)
    runner = ModelRunner(model=_EchoModel(), kv=kv, device=torch.device("cpu"), aux_layers=(0,))  # type: ignore[arg-type]
    runner._allocate_static(max_b, max_q, 16, ahead_rows=_Hooks.zero_row)
    runner.buckets = (1, 2, 4)
    return runner, kv


def test_a_step_ahead_stages_what_the_exact_step_stages_once_shifted_on_the_device():
    """What a step ahead's graph runs (`_ahead_body`, on the static inputs): requests staged as if
    the step in flight accepted nothing, then shifted by what it did accept, reach the target with
    the positions, lengths and slots of the step staged with the exact starts, and with their
    known tokens and drafts; pad rows and the padded batch row stay at the sinks."""
    runner, kv = full_runner(4, 4)
    bucket, q = 4, 4
    reqs, starts, shifts, ks = [], [9, 5, 22], [2, 0, 3], [3, 1, 2]
    for i, (start, shift, k) in enumerate(zip(starts, shifts, ks)):
        r = Request(f"r{i}", list(range(10, 10 + start)), SamplingParams())
        r.num_computed_tokens = start - 1
        assert kv.allocate_slots(r, 1 + 3 + k + 1)  # the step in flight (3 drafts at most), then this one
        reqs.append(r)
    known = torch.tensor([71, 72, 73, 0])
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]])
    exact = [ScheduledRequest(r, s + m, 1 + k, True, tuple(d[:k]), input_row=i)
             for i, (r, s, m, k, d) in enumerate(zip(reqs, starts, shifts, ks, drafts.tolist()))]
    runner._stage_inputs(exact, bucket, q)
    want = {name: t.clone() for name, t in (("pos", runner._pos), ("seq", runner._seq),
                                             ("slots0", runner._slots[0]), ("slots1", runner._slots[1]))}
    ahead = [ScheduledRequest(r, s, 1 + k, True, (0,) * k, input_row=i) for i, (r, s, k) in enumerate(zip(reqs, starts, ks))]
    meta = {"ahead/start": starts + [0], "ahead/ks": ks + [0], "ahead/slot": [1, 2, 3, 0], "ahead/pick": [0, 1, 2, 9]}
    runner._stage_inputs(ahead, bucket, q, meta)
    assert runner._static.device["ahead/pick"][:4].tolist() == [0, 1, 2, 9]
    hooks = _Hooks(torch.tensor(shifts + [0]), known, drafts)
    views = {f: runner._static.device[f"ahead/{f}"][:bucket] for f in ("start", "ks", "slot", "pick")}
    runner._ahead_body(bucket, q, hooks, views, runner._static_step(bucket, q), False)
    for name, got in (("pos", runner._pos), ("slots0", runner._slots[0]), ("slots1", runner._slots[1])):
        assert got[: bucket * q].tolist() == want[name][: bucket * q].tolist(), name
    assert runner._seq[:bucket].tolist() == want["seq"][:bucket].tolist()
    ids, pos, _ = runner.model.seen
    for i, k in enumerate(ks):
        assert ids[i * q : i * q + 1 + k].tolist() == [known[i].item()] + drafts[i, :k].tolist()
    assert pos.tolist() == want["pos"][: bucket * q].tolist()
    assert hooks.logits.shape == (bucket * q, 2) and hooks.aux.shape == (bucket * q, 3)


def test_acceptance_on_the_device_is_accept_greedy_row_by_row():
    rng = random.Random(0)
    for q in (1, 2, 4):
        n, vocab = 6, 5
        ks = [rng.randint(0, q - 1) for _ in range(n)]
        logits = torch.randn(n * q, vocab, generator=torch.Generator().manual_seed(q))
        target = logits.view(n, q, vocab).argmax(-1).tolist()
        # drafts that follow the target for a while, then not
        drafts = [[t if rng.random() < 0.7 else (t + 1) % vocab for t in row[: q - 1]] for row in target]
        accepted, tokens = accept_on_device(logits, torch.tensor(drafts) if q > 1 else None, torch.tensor(ks), q)
        for i in range(n):
            want, n_ok = accept_greedy(drafts[i][: ks[i]], target[i][: ks[i] + 1])
            assert accepted[i].item() == n_ok and tokens[i, : n_ok + 1].tolist() == want


def _total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_on_the_device_gives_the_targets_distribution(top_k):
    """Many independent rows of one verify (drafts drawn from the drafter's q, fresh noise per
    row): the first token is distributed as the target's p at row 0, the second, where a first
    draft was accepted, as p at row 1 (a wrong rule, e.g. accepting with p/q unclamped or
    drawing the correction from p, fails the bound); greedy rows in the same batch accept and
    correct as `accept_greedy`."""
    gen = torch.Generator().manual_seed(0)
    n, q, vocab, temp = 40000, 3, 6, 0.7
    base = torch.randn(q, vocab, generator=gen) * 1.5
    logits = base.repeat(n, 1)  # [n * q, V]
    drafter = torch.softmax(torch.randn(q - 1, vocab, generator=gen), dim=-1)  # q_j, unlike p
    drafts = torch.multinomial(drafter.repeat(n, 1), 1, generator=gen).view(n, q - 1)
    greedy = torch.zeros(n, dtype=torch.int64)
    greedy[:50] = 1
    sampling = {"temp": torch.where(greedy.bool(), 1.0, temp), "topk": torch.full((n,), top_k),
                "topp": torch.ones(n), "minp": torch.zeros(n), "greedy": greedy}
    uniform = torch.rand(n, q - 1, generator=gen)
    gumbel = -torch.empty(n, vocab).exponential_(generator=gen).log()
    gumbel[:50] = 0.0
    ks = torch.full((n,), q - 1)
    accepted, tokens = accept_sampled_on_device(logits, drafts, drafter.repeat(n, 1, 1), ks, q, sampling, uniform, gumbel)
    # The target's p per row, as the sampler computes it.
    from tandem.engine.sampler import filter_logits_batch

    p = torch.softmax(filter_logits_batch(base, torch.full((q,), temp), torch.full((q,), top_k), torch.ones(q),
                                          torch.zeros(q)), dim=-1)
    s = slice(50, None)
    assert _total_variation(tokens[s, 0], p[0]) < 0.015
    second = accepted[s] >= 1
    assert second.sum() > 5000 and _total_variation(tokens[s][second, 1], p[1]) < 0.02
    target = base.argmax(dim=-1).tolist()
    for i in range(50):
        want, n_ok = accept_greedy(drafts[i].tolist(), target)
        assert accepted[i].item() == n_ok and tokens[i, : n_ok + 1].tolist() == want


class _Cfg:
    block_size, window, target_layers, vocab_size = 4, 4, (0,), 50


class _EchoDrafter:
    """Drafts the window's rows back: draft j is the first feature of window row W - depth + j, so
    a test reads which rows the window held."""

    cfg = _Cfg()

    def draft_block(self, feats, known, depth, inv_temp=None, gumbel=None):
        return feats[:, -depth:, 0].long() + 1000 * known[:, None], None, None


def test_the_ring_kept_on_the_device_holds_the_windows_observe_keeps():
    """A request's rows written by `observe_ahead` (its kept rows at the device's positions, its
    rejected ones to slot 0) give the windows host-side `observe` would give: `draft_from_ring` reads
    them back."""
    host = DSparkProposer(_EchoDrafter(), 3, torch.device("cpu"), generator_for=lambda r: None)
    dev = DSparkProposer(_EchoDrafter(), 3, torch.device("cpu"), generator_for=lambda r: None)
    reqs = [Request(f"r{i}", list(range(20)), SamplingParams()) for i in range(2)]
    prompt = [ScheduledRequest(r, 0, 6 + 3 * i, True) for i, r in enumerate(reqs)]
    aux = torch.arange(15, dtype=torch.float32)[:, None].repeat(1, 2)  # row value = its index
    for p in (host, dev):
        p.observe(prompt, [6, 9], aux)
    base, q = [6, 9], 4
    for step, accepted in enumerate(([1, 3], [0, 2], [3, 0])):
        rows = torch.arange(2 * q, dtype=torch.float32)[:, None].repeat(1, 2) + 100 * (step + 1)
        ragged = torch.cat([rows[i * q : i * q + q] for i in range(2)])
        batch = [ScheduledRequest(r, b, q, True, (0,) * (q - 1)) for r, b in zip(reqs, base)]
        host.observe(batch, [1 + a for a in accepted], ragged)
        slots = torch.tensor(dev.ring_slots(reqs))
        dev.observe_ahead(slots, torch.tensor(base), torch.tensor(accepted), rows, q)
        for r, b, a in zip(reqs, base, accepted):
            dev.land_ahead(r.request_id, b, 1 + a)
        base = [b + 1 + a for b, a in zip(base, accepted)]
        known = torch.tensor([5, 6])
        got = dev.draft_from_ring(slots, torch.tensor(base), known, 4)[0]
        windows = host._gather([host._windows[r.request_id] for r in reqs])
        assert got.tolist() == (windows[:, :, 0].long() + 1000 * known[:, None]).tolist()
        for r, b in zip(reqs, base):
            r.num_computed_tokens = b
            assert dev.ready_ahead(r) and host._windows[r.request_id] == dev._windows[r.request_id]


# -- the engine ----------------------------------------------------------------------------------
G = SamplingParams(max_tokens=120, temperature=0.0)


@pytest.fixture(scope="module")
def prompts_and_reference() -> tuple[list[list[int]], list[list[int]]]:
    from tandem.server.chat_template import ChatTemplate

    llm = LLM(str(DEMO), **COMMON)
    tok = llm.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    ids = [tok.encode(template.render([{"role": "user", "content": q}], kwargs={})) for q in QUESTIONS]
    ids.append(ids[0])  # a prefix-cache hit
    return ids, [o.token_ids for o in llm.generate(ids, G)]


def dspark(policy: dict, **kw) -> LLM:
    spec = {"method": "dspark", "num_speculative_tokens": 4, **policy}
    return LLM(str(DEMO), speculative_config=spec, **{**COMMON, "async_scheduling": True, **kw})


@pytest.mark.parametrize("policy", [{"adaptive": "off"}, {"adaptive": "phase", "phase_k": {"reasoning": 1, "content": 3}},
                                    {"adaptive": "phase", "phase_k": {"reasoning": 0, "content": 2}},
                                    {"adaptive": "auto"}], ids=["off", "phase", "phase-with-k0", "auto"])
@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_dspark_steps_ahead_give_the_tokens_without_speculation(prompts_and_reference, policy, max_num_seqs):
    """Every policy (a phase at K = 0 mixes rows without drafts into the steps ahead, and hands
    over between plain steps ahead and speculative ones), with requests waiting for a seat (2) or
    all running at once (8), a prefix-cache hit and requests ending on EOS and on max_tokens
    inside a draft: the tokens are the reference's, most steps went ahead, and nothing is left in
    the KV cache or the ring."""
    ids, ref = prompts_and_reference
    llm = dspark(policy, max_num_seqs=max_num_seqs)
    eng = llm.engine
    assert eng._spec_ahead is not None
    got = [o.token_ids for o in llm.generate(ids, G)]
    assert got == ref
    assert counter(eng, "spec_decode_num_drafts") > 10 and counter(eng, "spec_decode_num_accepted_tokens") > 0
    steps = sum(eng.metrics.model_steps.labels(model_name=eng.model_name, mode=m)._value.get()
                for m in ("eager", "prefill", "cuda_graph"))
    assert eng.num_async_steps > steps / 2
    if policy["adaptive"] == "off":  # the drafter forwards inside the steps ahead are counted too
        assert counter(eng, "spec_decode_drafter_steps", mode="eager") > steps / 2
    assert eng.kv.usage == 0.0 and len(eng.spec.proposer) == 0
    if policy["adaptive"] == "auto":  # what auto expected of each draft, kept by the step until it landed
        predicted = counter(eng, "spec_decode_predicted_accepted_tokens")
        assert 0 < predicted <= 4 * counter(eng, "spec_decode_num_drafts")


def test_a_step_that_admits_a_prompt_drafts_nothing_and_goes_ahead(prompts_and_reference):
    """A request arriving while another decodes in steps ahead: the step that prefills it drafts
    nothing and goes ahead as a plain step (not a synchronous verify), the steps ahead resume
    after it for both, and the tokens are the reference's."""
    from tandem.engine.inflight import InFlightStep

    ids, ref = prompts_and_reference
    llm = dspark({"adaptive": "off"}, max_num_seqs=4)
    eng = llm.engine
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)

    eng.add_request("a", ids[0], G)
    while not isinstance(eng._in_flight, SpecAheadStep):
        step()
    step()
    assert isinstance(eng._in_flight, SpecAheadStep)
    drafted = counter(eng, "spec_decode_drafter_steps")
    eng.add_request("b", ids[1], G)
    step()  # lands the step ahead, then runs b's prompt beside a's decode: no drafts
    assert isinstance(eng._in_flight, InFlightStep)
    assert {s.request.request_id for s in eng._in_flight.sched.scheduled} == {"a", "b"}
    assert counter(eng, "spec_decode_drafter_steps") == drafted  # nothing drafted for that step
    step()
    assert counter(eng, "spec_decode_drafter_steps") == drafted + 1
    assert isinstance(eng._in_flight, SpecAheadStep)  # the steps ahead resume, b's included
    assert set(eng._in_flight.index) == {"a", "b"}
    while eng.has_unfinished:
        step()
    assert outs["a"] == ref[0] and outs["b"] == ref[1]
    assert eng.kv.usage == 0.0 and len(eng.spec.proposer) == 0


def test_a_stop_string_sampled_requests_and_an_abort_while_steps_go_ahead(prompts_and_reference):
    """A stop string inside an accepted draft cuts where it cuts without speculation; sampled
    requests (top-k and top-p among them) go ahead beside a greedy one, whose tokens stay the
    reference's, and a seeded one repeats its tokens run after run; a request with penalties
    makes its steps synchronous; a request aborted while a step ahead is in flight ends cleanly
    and the others go on."""
    ids, ref = prompts_and_reference
    plain = LLM(str(DEMO), **COMMON)
    stop = SamplingParams(max_tokens=120, temperature=0.0, stop=["4"])
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True),
               SamplingParams(max_tokens=40, temperature=1.0, top_k=5, top_p=0.9, seed=3, ignore_eos=True)]
    want_stop = plain.generate([ids[0]], stop)[0]
    llm = dspark({"adaptive": "off"})
    eng = llm.engine
    got_stop = llm.generate([ids[0]], stop)[0]
    assert (got_stop.token_ids, got_stop.text) == (want_stop.token_ids, want_stop.text)
    before = eng.num_async_steps
    outs = llm.generate([ids[2], ids[1], ids[3]], [G, *sampled])
    assert outs[0].token_ids == ref[2]
    assert [len(o.token_ids) for o in outs[1:]] == [40, 40]
    assert eng.num_async_steps - before > 10  # the sampled requests went ahead too
    again = dspark({"adaptive": "off"}).generate([ids[2], ids[1], ids[3]], [G, *sampled])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: the same draws
    penalised = SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3)
    before = eng.num_async_steps
    want_penalised = plain.generate([ids[1]], penalised)[0].token_ids
    assert llm.generate([ids[1]], penalised)[0].token_ids == want_penalised
    assert eng.num_async_steps - before <= 2  # verified synchronously (a plain step may go ahead)
    eng.add_request("a", ids[3], G)
    eng.add_request("b", ids[4], G)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert isinstance(eng._in_flight, SpecAheadStep)  # a speculative step ahead is in flight
    assert eng.abort("a") is not None
    while eng.has_unfinished:
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert got["b"] == ref[4] and got["a"] == ref[3][: len(got["a"])]
    assert eng.kv.usage == 0.0 and len(eng.spec.proposer) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", [{"adaptive": "off"}, {"adaptive": "auto"}], ids=["off", "auto"])
def test_on_cuda_graph_steps_ahead_replay_one_graph_and_give_the_synchronous_tokens(prompts_and_reference, policy):
    """On CUDA (bf16, graphs captured): each step ahead is one graph replay (the inputs shifted,
    DSpark drafting from its ring, the verify, the acceptance: nothing eager after start-up), and
    with `off` the tokens are those of the same engine stepping synchronously, but for the last
    2 * Kmax + 2 of each request: there a step ahead may verify fewer drafts (it leaves room for
    the largest outcome of the step in flight), a graph of another shape, whose bf16 logits may
    differ."""
    from test_gpu import _count

    ids, _ = prompts_and_reference
    cuda = {"device": "cuda", "dtype": "bfloat16", "kv_cache_memory": "512MiB", "max_num_seqs": 4}
    llm = dspark(policy, **cuda)
    eng = llm.engine
    assert eng._spec_ahead is not None and eng.runner.ahead_graphs
    got = [o.token_ids for o in llm.generate(ids, G)]
    assert _count(llm, "model_steps", "eager") == 0 and _count(llm, "spec_decode_drafter_steps", "eager") == 0
    assert eng.num_async_steps > 0.5 * _count(llm, "model_steps", "cuda_graph")
    assert counter(eng, "spec_decode_num_accepted_tokens") > 0
    assert eng.kv.usage == 0.0 and len(eng.spec.proposer) == 0
    if policy["adaptive"] == "off":
        want = [o.token_ids for o in dspark(policy, async_scheduling=False, **cuda).generate(ids, G)]
        tail = 2 * 4 + 2
        assert [g[: len(w) - tail] for g, w in zip(got, want)] == [w[:-tail] for w in want]


def test_steps_ahead_with_a_cache_too_small_for_every_request_preempt_and_recompute(prompts_and_reference):
    """With KV blocks for about two of the requests at once, a step ahead whose slots do not fit
    launches nothing (what it took goes back) and the synchronous step preempts: the tokens are
    still the reference's and nothing is left behind."""
    ids, ref = prompts_and_reference
    llm = dspark({"adaptive": "off"}, kv_cache_memory="3MiB", max_model_len=256, max_num_seqs=6)
    eng = llm.engine
    got = [o.token_ids for o in llm.generate(ids, G)]
    assert got == ref
    assert eng.scheduler.num_preemptions > 0 and eng.num_async_steps > 0
    assert eng.kv.usage == 0.0 and len(eng.spec.proposer) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_sampled_steps_ahead_replay_their_graphs_and_repeat_with_a_seed(prompts_and_reference):
    """On CUDA (bf16): sampled requests' steps ahead replay the sampling graphs (rejection sampling
    in the graph, nothing eager) beside a greedy request, and seeded requests repeat their tokens
    run after run (the same draws from each request's generator)."""
    from test_gpu import _count

    ids, _ = prompts_and_reference
    cuda = {"device": "cuda", "dtype": "bfloat16", "kv_cache_memory": "512MiB", "max_num_seqs": 4}
    params = [G, SamplingParams(max_tokens=60, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=1.0, top_k=20, top_p=0.9, seed=3, ignore_eos=True)]
    llm = dspark({"adaptive": "off"}, **cuda)
    eng = llm.engine
    assert eng._spec_ahead.sampled_ahead and any(key[2] for key in eng.runner.ahead_graphs)
    outs = [o.token_ids for o in llm.generate(ids[:3], params)]
    assert _count(llm, "model_steps", "eager") == 0 and _count(llm, "spec_decode_drafter_steps", "eager") == 0
    assert eng.num_async_steps > 0.5 * _count(llm, "model_steps", "cuda_graph")
    assert [len(o) for o in outs[1:]] == [60, 60]
    assert [o.token_ids for o in dspark({"adaptive": "off"}, **cuda).generate(ids[:3], params)] == outs
