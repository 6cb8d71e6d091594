"""DeepSeek-V4's attention for decode and verify steps, free of host syncs so a CUDA graph can
capture it: every index it needs is a device tensor of the step (`StepMetadata`), and every
request does the same work whatever its position (a window that does not close this step is
pooled anyway and written to the sink).

Per compressed layer and token p (ratio m, ring of R = state_ring * m rows per request slot):

1. its projections (kv | gate) go to ring row p % R of its state slot (a pad's slot is the sink);
2. the window n = (p + 1) // m - 1 is pooled from the ring (with CSA's overlap, the previous
   window's Ca half too) exactly as the reference's `WindowCompressor.pool`, and written to the
   entry slot of a token that closes it, else to the sink; at a prefix boundary its rows also go
   to the overlap snapshot;
3. the CSA indexer scores every entry the block table covers, masks the unclosed ones and keeps
   its top `index_topk` (a stable sort: ties go to the lower entry, as in the reference).

The first step after a prefix hit first copies the overlap snapshot into the rings (`restore_ids`;
in a graph that copy launches every step, a no-op for a request with nothing to restore).
The attention itself is `deepseek_v4_paged_attention` (Triton, tandem/kernels/) on CUDA, or the
gather below, which is the same math in torch and serves CPU and fp8 pages; steps 1-2 are
`deepseek_v4_ring_write` and `deepseek_v4_compress_entries` on CUDA (the latter also writes the
snapshot; `deepseek_v4_snapshot_restore` restores a layer's snapshots in one launch), or
`pool_entries` below; the norms and rotary of q, the K=V row (with its window write) and the output
are `deepseek_v4_rope_tail` launches. What every layer shares (positions, request rows, cos/sin) is
made once a step (`DecodeStep`). Steps with a prefill chunk keep the reference path
(deepseek_v4_paged.py): gathering a chunk's keys per token would be quadratic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core import StepMetadata, token_requests
from tandem.kv.tensors import LayerCache
from tandem.models.deepseek_v4_attention import (
    DeepseekV4Attention,
    InterleavedRotary,
    SparseCompressor,
    WindowCompressor,
    apply_rope_tail,
    sink_attention,
)
from tandem.models.deepseek_v4_paged import _pages, _read, _write


def _table_slots(table: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of positions / entries idx [T, S] through the block-table rows of each token."""
    safe = idx.clamp(min=0)
    blocks = table[rows[:, None], (safe // block_size).clamp(max=table.shape[1] - 1)].long()
    return blocks * block_size + safe % block_size


def _sink_slot(pages: torch.Tensor) -> int:
    """The flat slot of the sink row's first entry (row `num_blocks` of [.., N + 1, bs, ..])."""
    n, bs = (pages.shape[0], pages.shape[1]) if pages.dim() == 3 else (pages.shape[1], pages.shape[2])
    return (n - 1) * bs


def _restore(cache: LayerCache, step: StepMetadata, ratio: int, kernel: bool) -> None:
    """First step after a prefix hit: window start // ratio - 1 of each restoring request's rings
    (every ring with snapshots: CSA's compressor and indexer) becomes its snapshots (the others
    rewrite what they hold). `kernel`: one Triton launch for all of them (a no-op program for a
    request without a restore), else torch (the reference)."""
    g, names = cache.group, tuple(cache.snapshots)
    restore, slots = step.restore_ids[g], step.request_state_slots[g]  # [B] each
    if kernel:
        from tandem.kernels.deepseek_v4_compress import deepseek_v4_snapshot_restore

        deepseek_v4_snapshot_restore([cache.state[n] for n in names], [cache.snapshots[n] for n in names], slots,
                                     restore, step.seq_lens, step.query_start_loc)
        return
    start = (step.seq_lens - (step.query_start_loc[1:] - step.query_start_loc[:-1])).long()  # [B]
    for name in names:
        ring, snaps = cache.state[name], cache.snapshots[name]
        R = ring.shape[1]
        rows = ((start // ratio - 1)[:, None] * ratio + torch.arange(ratio, device=ring.device)) % R  # [B, m]
        held = ring[slots[:, None], rows]
        ring[slots[:, None], rows] = torch.where(restore[:, None, None] >= 0, snaps[restore.clamp(min=0)], held)


def _compress(c: WindowCompressor, cache: LayerCache, name: str, hidden: torch.Tensor, positions: torch.Tensor,
              step: StepMetadata, rotary: InterleavedRotary, kernel: bool = False) -> None:
    """Steps 1-2 of the module docstring for one compressor (the layer's, or the CSA indexer's),
    with the snapshot write when prefix caching holds snapshots (after `_restore`). `kernel`: in
    Triton (tandem/kernels/deepseek_v4_compress.py), else in torch (the reference)."""
    g, m = cache.group, c.ratio
    ring = cache.state[name]  # [S + 1, R, 2 * width]
    slot = step.state_slots[g]  # [T]
    snaps = cache.snapshots.get(name)  # [N + 1, m, 2 * width] with prefix caching (CSA), else None
    pages, scales = _pages(cache, name)
    if kernel:
        from tandem.kernels.deepseek_v4_compress import (
            deepseek_v4_compress_entries,
            deepseek_v4_ring_write,
        )

        # kv_proj and gate_proj, then the ring rows, the pooled entries with the snapshot write and
        # (bf16 / fp32 pages) their page slots: three launches for what the torch path does in ~25
        # (~35 with snapshots)
        deepseek_v4_ring_write(ring, slot, positions, c.kv_proj(hidden), c.gate_proj(hidden), c.position_bias)
        entries = deepseek_v4_compress_entries(
            ring, slot, positions, m, c.head_dim, c.overlap, c.kv_norm.weight, c.kv_norm.eps, rotary.inv_freq,
            rotary.attention_scaling, pages=None if scales is not None else pages, page_slots=step.slot_mappings[g],
            sink_slot=_sink_slot(pages), snapshots=snaps, snapshot_slots=step.snapshot_slots[g] if snaps is not None
            else None)
        if scales is not None:
            _write(pages, scales, _entry_slots(step.slot_mappings[g], positions, m, pages), entries)
        return
    kv, gate = c.project(hidden, positions)  # [T, width] each
    ring[slot, positions % ring.shape[1]] = torch.cat((kv, gate), dim=-1).to(ring.dtype)
    entries, cur = pool_entries(c, ring, slot, positions, rotary)
    _write(pages, scales, _entry_slots(step.slot_mappings[g], positions, m, pages), entries)
    if snaps is not None:  # the window's ring rows; non-boundary tokens hit the sink row
        snaps[step.snapshot_slots[g]] = cur.to(snaps.dtype)


def _entry_slots(slot_mapping: torch.Tensor, positions: torch.Tensor, m: int, pages: torch.Tensor) -> torch.Tensor:
    """Where each token's entry goes: its slot when it closes its window, else the sink ([T])."""
    n = (positions + 1) // m - 1  # the window each token would close
    closes = ((positions + 1) % m == 0) & (n >= 0)
    return torch.where(closes, slot_mapping, _sink_slot(pages))


def _window_rows(ring: torch.Tensor, slot: torch.Tensor, n: torch.Tensor, m: int) -> torch.Tensor:
    """Ring rows of window n of each token's slot: [T, m, 2 * width]."""
    offsets = torch.arange(m, device=ring.device)
    return ring[slot[:, None], (n[:, None] * m + offsets) % ring.shape[1]]


def pool_entries(c: WindowCompressor, ring: torch.Tensor, slot: torch.Tensor, positions: torch.Tensor,
                 rotary: InterleavedRotary) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2's entries in torch: each token's window n = (p + 1) // m - 1 pooled from its ring
    slot exactly as `WindowCompressor.pool`, normed and rotated: [T, D] in the ring's dtype (the
    reference of the Triton kernel); and the window's ring rows it gathered, [T, m, 2 * width]."""
    m, D = c.ratio, c.head_dim
    width = ring.shape[2] // 2
    n = (positions + 1) // m - 1
    cur = _window_rows(ring, slot, n, m)  # [T, m, 2 * width]
    if c.overlap:  # slots [Ca of window n - 1, Cb of window n]; window -1 has none
        prev = _window_rows(ring, slot, n - 1, m)
        first = (n == 0)[:, None, None]
        kv_slots = torch.cat((prev[..., :D], cur[..., D:width]), dim=1)  # [T, 2m, D]
        prev_gate = prev[..., width : width + D].masked_fill(first, float("-inf"))
        gate_slots = torch.cat((prev_gate, cur[..., width + D :]), dim=1)
    else:
        kv_slots, gate_slots = cur[..., :width], cur[..., width:]
    # Over the pooled slots (dim 1), computed on the last dim: torch's softmax over an inner dim is
    # its "spatial" kernel, ~43 us for these few rows on the H200 against ~2 us for a copy and the
    # last-dim kernel (the same exp(x - max) / sum in float32).
    weights = gate_slots.transpose(1, 2).softmax(dim=-1, dtype=torch.float32).transpose(1, 2).to(kv_slots.dtype)
    entries = c.kv_norm((kv_slots * weights).sum(dim=1))  # [T, D]
    cos, sin = rotary(n.clamp(min=0) * m, entries.dtype)
    return apply_rope_tail(entries, cos, sin), cur


def _closed_entries(cache: LayerCache, name: str, step: StepMetadata, rows: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry the block table covers, per token: ([T, N, width], entry numbers [N])."""
    pages, scales = _pages(cache, name)
    table = step.block_tables[cache.group]
    idx = torch.arange(table.shape[1] * step.block_size, device=pages.device)
    slots = _table_slots(table, rows, idx.expand(rows.shape[0], -1), step.block_size)
    return _read(pages, scales, slots.flatten(), dtype).view(*slots.shape, pages.shape[-1]), idx


def _indexer_topk(attn: DeepseekV4Attention, cache: LayerCache, hidden: torch.Tensor, q_latent: torch.Tensor,
                  ctx: DecodeStep, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Step 3: the indexer's pick per token, [T, index_topk] entry numbers (-1: none). `ctx.kernel`:
    the query's rotary and the scores in Triton (tandem/kernels/deepseek_v4_indexer.py: the keys
    streamed, not gathered per token), else `IndexerScorer` on the gathered keys."""
    assert isinstance(attn.compressor, SparseCompressor)
    indexer = attn.compressor.indexer
    T, positions, step = hidden.shape[0], ctx.positions, ctx.step
    q = indexer.q_b_proj(q_latent).view(T, indexer.num_heads, indexer.head_dim)  # [T, Hi, Di]
    table = step.block_tables[cache.group]
    closed_count = (positions + 1) // indexer.ratio  # [T]
    if ctx.kernel:
        from tandem.kernels.deepseek_v4_indexer import deepseek_v4_indexer_scores
        from tandem.kernels.deepseek_v4_rope import deepseek_v4_rope_tail

        q = deepseek_v4_rope_tail(q, cos, sin)
        w = indexer.scorer.weights_proj(hidden)  # [T, Hi]; times w_scale in float32 in the kernel
        scores = deepseek_v4_indexer_scores(q, w, positions, ctx.rows, cache.index_pages, table, indexer.ratio,
                                            cache.index_scales, w_scale=indexer.scorer.w_scale)
    else:
        q = apply_rope_tail(q[:, None], cos[:, None, None], sin[:, None, None])  # [T, 1, Hi, Di]
        idx = torch.arange(table.shape[1] * step.block_size, device=hidden.device)
        closed = idx[None, :] < closed_count[:, None]
        keys, _ = _closed_entries(cache, "indexer", step, ctx.rows, hidden.dtype)  # [T, N, Di]
        scores = indexer.scorer(q, keys, hidden[:, None])[:, 0].masked_fill(~closed, float("-inf"))  # [T, N]
    k = min(indexer.topk, scores.shape[1])
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(picked < closed_count[:, None], picked, -1)


def _gather_attention(attn: DeepseekV4Attention, q: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                      caches: tuple[LayerCache, ...], step: StepMetadata, topk: torch.Tensor | None) -> torch.Tensor:
    """`deepseek_v4_paged_attention` in torch, vectorised over tokens: q [T, Hh, D] -> [T, Hh, D]."""
    window = caches[0]
    W = attn.sliding_window
    pos = positions[:, None] - W + 1 + torch.arange(W, device=q.device)  # [T, W]
    slots = _table_slots(step.block_tables[window.group], rows, pos, step.block_size)
    keys = _read(window.pages, window.scales, slots.flatten(), q.dtype).view(*slots.shape, q.shape[-1])  # [T, W, D]
    visible = pos >= 0
    c = attn.compressor
    if c is not None:
        entries, idx = _closed_entries(caches[1], "compressor", step, rows, q.dtype)  # [T, N, D]
        if topk is None:  # HCA: every closed entry
            seen = idx[None, :] < ((positions + 1) // c.ratio)[:, None]
        else:  # CSA: the indexer's pick
            entries = entries.gather(1, topk.clamp(min=0)[..., None].expand(-1, -1, entries.shape[-1]))
            seen = topk >= 0
        keys, visible = torch.cat((keys, entries), dim=1), torch.cat((visible, seen), dim=1)
    out = sink_attention(q[:, None], keys, visible[:, None], attn.sinks, attn.scale)  # [T, 1, Hh, D]
    return out[:, 0]


@dataclass
class DecodeStep:
    """What every layer of one decode / verify step shares, made once per step: the tokens'
    positions [T] int64, their request rows [T] (into the block tables), the step's metadata,
    whether the Triton kernels run (`kernel`), and each rotary's cos/sin at the positions."""

    positions: torch.Tensor
    step: StepMetadata
    kernel: bool
    rows: torch.Tensor = field(init=False)
    _rope: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.rows = token_requests(self.step.query_start_loc, self.positions.shape[0])  # [T]

    def rope(self, rotary: InterleavedRotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope_dim / 2] of `rotary` at the step's positions, computed once a step."""
        key = (id(rotary), dtype)
        if key not in self._rope:
            self._rope[key] = rotary(self.positions, dtype)
        return self._rope[key]


def _project(attn: DeepseekV4Attention, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             window: LayerCache, slots: torch.Tensor, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeepseekV4Attention._project` of hidden [T, H], its K=V row written to the window's slots
    -> (q_latent [T, Rq], q [T, Hh, D]). `kernel`: each norm + rotary in one Triton launch
    (tandem/kernels/deepseek_v4_rope.py), the K=V row stored by the same launch unless fp8."""
    if not kernel:
        q_latent, q, kv = attn._project(hidden[None], cos, sin)  # [1, T, Rq], [1, T, Hh, D], [1, T, D]
        _write(window.pages, window.scales, slots, kv[0])
        return q_latent[0], q[0]
    from tandem.kernels.deepseek_v4_rope import deepseek_v4_rope_tail

    T = hidden.shape[0]
    q_latent = attn.q_a_norm(attn.q_a_proj(hidden))  # [T, Rq]
    q = attn.q_b_proj(q_latent).view(T, attn.num_heads, attn.head_dim)  # [T, Hh, D]
    q = deepseek_v4_rope_tail(q, cos, sin, norm="unweighted", eps=attn.eps)
    fp8 = window.scales is not None
    kv = deepseek_v4_rope_tail(attn.kv_proj(hidden).view(T, 1, attn.head_dim), cos, sin, norm=attn.kv_norm.weight,
                               eps=attn.kv_norm.eps, pages=None if fp8 else window.pages, slots=slots)  # [T, 1, D]
    if fp8:
        _write(window.pages, window.scales, slots, kv[:, 0])
    return q_latent, q


def attention_step(attn: DeepseekV4Attention, hidden: torch.Tensor, caches: tuple[LayerCache, ...],
                   ctx: DecodeStep, rotary: InterleavedRotary) -> torch.Tensor:
    """One V4 attention block over a decode / verify step's tokens: hidden [T, H] -> [T, H], the
    caches updated. `ctx.kernel`: the Triton kernels (CUDA): the norms and rotary, the compressors'
    entries, the indexer's scores, and the attention unless the pages are fp8 (it reads --dtype
    pages; the model logs that at bind time), else the torch gathers."""
    positions, step, kernel, rows = ctx.positions, ctx.step, ctx.kernel, ctx.rows
    cos, sin = ctx.rope(rotary, hidden.dtype)  # [T, rope_dim / 2]
    window = caches[0]
    q_latent, q = _project(attn, hidden, cos, sin, window, step.slot_mappings[window.group], kernel)
    topk = None
    c = attn.compressor
    if c is not None:
        cache = caches[1]
        if cache.snapshots:  # prefix caching (CSA): a prefix hit's overlap goes back into the rings first
            _restore(cache, step, c.ratio, kernel)
        _compress(c, cache, "compressor", hidden, positions, step, rotary, kernel)
        if isinstance(c, SparseCompressor):
            _compress(c.indexer, cache, "indexer", hidden, positions, step, rotary, kernel)
            topk = _indexer_topk(attn, cache, hidden, q_latent, ctx, cos, sin)
    if kernel and window.scales is None:
        from tandem.kernels.deepseek_v4_attention import deepseek_v4_paged_attention

        entry = caches[1] if c is not None else None
        out = deepseek_v4_paged_attention(
            q, positions, rows, window.pages, step.block_tables[window.group], attn.sliding_window, attn.scale,
            attn.sinks, entry_pages=None if entry is None else entry.pages,
            entry_table=None if entry is None else step.block_tables[entry.group],
            ratio=0 if c is None else c.ratio, topk_idx=topk)
    else:
        out = _gather_attention(attn, q, positions, rows, caches, step, topk)
    if kernel:
        from tandem.kernels.deepseek_v4_rope import deepseek_v4_rope_tail

        return attn.output_proj(deepseek_v4_rope_tail(out, cos, sin, inverse=True)[None])[0]
    return attn.output(out[None], cos, sin)[0]
