"""The draft-model and DSpark proposers through the engine, on the shipped demo pair at fp32:
greedy output token-identical to no speculation (mixed K by phase, stops and limits inside a
draft, prefix hits, chunked prefill, preemption), drafter KV rolled back and freed, seeded sampling
reproducible, sampled drafts drawn from the q they report, and start-up errors naming the key."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.server.chat_template import ChatTemplate
from tandem.spec.dspark import EMBED, FINAL_NORM, LM_HEAD, DSparkDrafter

DEMO = Path(__file__).resolve().parent.parent / "tandem" / "assets" / "demo"
QUESTIONS = ["What is 48213 + 37795?", "Sort these words: pear, apple, fig", "Write JSON with name Ana and age 31",
             "What is the weather in Lima?", "What is 907 * 12?"]
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
METHODS = ("draft_model", "dspark")
COMMON = {"device": "cpu", "dtype": "float32", "kv_cache_memory": "64MiB", "max_model_len": 1024}


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(str(DEMO), **COMMON)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    tok = plain.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    return [tok.encode(template.render([{"role": "user", "content": q}], kwargs={})) for q in QUESTIONS]


def make(method: str, **kw) -> LLM:
    spec = kw.pop("spec", {})
    args = dict(COMMON, **kw)
    return LLM(str(DEMO), speculative_config=dict({"method": method, "num_speculative_tokens": 3}, **spec), **args)


def counter(llm: LLM, name: str, **labels: str) -> float:
    total = 0.0
    for metric in llm.engine.metrics.registry.collect():
        for s in metric.samples:
            if s.name == f"tandem:{name}_total" and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_all_free(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished and eng.kv.num_free_blocks == eng.kv.num_blocks
    proposer = eng.spec.proposer
    assert len(proposer) == 0
    if hasattr(proposer, "kv"):  # the draft model's own cache
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks and not proposer.kv.req_blocks


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_token_identical_with_k_by_phase(method, plain, prompts):
    llm = make(method, spec={"adaptive": "phase", "phase_k": {"reasoning": 2, "content": 3}})
    got = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    accepted = counter(llm, "spec_decode_num_accepted_tokens")
    assert accepted / counter(llm, "spec_decode_num_draft_tokens") > 0.4  # a trained drafter, not noise
    assert counter(llm, "spec_decode_k", phase="reasoning", k="2") > 0
    assert counter(llm, "spec_decode_num_drafts", phase="content") > 0
    assert counter(llm, "spec_decode_k", phase="content", k="3") > 0
    assert counter(llm, "spec_decode_drafter_steps") > 0
    line = llm.engine.stats_line()
    assert "SpecDecoding metrics: Mean acceptance length: " in line and "reasoning" in line
    assert_all_free(llm)


@pytest.mark.parametrize("method", METHODS)
def test_limits_and_stops_inside_drafts(method, plain, prompts):
    llm = make(method)
    p = prompts[0]
    free = plain.generate([p], GREEDY)[0].token_ids
    for params in (SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 2, 5, 11)):
        a, b = llm.generate([p], params)[0], plain.generate([p], params)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    stop_at = free[13]
    a = llm.generate([p], SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert a.token_ids == free[: free.index(stop_at) + 1] and a.finish_reason == "stop"
    text = plain.generate([p], GREEDY)[0].text
    stop = text[40:43]
    a = llm.generate([p], SamplingParams(max_tokens=64, temperature=0.0, stop=(stop,)))[0]
    b = plain.generate([p], SamplingParams(max_tokens=64, temperature=0.0, stop=(stop,)))[0]
    assert (a.text, a.finish_reason) == (b.text, b.finish_reason) == (text[: text.index(stop)], "stop")
    assert_all_free(llm)


@pytest.mark.parametrize("method", METHODS)
def test_prefix_hits_chunked_prefill_and_preemption(method, plain, prompts):
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    # A 32-token budget: prompts are prefilled in chunks next to requests verifying drafts.
    llm = make(method, max_num_batched_tokens=32)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == want and sum(o.num_cached_tokens for o in again) > 0
    assert_all_free(llm)
    # A cache of 24 target blocks of 16 tokens (fewer with a draft model sharing it) for 5 requests: some
    # are preempted and recomputed.
    small = make(method, kv_cache_memory=24 * 16 * 4 * 2 * 2 * 64 * 8, enable_prefix_caching=False,
                 max_model_len=256)
    longer = SamplingParams(max_tokens=128, temperature=0.0)
    assert [o.token_ids for o in small.generate(prompts, longer)] == [o.token_ids for o in plain.generate(prompts, longer)]
    assert small.engine.scheduler.num_preemptions > 0
    assert counter(small, "spec_decode_num_accepted_tokens") > 0
    assert_all_free(small)


def test_dspark_drafts_after_a_prefix_hit(prompts):
    """A prefix hit leaves the drafter's window (W positions) to compute, so the request still drafts."""
    llm = make("dspark")
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))
    drafts = counter(llm, "spec_decode_num_drafts")
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.num_cached_tokens > 0 and out.num_cached_tokens <= len(prompts[0]) - 8
    assert counter(llm, "spec_decode_num_drafts") - drafts >= 2


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_reproducible(method, prompts):
    params = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=s) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        llm = make(method)
        runs.append([o.token_ids for o in llm.generate(prompts[:3], params)])
        assert counter(llm, "spec_decode_num_accepted_tokens") > 0
        assert_all_free(llm)
    assert runs[0] == runs[1]


