"""Hot experts (tandem/offload/hot_experts.py): `tandem profile-experts` counts routing through the
engine, the planner spends --hot-expert-memory on the most-counted experts of the layers in RAM,
and a layer then splits its pairs between those (on the device) and the CPU kernel; greedy
tokens stay those of the model with every expert on the CPU, fp32 on CPU (where the "device"
part is the torch executor: the split, not the speed, is what runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.cli import run
from tandem.config import OffloadConfig
from tandem.offload.hot_experts import ExpertCounts, HotExpertsExecutor, choose_hot, record_routing
from tiny_models import save_tiny_model

pytest.importorskip("tandem.offload.cpu_experts")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def reverse(xs):", "Seventeen plus twenty-five is"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hot")
    save_tiny_model(d, "qwen3_moe", seed=4, num_hidden_layers=3)
    return d


@pytest.fixture(scope="module")
def counts_file(model_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("counts")
    prompts = d / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
                       + "\n")
    out = d / "counts.json"
    assert run(["profile-experts", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--device", "cpu",
                "--max-tokens", "12", "--kv-cache-memory", "16MiB"]) == 0
    return out


def test_profile_counts_every_pair_of_every_layer(counts_file) -> None:
    counts = ExpertCounts.load(counts_file, num_experts=8, layers={0, 1, 2})
    assert set(counts.counts) == {0, 1, 2}
    assert all(sum(c) == counts.tokens * 2 for c in counts.counts.values())  # top-2
    assert counts.tokens > 20 and max(max(c) for c in counts.counts.values()) > 0


def test_record_routing_counts_what_the_router_picks(model_dir) -> None:
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB")
    model = llm.engine.model
    picks = []
    gate = model.moe_blocks()[1].gate
    hook = gate.register_forward_hook(lambda _m, _i, out: picks.append(out.topk(2, dim=-1).indices.flatten()))
    with record_routing(model) as counts:
        llm.generate(PROMPTS[:1], GREEDY)
    hook.remove()
    assert torch.equal(counts[1], torch.bincount(torch.cat(picks), minlength=8))
    assert all(not type(b.executor).__name__.startswith("_Counting") for b in model.moe_blocks().values())


def test_choose_hot_takes_the_most_counted_pairs_within_the_budget() -> None:
    counts = ExpertCounts("m", 10, {0: (5, 0, 9, 1), 1: (3, 8, 0, 0), 2: (100, 0, 0, 0)})
    hot, rate = choose_hot(counts, [0, 1], budget=3 * 10, bytes_per_expert=10)  # layer 2 is on the GPU
    assert hot == {0: (0, 2), 1: (1,)} and rate == pytest.approx((9 + 8 + 5) / 26)
    assert choose_hot(counts, [0, 1], budget=9, bytes_per_expert=10) == ({}, 0.0)


def test_greedy_tokens_with_hot_experts_equal_all_on_the_cpu(model_dir, counts_file) -> None:
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True)
    want = [o.token_ids for o in LLM(str(model_dir), **kw).generate(PROMPTS, GREEDY)]
    per_expert = 3 * 64 * 32 * 4
    llm = LLM(str(model_dir), hot_experts=str(counts_file), hot_expert_memory=7 * per_expert, **kw)
    sink = llm.engine.model.cpu_experts
    assert sum(map(len, sink.hot.values())) == 7
    blocks = llm.engine.model.moe_blocks()
    assert {i for i, b in blocks.items() if isinstance(b.executor, HotExpertsExecutor)} == set(sink.hot)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    rates = sink.hot_hit_rates()
    assert rates and all(0 < r < 1 for r in rates.values())
    assert "Hot-expert hit rate:" in llm.engine.stats_line()
    from prometheus_client import generate_latest

    metrics = generate_latest(llm.engine.metrics.registry).decode()
    assert all(f'layer="{i}"' in metrics for i in rates) and "tandem:hot_expert_hit_rate" in metrics


def test_the_plan_shows_the_hot_experts_and_their_predicted_hit_rate(model_dir, counts_file) -> None:
    from tandem.offload.planner import plan_memory

    per_expert = 3 * 64 * 32 * 2  # bf16 on the GPU
    offload = OffloadConfig(cpu_moe=True, hot_experts=str(counts_file), hot_expert_memory=5 * per_expert)
    plan = plan_memory(model_dir, torch.bfloat16, "cuda", device_bytes=1 << 30, offload=offload, max_model_len=256)
    assert plan.fits and plan.placement.hot_bytes == 5 * per_expert
    text = plan.render()
    assert "5 hot experts over" in text and "predicted hit rate" in text and str(counts_file) in text
    # A GPU budget one byte short of the rest plus the hot experts: refused, naming the flag.
    from tandem.models.loader import build_meta_model, inspect_checkpoint
    from tandem.offload.placement import plan_placement

    info = inspect_checkpoint(model_dir)
    meta = build_meta_model(info.model_class, info.config, torch.bfloat16, model_dir / "config.json")
    rest = plan_placement(meta, torch.bfloat16, OffloadConfig(cpu_moe=True), 1 << 40, 0).gpu_bytes
    tight = plan_placement(meta, torch.bfloat16, offload, rest + 5 * per_expert - 1, 0)
    assert tight.hot_bytes == 5 * per_expert and any("lower --hot-expert-memory" in p for p in tight.problems)
    assert not plan_placement(meta, torch.bfloat16, offload, rest + 5 * per_expert, 0).problems


def test_bad_calibration_files_are_named(model_dir, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=f"--hot-experts {bad}: not a tandem_expert_counts_v1 file"):
        LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB", cpu_moe=True, hot_experts=str(bad),
            hot_expert_memory="1MiB")
    other = tmp_path / "other.json"
    ExpertCounts("x", 1, {7: (1,) * 8}).save(other)
    with pytest.raises(ValueError, match="layers \\[7\\], which are not MoE layers of this model"):
        ExpertCounts.load(other, num_experts=8, layers={0, 1, 2})
    with pytest.raises(ValueError, match="--hot-experts FILE and --hot-expert-memory SIZE go together"):
        OffloadConfig(cpu_moe=True, hot_experts=str(other))


def test_deepseek_v4_hot_experts_keep_the_swiglu_clamp(tmp_path) -> None:
    pytest.importorskip("transformers.models.deepseek_v4")
    from test_deepseek_v4_engine import GREEDY as V4_GREEDY
    from test_deepseek_v4_engine import prompts, save_v4

    save_v4(tmp_path / "m", "hash")
    ps = prompts((17, 30), seed=3)
    kw = dict(device="cpu", kv_cache_memory="8MiB", cpu_moe=True)
    llm = LLM(str(tmp_path / "m"), **kw)
    with record_routing(llm.engine.model) as counts:
        want = [o.token_ids for o in llm.generate(ps, V4_GREEDY)]
    ExpertCounts("v4", 1, {i: tuple(c.tolist()) for i, c in counts.items()}).save(tmp_path / "counts.json")
    hot = LLM(str(tmp_path / "m"), hot_experts=str(tmp_path / "counts.json"), hot_expert_memory=4 * 3 * 48 * 24 * 4, **kw)
    executors = hot.engine.model.cpu_experts.hot_executors
    assert executors and all(m.limit == 0.5 for ex in executors.values() for m in ex.device_part.experts)
    assert [o.token_ids for o in hot.generate(ps, V4_GREEDY)] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_split_runs_eagerly_and_in_a_graph(model_dir, counts_file) -> None:
    """The hot experts on a side stream beside the CPU host node. fp32, eager (the torch executor
    on the device): the all-CPU run's tokens. bf16 (the grouped executor): the decode graphs give
    the eager run's tokens."""
    kw = dict(device="cuda", kv_cache_memory="64MiB", cpu_moe=True, hot_experts=str(counts_file),
              hot_expert_memory="1MiB")
    want = [o.token_ids for o in LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_memory="64MiB",
                                     cpu_moe=True).generate(PROMPTS, GREEDY)]
    llm = LLM(str(model_dir), dtype="float32", **kw)
    assert llm.engine.model.cpu_experts.hot_executors and not llm.engine.runner.graphs  # torch: not capturable
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    runs = []
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=eager, **kw)
        assert bool(llm.engine.runner.graphs) != eager
        runs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    assert runs[0] == runs[1]


