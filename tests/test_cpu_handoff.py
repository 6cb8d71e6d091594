"""The doorbell (tandem/offload/handoff.py, moe_doorbell.cpp): the thread that runs a layer's CPU
experts when a stream asks through pinned flags. Driven by hand here (no GPU): the test writes the
request flag as the stream would and waits for the done flag."""

import time

import pytest
import torch

from tandem.config import OffloadConfig

cpu_experts = pytest.importorskip("tandem.offload.cpu_experts")
from tandem.offload.handoff import Doorbell  # noqa: E402


def _layer(seed: int, experts: int = 4, hidden: int = 64, inter: int = 32) -> "cpu_experts.CpuExpertLayer":
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(experts, inter, hidden, generator=g) * 0.1 for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    return cpu_experts.CpuExpertLayer.from_dense(gate, up, down, "fp32")


def _buffers(rows: int = 3, hidden: int = 64, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int64)[:rows, :k].contiguous()
    w = torch.rand(rows, k, generator=g)
    return x, ids, w, torch.zeros(rows, hidden), torch.tensor([rows], dtype=torch.int32)


def _serve(bell: Doorbell, number: int, timeout: float = 30.0) -> None:
    """Rings job `number` as a stream would, and waits for its done flag."""
    bell.request(number)
    deadline = time.monotonic() + timeout
    while bell.done() != number + 1:
        assert time.monotonic() < deadline, f"the doorbell did not serve job {number} in {timeout} s"
        time.sleep(1e-4)


def test_the_doorbell_runs_the_job_asked_for():
    x, ids, w, out, count = _buffers()
    layers = [_layer(1), _layer(2)]
    bell = Doorbell()
    jobs = [layer.host_job(x, ids, w, out, count) for layer in layers]
    assert [bell.add(job) for job in jobs] == [0, 1]
    _serve(bell, 1)
    torch.testing.assert_close(out, layers[1](x, ids, w))
    _serve(bell, 0)  # another job on the same buffers
    torch.testing.assert_close(out, layers[0](x, ids, w))
    x.mul_(-2.0)
    _serve(bell, 0)  # the same job twice in a row: its stale done flag was cleared by the request
    torch.testing.assert_close(out, layers[0](x, ids, w))
    assert bell.served == 3
    bell.check()
    bell.close()


def test_the_doorbell_reads_the_row_count_when_it_runs():
    x, ids, w, out, count = _buffers()
    layer, bell = _layer(3), Doorbell()
    number = bell.add(layer.host_job(x, ids, w, out, count))
    count.fill_(2)
    out.fill_(5.0)
    _serve(bell, number)
    torch.testing.assert_close(out[:2], layer(x[:2], ids[:2], w[:2]))
    assert out[2].eq(5.0).all()  # the row past the count is left alone
    bell.close()


def test_a_bad_request_is_answered_and_reported():
    """The stream must never wait forever: an unknown job and a failing call still set done."""
    x, ids, w, out, count = _buffers()
    bell = Doorbell()
    number = bell.add(_layer(4).host_job(x, ids, w, out, count))
    _serve(bell, number + 5)
    with pytest.raises(RuntimeError, match="job 5, which does not exist"):
        bell.check()
    bell.close()

    bell = Doorbell()
    number = bell.add(_layer(4).host_job(x, ids, w, out, count))
    ids[1, 0] = 9  # the layer has 4 experts
    _serve(bell, number)
    with pytest.raises(ValueError, match="expert 9"):
        bell.check()
    bell.close()


def test_the_handoff_flag_is_checked():
    assert OffloadConfig().cpu_moe_handoff == "poll"  # the default (BENCHMARKS.md, session 23)
    assert OffloadConfig(cpu_moe_handoff="hostfunc").cpu_moe_handoff == "hostfunc"
    with pytest.raises(ValueError, match="--cpu-moe-handoff must be one of hostfunc, poll"):
        OffloadConfig(cpu_moe_handoff="callback")


def test_submit_gives_the_call_s_output():
    """The MoE executor's optional submit/collect (tandem/models/layers/moe.py): an executor
    without it is called at once; the CPU experts on a CPU run compute at once too."""
    from tandem.models.layers.moe import submit_experts
    from tandem.offload.cpu_executor import CpuMoEExecutor

    x, ids, w, _, _ = _buffers()
    layer = _layer(5)
    want = layer(x, ids, w)
    calls = []
    collect = submit_experts(lambda *a: calls.append(1) or layer(*a), x, ids, w)
    assert calls == [1]  # called by submit, not by collect
    torch.testing.assert_close(collect(), want)
    torch.testing.assert_close(submit_experts(CpuMoEExecutor(layer, None), x, ids, w)(), want)