def test_dspark_serving_block_matches_propose_and_samples_from_its_q(plain):
    """draft_block (the path graphs capture) gives propose's greedy tokens and confidence, and its
    Gumbel-max draws follow the q it returns."""
    target = plain.engine.model
    d = DSparkDrafter.from_dir(DEMO / "dspark", torch.float32, "cpu")
    params = dict(target.named_parameters())
    d.bind_target({EMBED: params[EMBED], FINAL_NORM: params[FINAL_NORM], LM_HEAD: params[LM_HEAD]}, 1e-6)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, d.cfg.window, d.cfg.feature_size, generator=g)
    known = torch.tensor([5, 77, 1200])
    ref = d.propose(feats, known, [4, 4, 4])
    tokens, q, conf = d.draft_block(feats, known, 4)
    assert q is None and torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(conf, ref.confidence)
    # Sampling row 0 at temperature 1.5 many times: the first draft's frequencies follow q[0, 0].
    n = 4000
    f1, kn = feats[:1].expand(n, -1, -1), known[:1].expand(n)
    gumbel = torch.empty(n, 2, d.cfg.vocab_size).exponential_(generator=g).log_().neg_()
    tokens, q, _ = d.draft_block(f1, kn, 2, torch.full((n,), 1 / 1.5), gumbel)
    freq = torch.bincount(tokens[:, 0], minlength=d.cfg.vocab_size).float() / n
    # Total variation over q's 15 likeliest tokens and the rest as one bucket (a vocabulary-wide TV
    # from 4000 draws is mostly sampling noise).
    top = q[0, 0].topk(15).indices

    def grouped(p: torch.Tensor) -> torch.Tensor:
        return torch.cat([p[top], (1 - p[top].sum()).view(1)])

    tv = 0.5 * (grouped(freq) - grouped(q[0, 0])).abs().sum().item()
    assert q[0, 0][top].sum() > 0.15 and tv < 0.05, tv  # off by the temperature or the Markov term fails this
    wrong = torch.softmax(torch.log(q[0, 0]) * 1.5 / 1.0, dim=-1)  # q at temperature 1 instead of 1.5
    assert 0.5 * (grouped(freq) - grouped(wrong)).abs().sum().item() > 0.1
    assert torch.allclose(q[:, 0], q[0, 0].expand_as(q[:, 0]))


# ---- start-up errors ----------------------------------------------------------------------------


def _copy_demo(tmp_path: Path, without: str) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    for f in DEMO.iterdir():
        if f.is_file():
            (d / f.name).symlink_to(f)
    for sub in ("draft", "dspark"):
        if sub != without:
            (d / sub).symlink_to(DEMO / sub)
    return d


def test_missing_drafter_directory_is_named(tmp_path):
    target = _copy_demo(tmp_path, without="dspark")
    with pytest.raises(ValueError, match=r"^--speculative-config: model is required .* no dspark/ directory"):
        LLM(str(target), speculative_config={"method": "dspark"}, **COMMON)
    with pytest.raises(ValueError, match=r"^--speculative-config: model: no such directory .*nowhere"):
        LLM(str(DEMO), speculative_config={"method": "draft_model", "model": str(tmp_path / "nowhere")}, **COMMON)


def test_drafter_for_another_vocab_or_tokenizer_is_refused(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(DEMO / "draft", draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(dict(cfg, vocab_size=5000)))
    with pytest.raises(ValueError, match=r"vocab_size 5000 but the target has 4672") as e:
        LLM(str(DEMO), speculative_config={"method": "draft_model", "model": str(draft)}, **COMMON)
    assert "\n" not in str(e.value) and str(e.value).startswith("--speculative-config: model")
    (draft / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped: a different tokenizer
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"different tokenizer"):
        LLM(str(DEMO), speculative_config={"method": "draft_model", "model": str(draft)}, **COMMON)


def test_dspark_kmax_beyond_its_block_is_refused():
    with pytest.raises(ValueError, match=r"num_speculative_tokens 8 is more than the DSpark drafter's block_size 7"):
        LLM(str(DEMO), speculative_config={"method": "dspark", "num_speculative_tokens": 8}, **COMMON)


def test_drafter_methods_default_to_three_tokens_and_the_demos_drafters():
    llm = LLM(str(DEMO), speculative_config={"method": "dspark"}, **COMMON)
    assert llm.engine.spec.config.num_speculative_tokens == 3
    assert llm.engine.spec.drafter_path == DEMO / "dspark"


def test_draft_model_chains_its_drafters_greedy_tokens(prompts):
    """The draft steps after the first run chained (ModelRunner.execute_chain, eager here): each
    request gets its drafter's own greedy continuation at its own K, again after the target kept
    part of a draft and corrected the rest, and a one-token K or a K of 0 leave the others as they
    are; the drafter's cache is all free after."""
    from tandem.core import Request

    llm = make("draft_model", spec={"num_speculative_tokens": 7})
    proposer = llm.engine.spec.proposer
    drafter = LLM(str(DEMO / "draft"), **COMMON)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def continuation(ids: list[int], n: int) -> list[int]:
        return drafter.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids

    reqs = [Request(f"chain-{i}", list(p), params) for i, p in enumerate(prompts)]
    for ks in ([7, 1, 3, 0, 5], [2, 6, 0, 7, 4]):
        drafts = proposer.propose(reqs, ks)
        for req, k, d in zip(reqs, ks, drafts):
            assert d.tokens == (continuation(req.all_token_ids, k) if k else []), (req.request_id, k)
            assert d.probs is None
        for req, d in zip(reqs, drafts):  # the target keeps the first draft (if any), then its own token
            req.output_token_ids += d.tokens[:1] + [(d.tokens[1] + 1) % 100 if len(d.tokens) > 1 else 7]
    for req in reqs:
        proposer.remove(req.request_id)
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks and not proposer.kv.req_blocks
