"""The DeepSeek-V4 compressor-entry kernels (tandem/kernels/deepseek_v4_compress.py) against the
torch path they replace (`pool_entries` in tandem/models/deepseek_v4_decode.py, itself checked
against transformers through the engine): overlapping (CSA and its indexer) and not (HCA), tokens
that close a window and ones that do not (n < 0 included, n = 0 where window -1 is masked), ring
rows that wrap, float32 and bfloat16, YaRN's cos/sin scale. Without CUDA the kernels run in Triton's
interpreter on tiny shapes; with CUDA (`-m gpu`) on V4-Flash's shapes, also replayed from a graph.
With prefix caching, the overlap snapshot's write (folded into the pooling) and its restore (one
launch per layer) are data movement: bit for bit `_compress`'s and `_restore`'s torch path."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from triton_interp import interpret_without_cuda, interpreted_module, kernel_test_setup  # noqa: F401 (autouse)

interpret_without_cuda()  # before anything imports Triton

from tandem.models.deepseek_v4_attention import InterleavedRotary, WindowCompressor  # noqa: E402
from tandem.models.deepseek_v4_decode import _restore, _window_rows, pool_entries  # noqa: E402
from tandem.models.layers.rotary import RopeConfig  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
YARN = RopeConfig(theta=160000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536)


@pytest.fixture(scope="module")
def kern():
    yield from interpreted_module("tandem.kernels.deepseek_v4_compress", "_pool_kernel", language=True)


def check(kern, *, ratio: int, head_dim: int, rope_dim: int, overlap: bool, dtype: torch.dtype, device: str,
          positions: list[int], ring_windows: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    c = WindowCompressor(16, head_dim, ratio, overlap, 1e-6)
    with torch.no_grad():
        c.kv_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    c = c.to(device=device, dtype=dtype)
    rotary = InterleavedRotary(rope_dim, YARN).to(device)
    width = 2 * head_dim if overlap else head_dim
    slots = 3
    ring = (torch.randn(slots + 1, ring_windows * ratio, 2 * width, generator=g) * 2).to(device, dtype)
    pos = torch.tensor(positions, device=device)
    slot = torch.arange(len(positions), device=device) % slots
    want, _ = pool_entries(c, ring, slot, pos, rotary)
    got = kern.deepseek_v4_compress_entries(ring, slot, pos, ratio, head_dim, overlap, c.kv_norm.weight, c.kv_norm.eps,
                                            rotary.inv_freq, rotary.attention_scaling)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same roundings; exp, cos and sums in another order: an ulp here and there, which
        # the rotary's differences can amplify (Triton's interpreter also truncates to bf16 where the
        # GPU rounds: up to a few ulps there)
        atol = 2**-6 if device == "cuda" else 2**-4
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=atol)
        if device == "cuda":  # (the interpreter's truncation moves most values by an ulp)
            assert (got != want).float().mean() < 0.05


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_entries_match_the_torch_path(kern, overlap, dtype) -> None:
    # positions: no window closed yet (n = -1), the first window (n = 0: window -1 masked), later
    # windows wrapping around the ring, and tokens between boundaries
    check(kern, ratio=4, head_dim=32, rope_dim=8, overlap=overlap, dtype=dtype, device="cpu",
          positions=[0, 2, 3, 4, 7, 9, 14, 15, 31])


def test_long_windows_span_several_slot_tiles(kern) -> None:
    check(kern, ratio=40, head_dim=24, rope_dim=8, overlap=False, dtype=torch.float32, device="cpu",
          positions=[39, 80, 119, 200])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ring_write_and_entry_write_match_compress(kern, dtype) -> None:
    """`deepseek_v4_ring_write` is `_compress`'s ring update (gate + position_bias[p % m] rounded in the
    projections' dtype), and the entries' page write lands where `_compress` writes: the token's
    slot when it closes its window, else the sink."""
    g = torch.Generator().manual_seed(3)
    ratio, head_dim, slots = 4, 16, 3
    c = WindowCompressor(12, head_dim, ratio, True, 1e-6).to(dtype=dtype)
    with torch.no_grad():
        c.position_bias.copy_(torch.randn(c.position_bias.shape, generator=g))
    width = 2 * head_dim
    ring = torch.randn(slots + 1, 3 * ratio, 2 * width, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 6, 11])
    slot = torch.tensor([0, 1, 2, 0])
    hidden = torch.randn(4, 12, generator=g).to(dtype)
    want = ring.clone()
    kv, gate = c.project(hidden, positions)
    want[slot, positions % want.shape[1]] = torch.cat((kv, gate), dim=-1)
    got = ring.clone()
    kern.deepseek_v4_ring_write(got, slot, positions, c.kv_proj(hidden), c.gate_proj(hidden), c.position_bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # the interpreter truncates the sum to bf16 where torch (and the GPU) rounds
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    pages = torch.zeros(5, 4, head_dim, dtype=dtype)  # [N + 1, bs, D]; row 4 the sink
    page_slots = torch.tensor([1, 2, 5, 9])
    rotary = InterleavedRotary(8, YARN)
    entries = kern.deepseek_v4_compress_entries(got, slot, positions, ratio, head_dim, True, c.kv_norm.weight, 1e-6,
                                                rotary.inv_freq, rotary.attention_scaling, pages=pages,
                                                page_slots=page_slots, sink_slot=16)
    flat = pages.view(-1, head_dim)
    closes = torch.tensor([False, True, False, True])  # positions 3 and 11 close windows 0 and 2
    assert torch.equal(flat[page_slots[closes]], entries[closes])
    assert torch.equal(flat[16], entries[2]) or torch.equal(flat[16], entries[0])  # the sink: either pad
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[page_slots[closes]] = True
    written[16] = True
    assert not flat[~written].any()


def test_bad_shapes_are_refused(kern) -> None:
    ring = torch.zeros(2, 8, 2 * 32)
    args = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 4, 32)
    with pytest.raises(ValueError, match="does not hold ratio-4 windows"):
        kern.deepseek_v4_compress_entries(ring, *args, True, torch.ones(32), 1e-6, torch.ones(4), 1.0)
    with pytest.raises(ValueError, match="rope_dim 34 does not fit"):
        kern.deepseek_v4_compress_entries(ring, *args, False, torch.ones(32), 1e-6, torch.ones(17), 1.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ratio,overlap,head_dim", [(4, True, 512), (4, True, 128), (128, False, 512)],
                         ids=["csa", "indexer", "hca"])
def test_on_cuda_v4_flash_shapes(kern, ratio, overlap, head_dim) -> None:
    check(kern, ratio=ratio, head_dim=head_dim, rope_dim=64, overlap=overlap, dtype=torch.bfloat16, device="cuda",
          positions=[0, ratio - 1, ratio, 2 * ratio - 1, 5 * ratio + 1, 9 * ratio - 1], ring_windows=4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ratio,width", [(4, 1024), (4, 256), (128, 512)], ids=["csa", "indexer", "hca"])
def test_on_cuda_ring_write_is_exact(kern, ratio, width) -> None:
    g = torch.Generator().manual_seed(4)
    ring = torch.randn(5, 2 * ratio if ratio > 4 else 3 * ratio, 2 * width, generator=g).to("cuda", torch.bfloat16)
    positions = torch.tensor([0, ratio - 1, 7 * ratio + 2], device="cuda")
    slot = torch.tensor([0, 3, 1], device="cuda")
    kv, gate = (torch.randn(3, width, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    bias = torch.randn(ratio, width, generator=g).to("cuda", torch.bfloat16)
    want = ring.clone()
    want[slot, positions % want.shape[1]] = torch.cat((kv, gate + bias[positions % ratio]), dim=-1)
    kern.deepseek_v4_ring_write(ring, slot, positions, kv, gate, bias)
    torch.testing.assert_close(ring, want, rtol=0, atol=0)


# -- prefix caching: the overlap snapshot's write (in `_pool_kernel`) and restore ------------------

def _snapshot_case(ratio: int, head_dim: int, overlap: bool, dtype: torch.dtype, device: str, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    width = 2 * head_dim if overlap else head_dim
    ring = (torch.randn(4, 3 * ratio, 2 * width, generator=g) * 2).to(device, dtype)  # [S + 1, R, 2W]
    snaps = torch.randn(6, ratio, 2 * width, generator=g).to(device, dtype)  # [N + 1, m, 2W]; row 5 the null one
    return ring, snaps


@pytest.mark.parametrize("ratio,head_dim,overlap", [(4, 16, True), (4, 16, False), (40, 24, False)],
                         ids=["csa", "hca", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_snapshot_write_is_compress_s_copy(kern, ratio, head_dim, overlap, dtype) -> None:
    """With `snapshots`, `_pool_kernel` also stores each token's window rows (every column) at its
    snapshot slot, bit for bit what `_compress` writes; the null row takes the others' (any one of
    them), and the entries do not change."""
    ring, snaps = _snapshot_case(ratio, head_dim, overlap, dtype, "cpu")
    m = ratio
    positions = torch.tensor([m - 1, 2 * m - 1, 2 * m + 1, 5 * m - 1, 0, 7 * m - 1])  # n = 0, 1, 1, 4, -1, 6
    slot = torch.tensor([0, 1, 2, 0, 1, 2])
    snap_slots = torch.tensor([3, 5, 5, 0, 5, 2])
    want = snaps.clone()
    want[snap_slots] = _window_rows(ring, slot, (positions + 1) // m - 1, m)
    rotary = InterleavedRotary(8, YARN)
    args = (ring, slot, positions, m, head_dim, overlap, torch.ones(head_dim, dtype=dtype), 1e-6, rotary.inv_freq,
            rotary.attention_scaling)
    got = snaps.clone()
    entries = kern.deepseek_v4_compress_entries(*args, snapshots=got, snapshot_slots=snap_slots)
    assert torch.equal(entries, kern.deepseek_v4_compress_entries(*args))
    assert torch.equal(got[:5], want[:5])
    null = _window_rows(ring, slot, (positions + 1) // m - 1, m)[snap_slots == 5]
    assert any(torch.equal(got[5], rows) for rows in null)


def _restore_case(dtype: torch.dtype, device: str, head_dim: int, index_dim: int, seed: int = 6):
    """A CSA layer's cache (compressor and indexer rings with snapshots) and a step of four
    requests: two restore (one a verify of 3 tokens), one does not, and a pad at the sink slot."""
    from tandem.kv.tensors import LayerCache

    g = torch.Generator().manual_seed(seed)
    m, slots = 4, 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    cache = LayerCache(0, torch.zeros(1, device=device),
                       state={"compressor": rand(slots + 1, 3 * m, 8 * head_dim), "indexer": rand(slots + 1, 3 * m,
                                                                                                 8 * index_dim)},
                       snapshots={"compressor": rand(5, m, 8 * head_dim), "indexer": rand(5, m, 8 * index_dim)})
    dev = {"device": device}
    step = SimpleNamespace(  # the StepMetadata fields `_restore` reads
        restore_ids=(torch.tensor([2, -1, 0, -1], **dev),), request_state_slots=(torch.tensor([1, 0, 2, slots], **dev),),
        seq_lens=torch.tensor([129, 67, 67, 1], dtype=torch.int32, **dev),  # starts 128, 66, 64, 0
        query_start_loc=torch.tensor([0, 1, 2, 5, 6], dtype=torch.int32, **dev))
    return cache, step, m


def _restored(cache, step, m: int, kernel: bool) -> dict[str, torch.Tensor]:
    cache = replace(cache, state={k: v.clone() for k, v in cache.state.items()})
    _restore(cache, step, m, kernel)
    return cache.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_snapshot_restore_is_the_torch_restore(kern, dtype) -> None:
    """`deepseek_v4_snapshot_restore` (both rings of a CSA layer in one launch) leaves the rings
    bit for bit as `_restore`'s torch path: window start // m - 1 of a restoring request's slot
    becomes its snapshot, every other row (requests without a restore, the pad) is untouched."""
    cache, step, m = _restore_case(dtype, "cpu", head_dim=4, index_dim=2)
    want, got = _restored(cache, step, m, False), _restored(cache, step, m, True)
    for name in ("compressor", "indexer"):
        assert torch.equal(got[name], want[name]), name
        # window 31 of slot 1 (positions 124-127: ring rows 4-7 of 12), window 15 of slot 2 (rows 0-3)
        assert torch.equal(got[name][1, 4:8], cache.snapshots[name][2])
        assert torch.equal(got[name][2, 0:4], cache.snapshots[name][0])
        assert torch.equal(got[name][[0, 3]], cache.state[name][[0, 3]])
    one = {k: v.clone() for k, v in cache.state.items()}
    kern.deepseek_v4_snapshot_restore([one["indexer"]], [cache.snapshots["indexer"]], step.request_state_slots[0],
                                      step.restore_ids[0], step.seq_lens, step.query_start_loc)
    assert torch.equal(one["indexer"], want["indexer"]) and torch.equal(one["compressor"], cache.state["compressor"])


def test_bad_snapshot_shapes_are_refused(kern) -> None:
    cache, step, _ = _restore_case(torch.float32, "cpu", head_dim=4, index_dim=2)
    rings, snaps = list(cache.state.values()), list(cache.snapshots.values())
    fields = (step.request_state_slots[0], step.restore_ids[0], step.seq_lens, step.query_start_loc)
    with pytest.raises(ValueError, match="do not fit"):
        kern.deepseek_v4_snapshot_restore(rings, snaps[::-1], *fields)
    with pytest.raises(ValueError, match="give one or two pairs"):
        kern.deepseek_v4_snapshot_restore(rings, snaps[:1], *fields)
    with pytest.raises(ValueError, match=r"need \[B\] x3"):
        kern.deepseek_v4_snapshot_restore(rings, snaps, *fields[:2], step.seq_lens[:2], step.query_start_loc)
    ring = torch.zeros(4, 12, 32)  # ratio 4, head_dim 16, no overlap: rows 2 * 16 wide
    with pytest.raises(ValueError, match="snapshots .* do not hold ratio-4 windows"):
        kern.deepseek_v4_compress_entries(ring, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                          4, 16, False, torch.ones(16), 1e-6, torch.ones(4), 1.0,
                                          snapshots=torch.zeros(5, 4, 16), snapshot_slots=torch.zeros(1, dtype=torch.int64))


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_snapshot_restore_and_write_are_exact_and_captured(kern) -> None:
    """V4-Flash's CSA shapes (head_dim 512, the indexer's 128), bf16: the restore and the snapshot
    write equal the torch path bit for bit, and a captured restore replays new restore ids."""
    cache, step, m = _restore_case(torch.bfloat16, "cuda", head_dim=512, index_dim=128)
    torch.testing.assert_close(_restored(cache, step, m, True), _restored(cache, step, m, False), rtol=0, atol=0)
    rings = {k: v.clone() for k, v in cache.state.items()}
    restore = torch.full_like(step.restore_ids[0], -1)
    names = list(rings)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern.deepseek_v4_snapshot_restore([rings[n] for n in names], [cache.snapshots[n] for n in names],
                                          step.request_state_slots[0], restore, step.seq_lens, step.query_start_loc)
    for n in names:
        rings[n].copy_(cache.state[n])
    restore.copy_(step.restore_ids[0])
    graph.replay()
    torch.testing.assert_close(rings, _restored(cache, step, m, False), rtol=0, atol=0)
    for head_dim, overlap in ((512, True), (128, True)):
        ring, snaps = _snapshot_case(m, head_dim, overlap, torch.bfloat16, "cuda")
        positions = torch.tensor([m - 1, 2 * m - 1, 9 * m - 1, 5], device="cuda")
        slot = torch.tensor([0, 1, 2, 3], device="cuda")
        snap_slots = torch.tensor([3, 0, 2, 5], device="cuda")
        want = snaps.clone()
        want[snap_slots] = _window_rows(ring, slot, (positions + 1) // m - 1, m)
        rotary = InterleavedRotary(64, YARN).to("cuda")
        kern.deepseek_v4_compress_entries(ring, slot, positions, m, head_dim, overlap,
                                          torch.ones(head_dim, device="cuda", dtype=torch.bfloat16), 1e-6,
                                          rotary.inv_freq, rotary.attention_scaling, snapshots=snaps,
                                          snapshot_slots=snap_slots)
        torch.testing.assert_close(snaps[:5], want[:5], rtol=0, atol=0)
