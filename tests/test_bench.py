"""`tandem bench`: pure logic on fixed inputs with known answers (needle scoring, the n-gram
simulation, the bracket rule, statistics, metrics parsing), then every tool end to end against a
real `tandem serve` with the built-in model on a loopback port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tandem.bench import cli as bench_cli
from tandem.bench.bracket import verdict
from tandem.bench.client import BenchClient
from tandem.bench.filler import filler_prompt, filler_words, fit_to_length
from tandem.bench.needle import haystack_prompt, make_needle, plant, score
from tandem.bench.ngram import simulate, simulate_many
from tandem.bench.specmetrics import NO_METRICS, acceptance, add_deltas, parse_spec_metrics, spec_delta, spec_lines
from tandem.bench.stats import percentile, summarize
from tandem.bench.tools.pptg import Case, parse_tests
from tandem.spec.ngram import propose_ngram as propose
from serve_proc import free_port, start_serve

# ---- needle scoring ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "passed"),
    [
        ("482913", True),
        ("The code is 482913.", True),
        ("It is 482,913", True),
        ("482 913", True),
        ("code: 4829130", False),
        ("48291", False),
        ("1482913", False),
        ("", False),
        (None, False),
        ("I do not know.", False),
    ],
)
def test_needle_score(answer, passed):
    assert score(answer, "482913") is passed


def test_needle_plant_depths():
    filler = ["a", "b", "c", "d"]
    assert plant(filler, "F", 0.0) == ["F", "a", "b", "c", "d"]
    assert plant(filler, "F", 0.25) == ["a", "F", "b", "c", "d"]
    assert plant(filler, "F", 0.5) == ["a", "b", "F", "c", "d"]
    assert plant(filler, "F", 0.75) == ["a", "b", "c", "F", "d"]
    assert plant(filler, "F", 1.0) == ["a", "b", "c", "d", "F"]
    with pytest.raises(ValueError):
        plant(filler, "F", 1.5)


def test_needle_prompt_holds_the_fact_once_at_its_depth():
    needle = make_needle(3)
    assert needle == make_needle(3) and len(needle.code) == 6
    text = haystack_prompt(100, needle, 0.5, seed=3)
    assert text.count(needle.fact) == 1
    assert text.endswith(needle.question)
    body = text.split("\n\n")[1]
    at = body.index(needle.fact) / len(body)
    assert 0.4 < at < 0.6


# ---- n-gram simulation ---------------------------------------------------------------------------


def test_ngram_full_repeat_accepts_everything():
    # i=0: no earlier [4] -> plain step emits 1. i=1: last token 1 matched at position 0, draft [2, 3],
    # both accepted, plus the target's own 4: 3 tokens in one step.
    st = simulate([1, 2, 3, 4], [1, 2, 3, 4], k=2)
    assert (st.steps, st.drafts, st.draft_tokens, st.accepted_tokens, st.generated_tokens) == (2, 1, 2, 2, 4)
    assert st.acceptance_rate == 1.0
    assert st.mean_acceptance_length == 3.0
    assert st.tokens_per_step == 2.0


def test_ngram_partial_acceptance():
    # i=0: no match, emit 5. i=1: [5] matched at 0 -> draft [6, 7, 5]; 6 accepted, 7 != 9 rejected,
    # target emits 9. i=3: [9] never seen before -> plain step emits 9.
    st = simulate([5, 6, 7], [5, 6, 9, 9], k=3)
    assert (st.steps, st.drafts, st.draft_tokens, st.accepted_tokens, st.generated_tokens) == (3, 1, 3, 1, 4)
    assert st.acceptance_rate == pytest.approx(1 / 3)
    assert st.mean_acceptance_length == 2.0
    assert st.tokens_per_step == pytest.approx(4 / 3)


def test_ngram_uses_most_recent_occurrence_and_longest_ngram():
    assert propose([1, 2, 1, 3, 1], k=1, max_n=1) == [3]  # most recent earlier [1] is at 2
    # the 2-gram [7, 1] wins over the more recent 1-gram match of [1]
    assert propose([7, 1, 8, 1, 9, 7, 1], k=1, max_n=2) == [8]
    assert propose([7, 1, 8, 1, 9, 7, 1], k=1, max_n=1) == [9]
    assert propose([1, 2, 3], k=4) == []
    assert propose([1, 2, 1], k=4) == [2, 1]  # fewer than k tokens follow the match


def test_ngram_no_draft_means_plain_decoding():
    st = simulate([1, 2, 3], [4, 5, 6], k=4)
    assert (st.steps, st.drafts, st.generated_tokens) == (3, 0, 3)
    assert st.acceptance_rate is None and st.mean_acceptance_length is None and st.tokens_per_step == 1.0


def test_ngram_many_sums_pairs_per_k():
    pairs = [([1, 2, 3, 4], [1, 2, 3, 4]), ([5, 6, 7], [5, 6, 9, 9])]
    by_k = simulate_many(pairs, ks=[1, 2])
    assert [s.k for s in by_k] == [1, 2]
    k2 = by_k[1]
    assert k2.generated_tokens == 8
    assert k2.steps == simulate(*pairs[0], k=2).steps + simulate(*pairs[1], k=2).steps


# ---- bracket rule --------------------------------------------------------------------------------


def test_bracket_needs_more_than_the_base_spread():
    assert verdict([10.0, 10.0], [11.0], [10.5]).decision == "no decision"  # beats by exactly the spread
    v = verdict([10.0], [12.0], [10.5])
    assert v.decision == "candidate wins" and v.spread == 0.5 and v.margin == pytest.approx(1.5)
    assert verdict([10.0], [9.0], [10.5]).decision == "candidate loses"
    assert verdict([10.0], [10.2], [10.5]).decision == "no decision"  # between the base runs
    assert verdict([10.0, 11.0, 12.0], [12.5, 13.0], [11.0, 11.2, 11.4]).decision == "candidate wins"  # medians 11, 12.75, 11.2


def test_bracket_lower_is_better_and_drift():
    assert verdict([100.0], [90.0], [104.0], higher_is_better=False).decision == "candidate wins"
    assert verdict([100.0], [110.0], [104.0], higher_is_better=False).decision == "candidate loses"
    # the base drifted by 10: a candidate 8 better than the better base is no decision
    assert verdict([100.0], [118.0], [110.0]).decision == "no decision"
    with pytest.raises(ValueError):
        verdict([], [1.0], [1.0])


# ---- small pieces --------------------------------------------------------------------------------


def test_stats():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    assert percentile([], 50) is None
    s = summarize([3.0, 1.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)


_TANDEM_BEFORE = """# HELP tandem:spec_decode_num_drafts_total Drafts verified.
# TYPE tandem:spec_decode_num_drafts_total counter
tandem:spec_decode_num_drafts_total{model_name="m",phase="reasoning"} 10.0
tandem:spec_decode_num_drafts_created{model_name="m",phase="reasoning"} 1.7e9
tandem:spec_decode_num_draft_tokens_total{model_name="m",phase="reasoning"} 30.0
tandem:spec_decode_num_accepted_tokens_total{model_name="m",phase="reasoning"} 12.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="reasoning",position="0"} 8.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="reasoning",position="1"} 4.0
tandem:spec_decode_k_total{k="3",model_name="m",phase="reasoning"} 10.0
tandem:generation_tokens_total{model_name="m"} 99.0
"""

# one run later: reasoning drafted 10 more (30 tokens, 9 accepted: 6 at position 0, 3 at 1, none
# at 2), content started (5 drafts, 15 tokens, 12 accepted: 5, 4, 3), a request-step chose K=0
_TANDEM_AFTER = """tandem:spec_decode_num_drafts_total{model_name="m",phase="reasoning"} 20.0
tandem:spec_decode_num_drafts_total{model_name="m",phase="content"} 5.0
tandem:spec_decode_num_draft_tokens_total{model_name="m",phase="reasoning"} 60.0
tandem:spec_decode_num_draft_tokens_total{model_name="m",phase="content"} 15.0
tandem:spec_decode_num_accepted_tokens_total{model_name="m",phase="reasoning"} 21.0
tandem:spec_decode_num_accepted_tokens_total{model_name="m",phase="content"} 12.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="reasoning",position="0"} 14.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="reasoning",position="1"} 7.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="content",position="0"} 5.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="content",position="1"} 4.0
tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",phase="content",position="2"} 3.0
tandem:spec_decode_k_total{k="3",model_name="m",phase="reasoning"} 19.0
tandem:spec_decode_k_total{k="0",model_name="m",phase="reasoning"} 1.0
tandem:spec_decode_k_total{k="3",model_name="m",phase="content"} 5.0
"""


def test_spec_metrics_parse_sums_model_names_and_skips_created():
    page = _TANDEM_BEFORE + 'tandem:spec_decode_num_drafts_total{model_name="other",phase="reasoning"} 2.0\n'
    got = parse_spec_metrics(page)
    assert got == {
        ("drafts", "reasoning", None): 12.0,
        ("draft_tokens", "reasoning", None): 30.0,
        ("accepted_tokens", "reasoning", None): 12.0,
        ("accepted_per_pos", "reasoning", 0): 8.0,
        ("accepted_per_pos", "reasoning", 1): 4.0,
        ("k", "reasoning", 3): 10.0,
    }
    assert parse_spec_metrics("tandem:prompt_tokens_total 5\nother:spec_decode_num_drafts_total 3\n") == {}


def test_spec_acceptance_per_phase_from_two_scrapes():
    acc = acceptance(spec_delta(parse_spec_metrics(_TANDEM_BEFORE), parse_spec_metrics(_TANDEM_AFTER)))
    # all phases: 15 drafts, 45 tokens, 21 accepted; positions (6+5)/15, (3+4)/15, 3/15
    assert (acc["drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (15.0, 45.0, 21.0)
    assert acc["acceptance_rate"] == pytest.approx(21 / 45)
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 21 / 15)
    assert acc["per_position"] == pytest.approx([11 / 15, 7 / 15, 3 / 15])
    assert acc["k"] == pytest.approx({3: 14 / 15, 0: 1 / 15})
    assert list(acc["phases"]) == ["content", "reasoning"]
    r, c = acc["phases"]["reasoning"], acc["phases"]["content"]
    assert (r["drafts"], r["draft_tokens"], r["accepted_tokens"]) == (10.0, 30.0, 9.0)
    assert r["acceptance_rate"] == pytest.approx(0.3) and r["mean_acceptance_length"] == pytest.approx(1.9)
    assert r["per_position"] == pytest.approx([0.6, 0.3])  # no position-2 sample: never accepted there
    assert r["k"] == pytest.approx({3: 0.9, 0: 0.1})
    assert c["acceptance_rate"] == pytest.approx(0.8) and c["mean_acceptance_length"] == pytest.approx(3.4)
    assert c["per_position"] == pytest.approx([1.0, 0.8, 0.6]) and c["k"] == {3: 1.0}
    lines = spec_lines([("1", acc)])
    assert lines[0].startswith("speculative decoding")
    rows = lines[1].splitlines()[2:]
    assert [r.split()[:8] for r in rows] == [
        ["1", "all", "15", "45", "21", "46.7%", "2.40", "0.733,"],
        ["1", "content", "5", "15", "12", "80.0%", "3.40", "1.000,"],
        ["1", "reasoning", "10", "30", "9", "30.0%", "1.90", "0.600,"],
    ]
    assert lines[2] == "K, run 1: content {3: 100%}, reasoning {3: 90%, 0: 10%}"


def test_spec_acceptance_first_scrape_before_any_draft_and_vllm_names():
    # Tandem creates a labelled counter on its first draft: before the first run there is none yet
    acc = acceptance(spec_delta(parse_spec_metrics("tandem:generation_tokens_total 0\n"), parse_spec_metrics(_TANDEM_AFTER)))
    assert acc["drafts"] == 25.0 and acc["accepted_tokens"] == 33.0
    vllm = """vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
