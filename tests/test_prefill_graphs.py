"""Prefill CUDA graphs: a step of one request's prompt chunk replays a graph of the smallest
captured query length that holds it, padded (tandem/engine/runner.py). The shapes are checked on
CPU; the replays against the eager forward on CUDA (skipped without it)."""

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import RunnerConfig
from tandem.engine.runner import prefill_buckets
from tiny_models import save_tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_prefill_buckets_are_powers_of_two_up_to_the_cap_and_the_cap():
    assert prefill_buckets(512) == (8, 16, 32, 64, 128, 256, 512)
    assert prefill_buckets(100) == (8, 16, 32, 64, 100)
    assert prefill_buckets(8) == (8,)
    assert prefill_buckets(7) == () and prefill_buckets(0) == ()


def test_a_negative_prefill_graph_cap_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--prefill-graph-max-tokens"):
        RunnerConfig(prefill_graph_max_tokens=-1)


def _graph_and_eager(llm: LLM, batch: list):  # noqa: ANN202 - (graph ForwardOutput, eager logits, eager aux)
    """Run one step's batch through the runner (a graph) and eagerly, as the engine would."""
    eng = llm.engine
    out = eng.runner.execute(batch)
    ids, pos, step = eng.runner.build_step(batch)
    with torch.inference_mode():
        hidden, aux = eng.runner._forward(ids, pos, step)
        logits = eng.model.compute_logits(hidden[step.logits_indices])
    return out, logits, aux


def _new(llm: LLM, rid: str, prompt: list[int]):  # noqa: ANN202 - a Request with slots for its prompt
    req = llm.engine.new_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert llm.engine.kv.allocate_slots(req, len(prompt))
    return req


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


