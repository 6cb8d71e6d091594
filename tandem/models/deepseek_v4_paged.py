"""DeepSeek-V4's attention state on the paged cache groups, the torch reference: for each request
of a step, `load` gathers its `AttentionState` (deepseek_v4_state.py) from the group tensors, the
reference `forward_step` runs on it, and `store` writes back what the step added. The paged
forward is therefore the incremental reference itself, which is exact against the cache-free one.

Where each part of a layer's state lives (tandem/kv/tensors.py has the tensors, tandem/kv/spec.py
the geometry):

- the sliding window's K=V rows: the sliding group's pages, one slot per token; a step reads the
  `window - 1` rows before its first token;
- compressed entries (and a CSA layer's index keys): the compressed group's pages, entry n in slot
  n of the block table's geometry; a step reads every closed entry;
- the compressor's (and indexer's) raw projections, kv | gate: the request's state slot, a ring of
  `state_ring` windows, row p % (state_ring * ratio) for token p; a step reads the open window's
  rows (and, for CSA's overlap, the previous window's) and writes its tokens' rows;
- CSA's overlap at a prefix boundary: a snapshot of the last closed window's rows, written when a
  step closes that window and copied back into the ring by the first step after a prefix hit.

It syncs with the host (index lists built per request) and is not capturable in a CUDA graph; the
Triton kernels for GPU decode replace it behind the same state layout.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tandem.core import StepMetadata
from tandem.kv.tensors import LayerCache, quantize_fp8
from tandem.models.deepseek_v4_attention import DeepseekV4Attention, SparseCompressor
from tandem.models.deepseek_v4_state import AttentionState, CompressorState, TokenRows


def _slots(table: torch.Tensor, block_size: int, lo: int, hi: int) -> torch.Tensor:
    """Flat slots of positions (or entries) [lo, hi) through one request's block table row."""
    idx = torch.arange(lo, hi, device=table.device)
    return table[idx // block_size].long() * block_size + idx % block_size


def _flat(pages: torch.Tensor) -> torch.Tensor:
    """A paged tensor of one-vector slots ([1, N + 1, bs, 1, D] for the window, [N + 1, bs, W] for
    entries: V4 has one K=V head) -> a view [(N + 1) * bs, width], one row per slot."""
    return pages.view(-1, pages.shape[-1])


def _write(pages: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows [n, width] at flat slots; fp8 pages (with `scales`) get one scale per row (kv/tensors.py)."""
    if scales is None:
        _flat(pages)[slots] = rows.to(pages.dtype)
        return
    stored, scale = quantize_fp8(rows)  # [n, width], [n]
    _flat(pages)[slots] = stored
    scales.view(-1)[slots] = scale


def _read(pages: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [n, width] at flat slots, in `dtype` (fp8 pages dequantized by their scales)."""
    rows = _flat(pages)[slots]
    if scales is None:
        return rows
    return (rows.float() * scales.view(-1)[slots, None]).to(dtype)


def _pages(cache: LayerCache, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A compressed cache's pages of `name` ("compressor": the entries, "indexer": the index keys)."""
    if name == "indexer":
        assert cache.index_pages is not None
        return cache.index_pages, cache.index_scales
    return cache.pages, cache.scales


class PagedRequest:
    """One request of a step: its query span and its rows of the step's tables."""

    def __init__(self, step: StepMetadata, r: int) -> None:
        self.step, self.r = step, r
        q_len = step.query_start_loc_cpu[r + 1] - step.query_start_loc_cpu[r]
        self.end = step.seq_lens_cpu[r]
        self.start = self.end - q_len

    def table(self, cache: LayerCache) -> torch.Tensor:
        return self.step.block_tables[cache.group][self.r]

    def slot(self, cache: LayerCache) -> int:
        state = self.step.group_states[cache.group]
        assert state is not None, "a compressed group has its GroupState in the step"
        return state.slots[self.r]


def _ring_positions(ring_rows: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    return torch.arange(lo, hi, device=device) % ring_rows


def _load_compressor(cache: LayerCache, name: str, req: PagedRequest, ratio: int, overlap: bool) -> CompressorState:
    """The compressor state at `req.start`: its open window's projections (and the previous one's
    with overlap) from the state ring, every closed entry from the pages."""
    ring = cache.state[name][req.slot(cache)]  # [R, 2 * width]
    width = ring.shape[-1] // 2
    start = req.start
    lo = max(0, (start // ratio - int(overlap)) * ratio)
    rows = ring[_ring_positions(ring.shape[0], lo, start, ring.device)]  # [start - lo, 2 * width]
    n = start // ratio
    entries = _read(*_pages(cache, name), _slots(req.table(cache), req.step.block_size, 0, n), ring.dtype)  # [n, D]
    return CompressorState(ratio, overlap, TokenRows(rows[:, :width], start), TokenRows(rows[:, width:], start),
                           entries)


def _store_compressor(cache: LayerCache, name: str, req: PagedRequest, new: CompressorState) -> None:
    """Write what the step added: entries of the windows it closed, the projection rows of its
    tokens in the last windows it touched (as many as the ring holds: `KVCacheSpec.state_ring`),
    and CSA snapshots at prefix boundaries."""
    ratio, start, end = new.ratio, req.start, req.end
    first, last = start // ratio, end // ratio
    table = req.table(cache)
    if last > first:
        _write(*_pages(cache, name), _slots(table, req.step.block_size, first, last), new.entries[first:last])
    ring = cache.state[name][req.slot(cache)]
    lo = max(start, ((end - 1) // ratio - ring.shape[0] // ratio + 1) * ratio)
    ring[_ring_positions(ring.shape[0], lo, end, ring.device)] = torch.cat(
        (new.kv.span(lo, end), new.gate.span(lo, end)), dim=-1).to(ring.dtype)
    snaps = cache.snapshots.get(name)
    group = req.step.group_states[cache.group]
    unit = req.step.prefix_unit
    if snaps is None or group is None or not unit:
        return
    ids = group.snapshots[req.r]
    for boundary in range((start // unit + 1) * unit, end + 1, unit):  # prefix boundaries this step reaches
        i = boundary // unit - 1
        if i < len(ids) and ids[i] != group.null_snapshot:
            lo = boundary - ratio
            snaps[ids[i]] = torch.cat((new.kv.span(lo, boundary), new.gate.span(lo, boundary)), dim=-1)


def _restore_snapshot(cache: LayerCache, req: PagedRequest, ratio: int) -> None:
    """After a prefix hit: put the overlap window (the last closed before `start`) back into the ring."""
    group = req.step.group_states[cache.group]
    if group is None or group.restore[req.r] < 0:
        return
    sid, window = group.restore[req.r], req.start // ratio - 1
    for name, snaps in cache.snapshots.items():
        ring = cache.state[name][req.slot(cache)]
        ring[_ring_positions(ring.shape[0], window * ratio, (window + 1) * ratio, ring.device)] = snaps[sid]


def load(attn: DeepseekV4Attention, caches: tuple[LayerCache, ...], req: PagedRequest) -> AttentionState:
    """One layer's AttentionState of a request at the start of its step."""
    window_cache = caches[0]
    start = req.start
    lo = max(0, start - attn.sliding_window + 1)
    slots = _slots(req.table(window_cache), req.step.block_size, lo, start)
    rows = _read(window_cache.pages, window_cache.scales, slots, attn.kv_proj.weight.dtype)
    state = AttentionState(attn.sliding_window, TokenRows(rows, start))
    c = attn.compressor
    if c is None:
        return state
    cache = caches[1]
    if cache.snapshots:
        _restore_snapshot(cache, req, c.ratio)
    state = replace(state, compressor=_load_compressor(cache, "compressor", req, c.ratio, c.overlap))
    if isinstance(c, SparseCompressor):
        state = replace(state, indexer=_load_compressor(cache, "indexer", req, c.ratio, True))
    return state


def store(attn: DeepseekV4Attention, caches: tuple[LayerCache, ...], req: PagedRequest, new: AttentionState) -> None:
    """Write back one layer's rows the request's step added to `new` (its state after the step)."""
    window_cache = caches[0]
    slots = _slots(req.table(window_cache), req.step.block_size, req.start, req.end)
    _write(window_cache.pages, window_cache.scales, slots, new.window.span(req.start, req.end))
    if attn.compressor is None:
        return
    cache = caches[1]
    assert new.compressor is not None
    _store_compressor(cache, "compressor", req, new.compressor)
    if new.indexer is not None:
        _store_compressor(cache, "indexer", req, new.indexer)