def test_online_initial_set_splits_the_budget_evenly() -> None:
    from tandem.offload.hot_online import initial_hot

    assert initial_hot([0, 2, 5], 8, budget=7 * 10, bytes_per_expert=10) == ({0: (0, 1), 2: (0, 1), 5: (0, 1)}, 0.25)
    assert initial_hot([0, 1], 8, budget=10, bytes_per_expert=10) == ({}, 0.0)  # not one expert per layer


def test_online_hot_experts_follow_the_routing_and_keep_the_outputs() -> None:
    """Skewed routing onto experts that are cold at the start: after a re-ranking they are hot (the
    swap copied their weights), the hit rate rises, and every output equals the CPU kernel's."""
    from tandem.models.layers.mlp import SwiGLUMLP
    from tandem.offload.cpu_experts import CpuExpertLayer
    from tandem.offload.hot_online import OnlineHotExperts

    E, H, I, k = 8, 32, 16, 2
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, I, H, generator=g) * 0.2, torch.randn(E, I, H, generator=g) * 0.2,
                      torch.randn(E, H, I, generator=g) * 0.2)
    layer = CpuExpertLayer.from_dense(gate, up, down, "fp32")
    hot_modules = torch.nn.ModuleList(SwiGLUMLP(H, I) for _ in range(2))
    with torch.no_grad():
        for slot, e in enumerate((0, 1)):  # the initial set: experts 0 and 1
            hot_modules[slot].gate_proj.weight.copy_(gate[e])
            hot_modules[slot].up_proj.weight.copy_(up[e])
            hot_modules[slot].down_proj.weight.copy_(down[e])
    ex = HotExpertsExecutor(layer, hot_modules, (0, 1), E)
    online = OnlineHotExperts({0: ex}, {0: layer}, torch.float32, interval=4, max_swaps=8)

    def step(rows: int) -> float:
        x = torch.randn(rows, H, generator=g)
        ids = torch.stack((torch.full((rows,), 5), torch.randint(6, 8, (rows,), generator=g)), dim=1)  # 5, then 6 or 7
        w = torch.softmax(torch.randn(rows, k, generator=g), -1)
        hits, pairs = int(ex.hits), int(ex.pairs)
        torch.testing.assert_close(ex(x, ids, w), layer(x, ids, w), rtol=1e-5, atol=1e-6)
        online.after_step()
        return (int(ex.hits) - hits) / (int(ex.pairs) - pairs)

    rates = [step(6) for _ in range(4)]  # the 4th step re-ranks and swaps
    assert rates == [0.0] * 4 and online.swaps == 2
    assert 5 in ex.hot_ids and len(set(ex.hot_ids)) == 2 and ex.local[5] >= 0 and ex.local[0] == ex.local[1] == -1
    assert step(6) >= 0.5  # expert 5 is in every row's first slot
    assert torch.equal(hot_modules[int(ex.local[5])].down_proj.weight, down[5])


