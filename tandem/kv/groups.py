"""Position -> slot arithmetic of each cache kind (what the runner computes per step) and the KV
budget of a set of groups (what the planner computes before touching memory).

Slots are flat indices into a group's per-layer tensor viewed as [(num_blocks + 1) * block_size, ...]
(row `num_blocks` is the sink: placeholders and padding point there), as for the full group today.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kv.spec import CacheGroup, KVCacheSpec, prefix_unit


def token_slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """full / sliding_window: the slot each token in [start, end) writes its K/V to."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def entry_slots(block_ids: Sequence[int], block_size: int, ratio: int, start: int, end: int) -> list[int]:
    """compressed: per token in [start, end), the slot of the entry its window closes
    (entry (p+1)//ratio - 1 when (p+1) % ratio == 0), else -1. Entries n in
    [start//ratio, end//ratio) are written by this step."""
    out = []
    for p in range(start, end):
        n = (p + 1) // ratio - 1
        out.append(block_ids[n // block_size] * block_size + n % block_size if (p + 1) % ratio == 0 else -1)
    return out


def visible_entries(position: int, ratio: int) -> int:
    """Entries a query at `position` may see: those whose window closed at or before it."""
    return (position + 1) // ratio


def state_rows(spec: KVCacheSpec, start: int, end: int) -> list[int]:
    """compressed: the state-ring row of each token in [start, end) (p % (state_ring * ratio)).
    A step writes the rows of its tokens in the last `state_ring` windows it touches only (a
    longer chunk's earlier windows are pooled from the chunk and would be overwritten anyway)."""
    ring = spec.state_ring * spec.ratio
    first = max(start, ((end - 1) // spec.ratio - spec.state_ring + 1) * spec.ratio)
    return [p % ring for p in range(first, end)]


# -- budget -------------------------------------------------------------------------------------
def group_blocks(groups: Sequence[CacheGroup], block_size: int, num_tokens: int, max_num_seqs: int = 1,
                 step_tokens: int = 1, batch_tokens: int = 0) -> tuple[int, ...]:
    """Pool size per group to hold `num_tokens` tokens of context spread over up to `max_num_seqs`
    requests, each running up to `step_tokens` query tokens a decode step (1 + K when verifying),
    with up to `batch_tokens` prefill tokens in one step over all requests (the chunk budget).
    Each request may round up one block per group. A sliding window holds, per request, the window
    and its step, and the step's prefill chunks on top: bounded, however long the context."""
    out = []
    for g in groups:
        spec, s = g.spec, max_num_seqs
        n = spec.blocks_for(num_tokens, block_size) + s
        if spec.kind == "sliding_window":
            n = min(n, s * spec.max_blocks_held(num_tokens, block_size, step_tokens) + -(-batch_tokens // block_size))
        out.append(n)
    return tuple(out)


def kv_cache_bytes(groups: Sequence[CacheGroup], block_size: int, num_tokens: int, max_num_seqs: int = 1,
                   step_tokens: int = 1, prefix_caching: bool = True, batch_tokens: int = 0) -> list[int]:
    """Memory per group for `num_tokens` tokens of context (see `group_blocks`): its pages, plus
    for compressed groups one state slot per request and, for CSA with prefix caching, one overlap
    snapshot per prefix unit. The sink row of each tensor is not counted."""
    unit = prefix_unit(groups, block_size)
    out = []
    blocks = group_blocks(groups, block_size, num_tokens, max_num_seqs, step_tokens, batch_tokens)
    for g, n in zip(groups, blocks):
        total = n * g.bytes_per_block(block_size) + max_num_seqs * g.state_bytes()
        if prefix_caching and g.spec.overlap:
            total += (num_tokens // unit + max_num_seqs) * g.snapshot_bytes()
        out.append(total)
    return out


def kv_bytes_per_token(groups: Sequence[CacheGroup]) -> float:
    """Bytes one more token of context costs over all groups, in the long-context limit (a sliding
    window's cost is bounded, so it adds nothing)."""
    return sum(g.num_layers * g.spec.bytes_per_token() for g in groups if g.spec.kind != "sliding_window")
