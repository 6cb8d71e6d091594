"""CPU experts under a CUDA model (run on the GPU machine; skipped without CUDA): the host-node
path in eager steps and inside captured decode graphs."""

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import MAX_AUTO_CHUNK
from tandem.offload.cpu_executor import CpuMoEExecutor
from tiny_models import save_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
cpu_experts = pytest.importorskip("tandem.offload.cpu_experts")

PROMPTS = [[5, 17, 99, 3, 41], [7, 7, 8, 200, 11, 12, 13], [1, 2]]


def _steps(llm: LLM, mode: str) -> float:
    eng = llm.engine
    return eng.metrics.model_steps.labels(model_name=eng.model_name, mode=mode)._value.get()


def _greedy(llm: LLM, n: int = 24) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_offload")
    save_tiny_model(d, "qwen3_moe", seed=5, num_hidden_layers=3)
    return d


def test_graphs_with_cpu_experts_give_the_eager_tokens(model_dir):
    kw = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4, cpu_moe=True, cpu_moe_threads=4)
    eager = _greedy(LLM(str(model_dir), enforce_eager=True, **kw))
    graphed = LLM(str(model_dir), **kw)
    # fp32 on CUDA: no expert streaming (its groups run through torch._grouped_mm, bf16 only there)
    assert graphed.engine.model.cpu_experts.streamer is None
    assert all(isinstance(b.executor, CpuMoEExecutor) for b in graphed.engine.model.moe_blocks().values())
    before = _steps(graphed, "cuda_graph")
    assert _greedy(graphed) == eager
    assert _steps(graphed, "cuda_graph") - before >= 20  # decode replayed graphs holding the hand-offs
    graphed.engine.waits_asleep = True  # the host asleep while the steps run (blocking-sync events)
    assert _greedy(graphed) == eager
    on_gpu = _greedy(LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4,
                         enforce_eager=True))
    assert eager == on_gpu  # fp32 CPU experts: the all-GPU tokens


def test_the_polling_handoff_gives_the_host_node_tokens(model_dir):
    """--cpu-moe-handoff poll (the default): stream writes and waits on pinned flags (captured in
    the decode graphs) and the doorbell thread; the same tokens as the host nodes, eager and graphed."""
    kw = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4, cpu_moe=True, cpu_moe_threads=4)
    hostfunc = LLM(str(model_dir), cpu_moe_handoff="hostfunc", **kw)
    assert hostfunc.engine.model.cpu_experts.doorbell is None
    want = _greedy(hostfunc)
    eager = LLM(str(model_dir), enforce_eager=True, cpu_moe_handoff="poll", **kw)
    assert _greedy(eager) == want
    graphed = LLM(str(model_dir), **kw)
    bell = graphed.engine.model.cpu_experts.doorbell
    assert bell is not None and all(b.executor.doorbell is bell for b in graphed.engine.model.moe_blocks().values())
    before, served = _steps(graphed, "cuda_graph"), bell.served
    assert _greedy(graphed) == want
    assert _steps(graphed, "cuda_graph") - before >= 20  # decode replayed graphs holding the stream writes and waits
    assert bell.served - served >= 3 * 20  # three offloaded layers a step
    bell.check()


def test_bf16_cpu_experts_are_close_to_the_gpu_experts(model_dir):
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=4)
    gpu = LLM(str(model_dir), **kw).engine.model
    engine = LLM(str(model_dir), cpu_moe=True, **kw).engine
    cpu, streamer = engine.model, engine.model.cpu_experts.streamer
    if torch.cuda.get_device_capability()[0] >= 9:  # bf16 streaming runs: the step budget is its cost model's chunk
        chunk = engine.config.scheduler.max_num_batched_tokens
        assert streamer is not None and streamer.h2d > 1e9 and streamer.min_tokens <= chunk <= MAX_AUTO_CHUNK
    x = torch.randn(6, gpu.hf_config["hidden_size"], device="cuda", dtype=torch.bfloat16)
    for i, block in cpu.moe_blocks().items():
        want, got = gpu.moe_blocks()[i](x).float(), block(x).float()
        assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3


def test_the_kernel_skips_the_pad_rows_of_a_graph(model_dir):
    """A replay writes its real rows into live_rows; the kernel leaves the pad rows alone."""
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=8,
              cpu_moe=True)
    stage = llm.engine.model.cpu_experts.staging
    stage.out.fill_(7.0)
    before = _steps(llm, "cuda_graph")
    # Three one-token prompts: a 3-row prefill, then decodes of 3 requests in the 4-request graph.
    llm.generate([[3], [4], [5]], SamplingParams(max_tokens=6, temperature=0.0))
    assert _steps(llm, "cuda_graph") - before >= 4
    assert not stage.out[:3].eq(7.0).all() and stage.out[3:].eq(7.0).all()  # the pad row was never computed
