"""The runner's static graph inputs (StaticInputs) and what a replay stages into them, on CPU; the
pinned, asynchronous upload under a CUDA graph on CUDA."""

import pytest
import torch

from tandem.core import Request, SamplingParams
from tandem.engine.runner import _PER_TOKEN, ModelRunner, _Graph
from tandem.engine.scheduler import ScheduledRequest
from tandem.engine.static_inputs import StaticInputs
from tandem.kv.manager import KVCacheManager
from tandem.kv.spec import KVCacheSpec, group_layers

F32 = torch.float32
SLIDE = KVCacheSpec("sliding_window", 1, 8, F32, window=6, k_is_v=True)
CSA = KVCacheSpec("compressed", 1, 8, F32, ratio=2, index_head_dim=4, overlap=True)
HCA = KVCacheSpec("compressed", 1, 8, F32, ratio=4)
BS = 4


def make_inputs(device: torch.device) -> StaticInputs:
    regions = {"a": (6, torch.int64, 7), "b": (3, torch.int32, 1), "c": (5, torch.int64, -1)}
    return StaticInputs(regions, [(4, 6, 9), (4, 6, 2)], device)


def layout(inputs: StaticInputs) -> list[tuple]:
    views = [*inputs.device.values(), *inputs.tables]
    return [(v.data_ptr(), v.shape, v.stride(), v.dtype) for v in views]


def test_upload_writes_every_region_in_place():
    inputs = make_inputs(torch.device("cpu"))
    dev = inputs.device
    assert dev["a"].tolist() == [7] * 6 and dev["b"].tolist() == [1] * 3 and dev["c"].tolist() == [-1] * 5
    assert (dev["a"].dtype, dev["b"].dtype, dev["c"].dtype) == (torch.int64, torch.int32, torch.int64)
    assert all(t.tolist() == [[v] * 6] * 4 for t, v in zip(inputs.tables, (9, 2)))
    before = layout(inputs)
    inputs.host["a"][:4] = [1, 2, 3, 4]
    inputs.host["b"][:] = range(3)
    inputs.host["c"][:2] = [2**40, -5]
    assert dev["a"].tolist() == [7] * 6  # nothing reaches the device before upload
    inputs.upload([])
    assert dev["a"].tolist() == [1, 2, 3, 4, 7, 7]  # the rest keeps what the host mirror held
    assert dev["b"].tolist() == [0, 1, 2] and dev["c"].tolist() == [2**40, -5, -1, -1, -1]
    inputs.wait()
    inputs.host["a"][:] = 0
    inputs.upload([])
    assert dev["a"].tolist() == [0] * 6 and dev["b"].tolist() == [0, 1, 2]
    assert layout(inputs) == before  # graphs read the views by address


def test_a_table_corner_lands_in_place_and_nothing_else_moves():
    inputs = make_inputs(torch.device("cpu"))
    before = layout(inputs)
    inputs.table_host(0, 3, 2)[:] = [1, 2, 3, 4, 5, 6]  # packed [3, 2]: strided in the [4, 6] table
    inputs.table_host(1, 1, 4)[:] = [8, 7, 6, 5]
    inputs.upload([(3, 2), (1, 4)])
    assert inputs.tables[0].tolist() == [[1, 2, 9, 9, 9, 9], [3, 4, 9, 9, 9, 9], [5, 6, 9, 9, 9, 9], [9] * 6]
    assert inputs.tables[1].tolist() == [[8, 7, 6, 5, 2, 2]] + [[2] * 6] * 3
    assert layout(inputs) == before


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_long_tables_host_staging_grows_with_the_corners_it_packs(device):
    inputs = StaticInputs({"a": (1, torch.int64, 0)}, [(2, 200, 3)], torch.device(device))
    table = inputs.tables[0]
    before = (table.data_ptr(), table.shape, table.stride())
    for width in (10, 100, 200, 50):  # 2 x 64 entries staged at first: the long corners grow it
        inputs.wait()
        inputs.table_host(0, 2, width)[:] = range(2 * width)
        inputs.upload([(2, width)])
        assert table[:, :width].flatten().tolist() == list(range(2 * width))
    assert table[:, 200:].numel() == 0 and (table.data_ptr(), table.shape, table.stride()) == before


def v4_runner(max_b: int, max_q: int) -> tuple[ModelRunner, KVCacheManager]:
    kv = KVCacheManager(group_layers([SLIDE, (SLIDE, CSA), (SLIDE, HCA)]), 64, BS, True, num_state_slots=4)
    runner = ModelRunner(model=None, kv=kv, device=torch.device("cpu"))  # type: ignore[arg-type]
    runner._allocate_static(max_b, max_q, 16)
    runner.buckets = (1, 2, 4)
    return runner, kv


def decoding(kv: KVCacheManager, rid: str, prompt_len: int, draft: tuple[int, ...]) -> ScheduledRequest:
    r = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams())
    assert kv.allocate_slots(r, prompt_len)
    r.num_computed_tokens = prompt_len
    kv.commit(r)
    r.output_token_ids = [77]
    assert kv.allocate_slots(r, 1 + len(draft))
    return ScheduledRequest.of(r, 1, draft)


class _NoGraph:
    def replay(self) -> None:
        pass