def test_online_hot_experts_through_the_engine(model_dir) -> None:
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", cpu_moe=True)
    want = [o.token_ids for o in LLM(str(model_dir), **kw).generate(PROMPTS, GREEDY)]
    per_expert = 3 * 64 * 32 * 4
    llm = LLM(str(model_dir), hot_experts="online", hot_expert_memory=6 * per_expert, **kw)
    online = llm.engine.model.cpu_experts.online
    assert online is not None and all(len(ex.hot_ids) == 2 for ex in online.executors.values())  # 6 over 3 layers
    online.interval = 4
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert online.steps >= 16 and online.swaps > 0  # real routing is not experts 0 and 1
    assert "online" in llm.engine.model.cpu_experts.placement.hot_source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_online_swaps_land_between_steps_and_keep_the_tokens(model_dir) -> None:
    """Online hot experts on CUDA: swaps copied on a side stream land at step boundaries. fp32
    (eager): the all-CPU run's tokens; bf16 in decode graphs (the counting and the swapped weights
    live in the captured buffers): the eager bf16 run's tokens."""
    # 6 fp32 experts: 2 of each layer's 8 hot, so the real routing has something to swap in
    kw = dict(device="cuda", kv_cache_memory="64MiB", cpu_moe=True, hot_experts="online",
              hot_expert_memory=6 * 3 * 64 * 32 * 4)
    want = [o.token_ids for o in LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_memory="64MiB",
                                     cpu_moe=True).generate(PROMPTS, GREEDY)]
    llm = LLM(str(model_dir), dtype="float32", **kw)
    llm.engine.model.cpu_experts.online.interval = 4
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.engine.model.cpu_experts.online.swaps > 0
    runs = []
    for eager in (True, False):
        # bf16 experts are half the size: the same 2 of each layer's 8 hot. Streaming off: on the
        # H200 the bf16 runs counted nothing (counts all 0, no swap) while fp32 swapped. A streamed
        # step bypasses the hot experts, and bf16 is the dtype that streams on CUDA: with the tiny
        # model's experts the cost model's threshold is the likely cause (not confirmed)
        bf16 = kw | {"hot_expert_memory": 6 * 3 * 64 * 32 * 2, "stream_experts": "off"}
        llm = LLM(str(model_dir), dtype="bfloat16", enforce_eager=eager, **bf16)
        llm.engine.model.cpu_experts.online.interval = 4
        runs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
        assert llm.engine.model.cpu_experts.online.swaps > 0 and bool(llm.engine.runner.graphs) != eager
    assert runs[0] == runs[1]