"""
    acc = acceptance(spec_delta({}, parse_spec_metrics(vllm)))
    assert acc["acceptance_rate"] == pytest.approx(0.4) and acc["mean_acceptance_length"] == pytest.approx(2.2)
    assert acc["per_position"] == pytest.approx([0.8, 0.4]) and acc["phases"] == {} and acc["k"] == {}
    assert [r.split()[1] for r in spec_lines([("1", acc)])[1].splitlines()[2:]] == ["all"]  # no phases: one row


def test_spec_acceptance_without_metrics():
    assert spec_delta({}, {}) is None  # /metrics without spec_decode counters: speculation off, or not Tandem
    assert spec_delta(None, parse_spec_metrics(_TANDEM_AFTER)) is None  # no /metrics
    assert acceptance(None) is None
    assert add_deltas([None, None]) is None
    assert spec_lines([("1", None), ("all", None)]) == [f"speculative decoding: {NO_METRICS}"]
    d = spec_delta(parse_spec_metrics(_TANDEM_AFTER), parse_spec_metrics(_TANDEM_AFTER))  # a run without drafts
    acc = acceptance(d)
    assert acc["drafts"] == 0.0 and acc["acceptance_rate"] is None and acc["mean_acceptance_length"] is None
    assert acc["per_position"] == [] and acc["phases"] == {}
    two = add_deltas([d, spec_delta(parse_spec_metrics(_TANDEM_BEFORE), parse_spec_metrics(_TANDEM_AFTER)), None])
    assert acceptance(two)["drafts"] == 15.0


def test_pp_tg_test_names():
    assert parse_tests("pp512,tg128, pp2048@d4096") == [Case("pp", 512), Case("tg", 128), Case("pp", 2048, 4096)]
    assert Case("pp", 2048, 4096).name == "pp2048 @ d4096"
    with pytest.raises(ValueError):
        parse_tests("xx12")


def test_fit_to_length_with_an_exact_counter():
    async def count(text: str) -> int:
        return len(text.split())  # one token per word

    import asyncio

    text, n = asyncio.run(fit_to_length(lambda k: filler_words(k, 1), 300, count))
    assert n == 300 and len(text.split()) == 300
    assert filler_prompt(5, 1) != filler_prompt(5, 2)


# ---- end to end against a real server ------------------------------------------------------------


def _start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    return start_serve("tandem-builtin", "--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--device", "cpu", *extra)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server():
    from tandem.builtin import ensure_builtin_model

    ensure_builtin_model()
    proc, url = _start_server()
    yield url
    _stop(proc)


def _bench(capsys, *argv: str) -> tuple[int, str, str]:
    rc = bench_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_usage_agrees_with_streamed_tokens(server):
    import asyncio

    async def go():
        client = BenchClient(server)
        try:
            await client.connect()
            assert client.model == "tandem-builtin" and client.max_model_len == 2048
            s = await client.stream("The quick brown fox", max_tokens=16, ignore_eos=True)
            n = await client.count_tokens("The quick brown fox")
            return s, n
        finally:
            await client.aclose()

    s, n = asyncio.run(go())
    assert s.ok, s.error
    assert s.completion_tokens == 16 == s.num_chunks
    assert s.prompt_tokens == n
    assert s.ttft is not None and s.ttft > 0 and len(s.itls) == 15


def test_prompt_sizing_without_tokenize(server):
    import asyncio

    from tandem.bench.tools.common import unique_prompt

    async def go():
        client = BenchClient(server)
        try:
            await client.connect()
            client.has_tokenize = False  # as on a server without POST /tokenize
            text, n = await unique_prompt(client, 300, seed=1)
            return client.tokens_per_word, await client.prompt_tokens_by_usage(text), n
        finally:
            await client.aclose()

    per_word, actual, n = asyncio.run(go())
    assert per_word and n is None
    assert 240 <= actual <= 360  # an estimate from usage counts, not exact


def test_decode(server, capsys, tmp_path):
    out = tmp_path / "decode.json"
    rc, text, _ = _bench(capsys, "decode", "--url", server, "--runs", "2", "--max-tokens", "16", "--endpoint", "completions",
                         "--ignore-eos", "--json", str(out), "--quiet")
    assert rc == 0, text
    assert "tok/s" in text and "decode tok/s: median" in text
    data = json.loads(out.read_text())
    assert data["tool"] == "decode" and data["failed"] == 0 and len(data["samples"]) == 2
    for s in data["samples"]:
        assert s["completion_tokens"] == s["num_chunks"] == 16  # usage agrees with the stream
        assert len(s["chunk_times"]) == 16 and s["spec"] is None  # no speculation configured
    assert data["summary"]["spec"] is None and "no speculative decoding metrics" in text


def test_decode_reports_speculative_acceptance(capsys, tmp_path):
    proc, url = _start_server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        out = tmp_path / "decode-spec.json"
        rc, text, _ = _bench(capsys, "decode", "--url", url, "--runs", "2", "--max-tokens", "64", "--endpoint", "completions",
                             "--ignore-eos", "--json", str(out), "--quiet")
    finally:
        _stop(proc)
    assert rc == 0, text
    data = json.loads(out.read_text())
    spec = data["summary"]["spec"]
    runs = [s["spec"] for s in data["samples"]]
    assert spec is not None and all(r is not None for r in runs), text
    # the whole is the sum of the runs, and every phase's counts add up to it
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        assert spec[key] == sum(r[key] for r in runs) == sum(p[key] for p in spec["phases"].values())
    assert spec["drafts"] > 0, text  # random weights repeat themselves: n-gram lookup finds drafts
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert len(spec["per_position"]) <= 3
    assert sum(spec["k"].values()) == pytest.approx(1.0) and set(spec["k"]) <= {"0", "1", "2", "3"}  # K shares (JSON keys)
    assert "speculative decoding (server /metrics" in text and "no speculative decoding metrics" not in text


def test_decode_chat_runs(server, capsys):
    rc, text, _ = _bench(capsys, "decode", "--url", server, "--runs", "1", "--max-tokens", "8", "--quiet")
    assert rc == 0 and "draft acceptance" in text


def test_ctx(server, capsys, tmp_path):
    out = tmp_path / "ctx.json"
    rc, text, _ = _bench(capsys, "ctx", "--url", server, "--lengths", "256,512,8K", "--max-tokens", "8",
                         "--json", str(out), "--quiet")
    assert rc == 0, text
    assert "prefill tok/s" in text and "capped to" in text
    data = json.loads(out.read_text())
    rows = data["table"]["rows"]
    assert [r[0] for r in rows] == [256, 512, 2048 - 8 - 8]  # capped: room for 8 output tokens + 8 spare
    for s in data["samples"]:
        assert s["ok"] and s["completion_tokens"] == s["num_chunks"] == 8
        assert abs(s["prompt_tokens"] - s["context"]) <= max(4, s["context"] // 50)
        assert (s["cached_tokens"] or 0) <= 16  # unique prompts: at most a block of the shared "Record " opening


def test_conc(server, capsys, tmp_path):
    out = tmp_path / "conc.json"
    rc, text, _ = _bench(capsys, "conc", "--url", server, "--concurrency", "1,2", "--max-tokens", "8", "--prompt-len", "64",
                         "--json", str(out), "--quiet")
    assert rc == 0, text
    assert "agg tok/s" in text
    data = json.loads(out.read_text())
    assert len(data["samples"]) == 3 and data["failed"] == 0
    assert all(s["completion_tokens"] == s["num_chunks"] == 8 for s in data["samples"])


def test_quality(server, capsys, tmp_path):
    out = tmp_path / "q.json"
    rc, text, _ = _bench(capsys, "quality", "--url", server, "--lengths", "256,512", "--max-tokens", "8",
                         "--json", str(out), "--quiet")
    assert rc == 0, text
    assert "needle retrieval: " in text and "/6" in text  # random weights: the score itself is ~0
    data = json.loads(out.read_text())
    assert data["summary"]["total"] == 6 and len(data["samples"]) == 6
    assert {s["depth"] for s in data["samples"]} == {25, 50, 75}


def test_pp_tg(server, capsys, tmp_path):
    out = tmp_path / "pptg.json"
    rc, text, _ = _bench(capsys, "pp-tg", "--url", server, "--tests", "pp128,tg16,pp128@d256,pp2048@d4096", "--runs", "1",
                         "--json", str(out), "--quiet")
    assert rc == 0, text
    assert "pp128 @ d256" in text and "skipped" in text
    data = json.loads(out.read_text())
    tested = {s["test"] for s in data["samples"]}
    assert tested == {"pp128", "tg16", "pp128 @ d256"}
    tg = next(s for s in data["samples"] if s["test"] == "tg16")
    assert tg["completion_tokens"] == tg["num_chunks"] == 16


def test_streamgap(server, capsys, tmp_path):
    out = tmp_path / "sg.json"
    rc, text, _ = _bench(capsys, "streamgap", "--url", server, "--runs", "1", "--max-tokens", "32", "--prefill-len", "1024",
                         "--after", "4", "--json", str(out), "--quiet")
    assert rc == 0, text
    assert "baseline" in text and "disturbed" in text and "max gap" in text
    data = json.loads(out.read_text())
    disturbed = next(s for s in data["samples"] if s["phase"] == "disturbed")
    assert disturbed["intruder"]["ok"] and disturbed["intruder"]["prompt_tokens"] > 900


def test_ngram_ceiling_collect_then_file(server, capsys, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rc, text, _ = _bench(capsys, "ngram-ceiling", "--url", server, "--collect", "2", "--max-tokens", "16",
                         "--save", str(pairs), "--quiet")
    assert rc == 0, text
    assert len(pairs.read_text().splitlines()) == 2 and "mean accept len" in text
    # offline from a file with token ids: no server needed, numbers known
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt_ids": [1, 2, 3, 4], "completion_ids": [1, 2, 3, 4]}) + "\n")
    out = tmp_path / "ng.json"
    rc, text, _ = _bench(capsys, "ngram-ceiling", "--url", "http://127.0.0.1:9", "--data", str(ids), "--k", "2",
                         "--json", str(out))
    assert rc == 0, text
    per_k = json.loads(out.read_text())["summary"]["per_k"]
    assert per_k[0]["acceptance_rate"] == 1.0 and per_k[0]["mean_acceptance_length"] == 3.0


def test_bracket_with_urls(server, capsys, tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    rc, text, _ = _bench(capsys, "bracket", "--base-url", server, "--cand-url", server + "/v1", "--ledger", str(ledger),
                         "--quiet", "--", "--runs", "2", "--max-tokens", "8", "--endpoint", "completions", "--ignore-eos")
    assert rc == 0, text
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    assert [x["config"] for x in lines if "metric" in x] == ["base", "candidate", "base"]
    assert sum(1 for x in lines if "sample" in x) == 6
    summary = ledger.with_suffix(".md").read_text()
    assert any(v in summary for v in ("candidate wins", "candidate loses", "no decision"))


def test_unreachable_server_is_one_line_and_nonzero(capsys):
    rc, _, err = _bench(capsys, "decode", "--url", "http://127.0.0.1:9", "--quiet")
    assert rc == 1
    assert err.strip().count("\n") == 0 and "cannot reach the server" in err


def test_unknown_model_is_rejected(server, capsys):
    rc, _, err = _bench(capsys, "ctx", "--url", server, "--model", "no-such-model", "--quiet")
    assert rc == 1 and "no-such-model" in err and err.strip().count("\n") == 0


def test_bad_api_key_is_rejected(capsys):
    proc, url = _start_server("--api-key", "sekret")
    try:
        rc, _, err = _bench(capsys, "decode", "--url", url, "--api-key", "wrong", "--quiet")
        assert rc == 1 and "API key" in err
        rc, text, _ = _bench(capsys, "decode", "--url", url, "--api-key", "sekret", "--runs", "1", "--max-tokens", "4",
                             "--endpoint", "completions", "--quiet")
        assert rc == 0, text
    finally:
        _stop(proc)


def test_main_cli_can_mount_bench():
    import argparse

    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command")
    bench_cli.add_bench_parser(sub)
    args = parser.parse_args(["bench", "conc", "--concurrency", "1,2", "--url", "http://x:1"])
    assert args.command == "bench" and args.bench_tool == "conc" and args.concurrency == "1,2"


def test_bracket_with_launch_commands(capsys, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = f"{sys.executable} -m tandem.cli serve tandem-builtin --port {port} --max-model-len 512 --kv-cache-memory 64MiB --device cpu"
    ledger = tmp_path / "launch.jsonl"
    rc, text, err = _bench(capsys, "bracket", "--url", url, "--base-cmd", serve, "--cand-cmd", serve + " --max-num-seqs 8",
                           "--ledger", str(ledger), "--quiet", "--", "--runs", "1", "--max-tokens", "8", "--endpoint", "completions")
    assert rc == 0, text + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch.1-base.log", "launch.2-candidate.log", "launch.3-base.log",
                                                          "launch.jsonl", "launch.md"]
    with pytest.raises(httpx.HTTPError):  # every launched server was stopped
        httpx.get(f"{url}/health", timeout=2)