def replay(runner: ModelRunner, batch: list[ScheduledRequest], key: tuple[int, int]) -> None:
    runner.graphs = {key: _Graph(_NoGraph(), torch.zeros(key[0] * key[1], 2), None)}  # type: ignore[arg-type]
    runner._replay(batch, key)


def test_replay_stages_the_eager_step_padded_with_the_sinks():
    """A verify step of 3 requests (drafts of 1, 0 and 2 tokens) replayed as (bucket 4, q 3): each
    request's rows are the eager step's, its pad tokens and the padded batch row point at the sinks
    — on statics a previous, larger replay left real values in."""
    runner, kv = v4_runner(4, 3)
    layout_before = [(t.data_ptr(), t.shape, t.stride()) for t in (runner._ids, runner._pos, *runner._slots)]
    earlier = [decoding(kv, f"old{i}", 30 + i, (1, 2)) for i in range(4)]
    replay(runner, earlier, (4, 3))
    for s in earlier:
        kv.free(s.request)
    batch = [decoding(kv, "a", 9, (5,)), decoding(kv, "b", 31, ()), decoding(kv, "c", 6, (5, 6))]
    bucket, q, n = 4, 3, 3
    replay(runner, batch, (bucket, q))
    ids, pos, step = runner.build_step(batch)
    starts = step.query_start_loc_cpu
    sinks = [kv.null_block(g) for g in range(3)]
    null_state, null_snaps = kv.num_state_slots, runner._state_pads["snapshot_slots"]

    def rows(eager: list[int], pad_token: int, pad_row: int, pad_end: list[int] | None = None) -> list[int]:
        out = []
        for i, s in enumerate(batch):
            tail = pad_token if pad_end is None else pad_end[i]
            out += eager[starts[i] : starts[i + 1]] + [tail] * (q - s.num_tokens)
        return out + [pad_row] * (bucket - n) * q

    assert runner._ids[: bucket * q].tolist() == rows(ids.tolist(), 0, 0)
    assert runner._pos[: bucket * q].tolist() == rows(pos.tolist(), 0, 0, [e - 1 for e in step.seq_lens_cpu])
    assert runner._qsl[: bucket + 1].tolist() == [0, 3, 6, 9, 12]
    assert runner._seq[:bucket].tolist() == [e + q - s.num_tokens for e, s in zip(step.seq_lens_cpu, batch)] + [q]
    for g in range(3):
        sink_slot = sinks[g] * BS
        assert runner._slots[g][: bucket * q].tolist() == rows(step.slot_mappings[g].tolist(), sink_slot, sink_slot)
        width = max(len(kv.block_ids(s.request.request_id, g)) for s in batch) + 1
        for i, s in enumerate(batch):
            blocks = kv.block_ids(s.request.request_id, g)
            assert runner._tables[g][i, :width].tolist() == blocks + [sinks[g]] * (width - len(blocks))
        assert runner._tables[g][n:bucket, :width].eq(sinks[g]).all()
    for name in ("state_slots", "snapshot_slots", "request_state_slots", "restore_ids"):
        pads = {"state_slots": [null_state] * 3, "request_state_slots": [null_state] * 3,
                "snapshot_slots": null_snaps, "restore_ids": [-1] * 3}[name]
        for g in range(3):
            static, eager = runner._state[name][g], getattr(step, name)[g]
            assert (static is None) == (eager is None) == (g == 0)  # the sliding group has no state
            if static is None:
                continue
            if name in _PER_TOKEN:
                assert static[: bucket * q].tolist() == rows(eager.tolist(), pads[g], pads[g])
            else:
                assert static[:bucket].tolist() == eager.tolist() + [pads[g]] * (bucket - n)
    assert any(v != null_snaps[1] for v in runner._state["snapshot_slots"][1][: bucket * q].tolist())  # b closes a unit
    after = [(t.data_ptr(), t.shape, t.stride()) for t in (runner._ids, runner._pos, *runner._slots)]
    assert after == layout_before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_uploads_are_pinned_async_and_feed_a_captured_graph():
    """A graph captured on the device views reads each step's upload (staged in pinned memory, the
    host mirror rewritten only after `wait`), a strided multi-row table corner included."""
    inputs = make_inputs(torch.device("cuda"))
    assert inputs._host_buffer.is_pinned() and all(t.is_pinned() for t in inputs._table_host)
    out = torch.zeros(6 + 4 * 6, dtype=torch.int64, device="cuda")
    a, table = inputs.device["a"], inputs.tables[0]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out[:6].copy_(a * 2)
        out[6:].copy_(table.flatten().long())
    for step in range(5):
        inputs.wait()
        inputs.host["a"][:] = [step + i for i in range(6)]
        inputs.table_host(0, 3, 2)[:] = [100 * step + i for i in range(6)]
        inputs.upload([(3, 2)])
        graph.replay()
        got = out.tolist()
        assert got[:6] == [2 * (step + i) for i in range(6)]
        t = [got[6 + 6 * r : 12 + 6 * r] for r in range(4)]
        assert [row[:2] for row in t[:3]] == [[100 * step + 2 * r, 100 * step + 2 * r + 1] for r in range(3)]
        assert t[3] == [9] * 6 and all(row[2:] == [9] * 4 for row in t)
