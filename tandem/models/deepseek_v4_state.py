"""DeepSeek-V4's per-request decode state, as plain tensors: what an incremental forward carries
between steps (deepseek_v4_attention.py `DeepseekV4Attention.forward_step`), and `rollback`.

Two storage shapes, which is what the paged cache groups hold (deepseek_v4_paged.py):

- `TokenRows`, rows keyed by token position with a retention horizon: the sliding window's K=V
  (`[S, D]`, S <= W - 1 + max_rollback) and the compressor's per-token projections (`kv`, `gate`,
  S <= (2 if overlap else 1) * m - 1 + max_rollback). Rows behind the horizon are dropped from the
  front (pages freed behind the window); rows past a rollback are cut from the back.
- `EntryRows`, append-only rows keyed by entry index: compressed entries (one `[D]` per m tokens)
  and the CSA indexer's keys (one `[Di]` per m tokens), the whole history. Entry n exists once
  its window [n*m, (n+1)*m) has closed, so a state of length L holds exactly L // m of them.

The compressor's "partial group" (tokens since the last close) and CSA's "overlap" (the first-half
Ca projections of the last closed window) are not separate tensors: they are the tail of the
compressor's `TokenRows`, which makes them fixed-size per request (a ring of the capacity above)
and makes rollback across a window close exact: the entry is cut and the projections it consumed
are still there. `max_rollback` (R) is how many tokens a state can take back at once; 0 keeps the
minimum. Every dataclass is frozen: a step returns new states, the old ones stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TokenRows:
    """Per-token rows for positions [start, end): `rows` [end - start, ...]."""

    rows: torch.Tensor
    end: int

    @property
    def start(self) -> int:
        return self.end - self.rows.shape[0]

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """Rows of positions [lo, hi); they must be held."""
        if lo < self.start or hi > self.end:
            raise IndexError(f"rows [{lo}, {hi}) requested, [{self.start}, {self.end}) held")
        return self.rows[lo - self.start: hi - self.start]

    def append(self, rows: torch.Tensor) -> TokenRows:
        return TokenRows(torch.cat((self.rows, rows)), self.end + rows.shape[0])

    def drop_before(self, pos: int) -> TokenRows:
        """Forget rows of positions < pos (never past `end`)."""
        return TokenRows(self.rows[max(0, min(pos, self.end) - self.start):], self.end)

    def cut_to(self, end: int) -> TokenRows:
        """Forget rows of positions >= end."""
        return TokenRows(self.rows[: max(0, end - self.start)], min(end, self.end))


@dataclass(frozen=True)
class CompressorState:
    """One compressor (HCA's, CSA's, or the CSA indexer's) of one request.

    kv, gate: TokenRows of [S, width] (width = D, or 2D when overlapping: Ca then Cb halves), the
      outputs of `kv_proj` and of `gate_proj + position_bias[pos % m]`, in the activation dtype (the
      reference computes them there, so the pooled entry is bit-identical to a full forward's).
    entries: [N, D] normed and rotated (at n * m) entries, N = end // m."""

    ratio: int
    overlap: bool
    kv: TokenRows
    gate: TokenRows
    entries: torch.Tensor

    @property
    def end(self) -> int:
        return self.kv.end

    def needed_from(self, length: int) -> int:
        """First position whose projections a state of `length` tokens still needs: the open
        group's, and with overlap also the last closed window's (its Ca half)."""
        return max(0, (length // self.ratio - int(self.overlap)) * self.ratio)


@dataclass(frozen=True)
class AttentionState:
    """One attention layer of one request. window: TokenRows of K=V [S, D] (after kv_norm and
    rotary); compressor: HCA or CSA layers; indexer: CSA layers only (entries = index keys [N, Di])."""

    window_size: int
    window: TokenRows
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @property
    def end(self) -> int:
        return self.window.end

    def window_needed_from(self, length: int) -> int:
        """The next query (at `length`) sees keys > length - window_size."""
        return max(0, length - self.window_size + 1)


@dataclass(frozen=True)
class DeepseekV4State:
    """One request: how many tokens it has been fed and each layer's AttentionState. mHC and the MoE
    carry nothing between tokens (hash routing reads each step's own token ids)."""

    length: int
    max_rollback: int
    layers: tuple[AttentionState, ...]


def empty_rows(width: int, dtype: torch.dtype, device: torch.device | str) -> TokenRows:
    return TokenRows(torch.zeros(0, width, dtype=dtype, device=device), 0)


def new_compressor_state(ratio: int, overlap: bool, head_dim: int, dtype: torch.dtype,
                         device: torch.device | str) -> CompressorState:
    width = 2 * head_dim if overlap else head_dim
    return CompressorState(ratio, overlap, empty_rows(width, dtype, device), empty_rows(width, dtype, device),
                           torch.zeros(0, head_dim, dtype=dtype, device=device))


def trim(state: AttentionState, max_rollback: int) -> AttentionState:
    """Drop what neither the next step nor a rollback of up to `max_rollback` tokens can need."""
    horizon = max(0, state.end - max_rollback)
    return replace(
        state,
        window=state.window.drop_before(state.window_needed_from(horizon)),
        compressor=_trim_compressor(state.compressor, horizon),
        indexer=_trim_compressor(state.indexer, horizon),
    )


def _trim_compressor(c: CompressorState | None, horizon: int) -> CompressorState | None:
    if c is None:
        return None
    keep = c.needed_from(horizon)
    return replace(c, kv=c.kv.drop_before(keep), gate=c.gate.drop_before(keep))


def rollback(state: DeepseekV4State, n_tokens: int) -> DeepseekV4State:
    """The state as if the last `n_tokens` had never been fed: window rows and projections cut,
    entries whose window closed among them removed. Exact whenever n_tokens <= max_rollback since
    the last step (a window close crossed is undone from the retained projections); raises
    ValueError, leaving `state` untouched, when the rows it would need were already dropped."""
    if not 0 <= n_tokens <= state.length:
        raise ValueError(f"cannot roll back {n_tokens} tokens of a {state.length}-token state")
    length = state.length - n_tokens
    layers = tuple(_rollback_layer(layer, length, state.max_rollback) for layer in state.layers)
    return replace(state, length=length, layers=layers)


def _rollback_layer(s: AttentionState, length: int, max_rollback: int) -> AttentionState:
    _check_held(s.window, s.window_needed_from(length), length, "sliding-window K/V", max_rollback)
    return replace(s, window=s.window.cut_to(length),
                   compressor=_rollback_compressor(s.compressor, length, max_rollback),
                   indexer=_rollback_compressor(s.indexer, length, max_rollback))


def _rollback_compressor(c: CompressorState | None, length: int, max_rollback: int) -> CompressorState | None:
    if c is None:
        return None
    _check_held(c.kv, c.needed_from(length), length, f"ratio-{c.ratio} compressor projections", max_rollback)
    return replace(c, kv=c.kv.cut_to(length), gate=c.gate.cut_to(length), entries=c.entries[: length // c.ratio])


def _check_held(rows: TokenRows, needed_from: int, length: int, what: str, max_rollback: int) -> None:
    if needed_from < rows.start:
        raise ValueError(
            f"rollback to {length} tokens needs the {what} from position {needed_from}, but the state "
            f"kept only [{rows.start}, {rows.end}) (max_rollback={max_rollback} tokens since the last step); "
            f"create the state with a larger max_rollback"
        )