def test_a_prefill_graphs_packed_step_gives_the_eager_logits_on_cpu(tmp_path):
    """The prefill graphs' layout, run eagerly on CPU through the torch attention (what a replay
    computes, minus the graph): a decode, a chunk that samples nothing and a whole prompt packed
    ragged into 64 tokens, the pads at the end of the last query (past its blocks, into the
    sink), the logits rows the step needs staged. The logits are the step's own eager forward's
    (fp32), and the staging is as the runner's docstring says."""
    from tandem.engine.runner import _Graph
    from tandem.engine.scheduler import ScheduledRequest

    save_tiny_model(tmp_path, "qwen3", seed=5)
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory="64MiB", max_num_seqs=4, async_scheduling=False)
    eng, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=g).tolist()

    first = _new(llm, "q0", prompt(6))
    runner.execute([ScheduledRequest.of(first, 6)])
    first.num_computed_tokens = 6
    first.output_token_ids.append(5)
    assert eng.kv.allocate_slots(first, 1)
    second, third = _new(llm, "q1", prompt(50)), _new(llm, "q2", prompt(33))
    batch = [ScheduledRequest.of(first, 1), ScheduledRequest(second, 0, 20, False), ScheduledRequest.of(third, 33)]
    _, want, _ = _graph_and_eager(llm, batch)  # no prefill graphs yet: the eager forward
    assert want.shape[0] == 2

    t, rows, seats = 64, 8, 4
    runner._allocate_static(seats, 1, -(-eng.max_model_len // runner.block_size) + 1, min_tokens=t, logits_rows=rows)
    runner.prefill_graphs = {t: _Graph(None, torch.empty(rows, want.shape[1]), None)}  # only its shape is read
    assert runner._prefill_key(batch) == t
    num_logits, starts = runner._stage_prefill(batch, t)
    host, sink = runner._static.host, eng.kv.null_block(0) * runner.block_size
    assert num_logits == 2 and starts == [0, 1, 21, 54]
    assert host["qsl"][: seats + 1].tolist() == [0, 1, 21, t, t]  # the last query holds the 10 pads
    assert host["seq"][:seats].tolist() == [7, 20, 33 + 10, 0]
    assert host["logits_rows"][:rows].tolist() == [0, 53] + [0] * 6
    assert (host["slots/0"][54:t] == sink).all() and (host["slots/0"][:54] != sink).all()
    step = runner._prefill_step(t, len(batch), tuple(host["qsl"][:4].tolist()), tuple(host["seq"][:3].tolist()))
    with torch.inference_mode():
        hidden, _ = runner._forward(runner._ids[:t], runner._pos[:t], step)
        got = eng.model.compute_logits(hidden.index_select(0, runner._logits_rows[:num_logits]))
    _close(got, want, 1e-5)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_on_cuda_prefill_steps_replay_their_graph_and_give_the_eager_logits_and_tokens(tmp_path, kind):
    """A prompt of 6 .. 200 tokens alone, and a step of two prompts' chunks beside a decode, replay
    the graph of the next captured total (ragged queries, pads at the end of the last one, which
    reach past its blocks) and give the eager forward's logits rows; a step above the cap, or
    with more logits rows than the shared buffer holds, prefills eagerly. Greedy tokens equal those
    of an engine without prefill graphs, one request at a time, chunked, and all at once (fp32 for
    the dense model; the MoE model's grouped experts need bf16)."""
    from tandem.engine.scheduler import ScheduledRequest
    from test_gpu import _count

    save_tiny_model(tmp_path, kind, seed=5)
    dtype = "float32" if kind == "qwen3" else "bfloat16"
    common = dict(device="cuda", dtype=dtype, kv_cache_memory="256MiB", max_num_seqs=4, async_scheduling=False)
    llm = LLM(str(tmp_path), prefill_graph_max_tokens=256, **common)
    eng = llm.engine
    assert list(eng.runner.prefill_graphs) == [8, 16, 32, 64, 128, 256]
    g = torch.Generator().manual_seed(1)
    tol = 1e-4 if dtype == "float32" else 5e-2

    def prompt(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=g).tolist()

    for i, n in enumerate((6, 17, 64, 200)):
        req = _new(llm, f"p{i}", prompt(n))
        out, want, _ = _graph_and_eager(llm, [ScheduledRequest.of(req, n)])
        assert out.mode == "prefill_graph" and out.logits.shape == (1, want.shape[1])
        _close(out.logits, want, tol)
        assert out.logits.argmax(-1).item() == want.argmax(-1).item()
        eng.kv.free(req)
    # A request decodes its token beside a 20-token chunk and a whole 33-token prompt: 54 tokens -> 64
    first = _new(llm, "q0", prompt(6))
    eng.runner.execute([ScheduledRequest.of(first, 6)])
    first.num_computed_tokens = 6
    first.output_token_ids.append(5)
    assert eng.kv.allocate_slots(first, 1)
    second, third = _new(llm, "q1", prompt(50)), _new(llm, "q2", prompt(33))
    batch = [ScheduledRequest.of(first, 1), ScheduledRequest(second, 0, 20, False), ScheduledRequest.of(third, 33)]
    out, want, _ = _graph_and_eager(llm, batch)
    assert out.mode == "prefill_graph" and want.shape[0] == 2  # the decode's row and the whole prompt's last
    _close(out.logits, want, tol)
    assert (out.logits.argmax(-1) == want.argmax(-1)).all()
    for r in (first, second, third):
        eng.kv.free(r)
    req = _new(llm, "long", prompt(300))
    assert _graph_and_eager(llm, [ScheduledRequest.of(req, 300)])[0].mode == "prefill"  # above the cap
    eng.kv.free(req)

    prompts = [prompt(n) for n in (9, 40, 130, 300)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(str(tmp_path), prefill_graph_max_tokens=0, **common)
    assert not eager.engine.runner.prefill_graphs
    chunked = LLM(str(tmp_path), prefill_graph_max_tokens=64, max_num_batched_tokens=64, **common)
    for one in ([p] for p in prompts):  # one request at a time
        want = [o.token_ids for o in eager.generate(one, params)]
        assert [o.token_ids for o in llm.generate(one, params)] == want
        assert [o.token_ids for o in chunked.generate(one, params)] == want
    assert _count(llm, "model_steps", "prefill_graph") == 3  # 9, 40, 130 tokens; 300 > 256
    assert _count(chunked, "model_steps", "prefill_graph") >= 1 + 1 + 3 + 5  # in chunks of 64 tokens
    assert _count(eager, "model_steps", "prefill_graph") == 0
    before = _count(llm, "model_steps", "prefill_graph")
    want = [o.token_ids for o in eager.generate(prompts[:3], params)]
    assert [o.token_ids for o in llm.generate(prompts[:3], params)] == want  # 179 tokens in one step: 256
    assert _count(llm, "model_steps", "prefill_graph") > before


@cuda
@pytest.mark.gpu
def test_on_cuda_a_dspark_prefill_graph_returns_the_eager_aux_rows():
    """With DSpark the prefill graph also returns the aux layers' outputs of the real rows (what
    the drafter's window is filled from), as the eager forward gives them (bf16 demo), for one
    prompt and for two in one step."""
    from tandem.builtin import demo_model_dir
    from tandem.engine.scheduler import ScheduledRequest

    llm = LLM(str(demo_model_dir()), device="cuda", kv_cache_memory="256MiB", max_num_seqs=4, async_scheduling=False,
              speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert llm.engine.runner.prefill_graphs
    g = torch.Generator().manual_seed(2)
    reqs = [_new(llm, f"d{i}", torch.randint(10, 4000, (n,), generator=g).tolist()) for i, n in enumerate((45, 12))]
    for batch in ([ScheduledRequest.of(reqs[0], 45)], [ScheduledRequest.of(r, r.num_tokens) for r in reqs]):
        out, want, aux = _graph_and_eager(llm, batch)
        total = sum(s.num_tokens for s in batch)
        assert out.mode == "prefill_graph" and out.aux is not None and aux.shape == (total, out.aux.shape[1])
        _close(out.aux, aux, 5e-2)
        _close(out.logits, want, 5e-2)
