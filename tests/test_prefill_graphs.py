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


def _prefill(llm: LLM, rid: str, prompt: list[int]):  # noqa: ANN202 - (graph ForwardOutput, eager logits, eager aux)
    """Run one prefill chunk of `prompt` through the runner (graph) and eagerly, as the engine would."""
    from tandem.engine.scheduler import ScheduledRequest

    eng = llm.engine
    req = eng.new_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert eng.kv.allocate_slots(req, len(prompt))
    s = ScheduledRequest.of(req, len(prompt))
    out = eng.runner.execute([s])
    ids, pos, step = eng.runner.build_step([s])
    with torch.inference_mode():
        hidden, aux = eng.runner._forward(ids, pos, step)
        logits = eng.model.compute_logits(hidden[step.logits_indices])
    eng.kv.free(req)
    return out, logits, aux


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_on_cuda_a_prefill_replays_its_graph_and_gives_the_eager_logits_and_tokens(tmp_path, kind):
    """Prompts of 6 .. 300 tokens replay the graph of the next captured length (their pads write
    only the sink, reach past the request's blocks, and leave the logits of its last token as the
    eager forward's); a prompt longer than the cap, and one of several requests, prefill eagerly;
    a chunked prompt's chunks replay graphs too. Greedy tokens equal those of an engine without
    prefill graphs (fp32 for the dense model; the MoE model's grouped experts need bf16)."""
    save_tiny_model(tmp_path, kind, seed=5)
    dtype = "float32" if kind == "qwen3" else "bfloat16"
    common = dict(device="cuda", dtype=dtype, kv_cache_memory="256MiB", max_num_seqs=4, async_scheduling=False)
    llm = LLM(str(tmp_path), prefill_graph_max_tokens=256, **common)
    runner = llm.engine.runner
    assert list(runner.prefill_graphs) == [8, 16, 32, 64, 128, 256]
    g = torch.Generator().manual_seed(1)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for i, n in enumerate((6, 17, 64, 200)):
        prompt = torch.randint(10, 2000, (n,), generator=g).tolist()
        out, want, _ = _prefill(llm, f"p{i}", prompt)
        assert out.mode == "prefill_graph" and out.logits.shape == want.shape == (1, want.shape[1])
        torch.testing.assert_close(out.logits, want, atol=tol * want.abs().max().item(), rtol=tol)
        assert out.logits.argmax(-1).item() == want.argmax(-1).item()
    out, _, _ = _prefill(llm, "long", torch.randint(10, 2000, (300,), generator=g).tolist())
    assert out.mode == "prefill"  # above the cap

    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (9, 40, 130, 300)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(str(tmp_path), prefill_graph_max_tokens=0, **common)
    assert not eager.engine.runner.prefill_graphs
    chunked = LLM(str(tmp_path), prefill_graph_max_tokens=64, max_num_batched_tokens=64, **common)
    for batch in ([p] for p in prompts):  # one request at a time: every prefill step of one request
        want = [o.token_ids for o in eager.generate(batch, params)]
        assert [o.token_ids for o in llm.generate(batch, params)] == want
        assert [o.token_ids for o in chunked.generate(batch, params)] == want
    from test_gpu import _count

    assert _count(llm, "model_steps", "prefill_graph") == 3  # 9, 40, 130 tokens; 300 > 256
    assert _count(chunked, "model_steps", "prefill_graph") >= 1 + 1 + 3  # the 300-token prompt: 5 chunks
    assert _count(eager, "model_steps", "prefill_graph") == 0
    both = [o.token_ids for o in llm.generate(prompts[:2], params)]  # two prompts in one step: eager
    assert both == [o.token_ids for o in eager.generate(prompts[:2], params)]


@cuda
@pytest.mark.gpu
def test_on_cuda_a_dspark_prefill_graph_returns_the_eager_aux_rows():
    """With DSpark the prefill graph also returns the aux layers' outputs of the real rows (what
    the drafter's window is filled from), as the eager forward gives them (bf16 demo)."""
    from tandem.builtin import demo_model_dir

    llm = LLM(str(demo_model_dir()), device="cuda", kv_cache_memory="256MiB", max_num_seqs=4, async_scheduling=False,
              speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert llm.engine.runner.prefill_graphs
    g = torch.Generator().manual_seed(2)
    out, want, aux = _prefill(llm, "d", torch.randint(10, 4000, (45,), generator=g).tolist())
    assert out.mode == "prefill_graph" and out.aux is not None and out.aux.shape == aux.shape == (45, aux.shape[1])
    torch.testing.assert_close(out.aux.float(), aux.float(), atol=5e-2 * aux.abs().max().item(), rtol=5e-2)
    torch.testing.assert_close(out.logits, want, atol=5e-2 * want.abs().max().item(), rtol=5e-2)
