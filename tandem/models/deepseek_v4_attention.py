"""DeepSeek-V4 attention, the torch reference: `forward_full` over whole sequences from position 0
(no cache), and `forward_step` over one request's next tokens on its `AttentionState`
(deepseek_v4_state.py), equal to it.

Every layer attends over a sliding window of its own tokens; compressed layers add entries that each
summarise a window of `m` tokens:

- sliding ("sliding_attention"): the last `sliding_window` tokens (the query's own included).
- heavily compressed, HCA ("heavily_compressed_attention", m = 128 in V4): one entry per `m` tokens
  (non-overlapping windows); a query sees every entry whose window has closed.
- compressed sparse, CSA ("compressed_sparse_attention", m = 4): one entry per `m` tokens over
  overlapping windows of `2m`; the lightning indexer scores the closed entries per query and the
  query sees only its top `index_topk`.

The attention itself is multi-query latent attention with one shared K=V head: q comes from a
low-rank path (`q_a_proj` -> `q_a_norm` -> `q_b_proj` -> per-head unweighted RMS norm), the single
K=V head from `kv_proj` -> `kv_norm`. Rotary is interleaved (GPT-J pairs) on the trailing
`rope_dim` channels of each head; since V is K, the output's rope channels are rotated back by the
query's position. Each head has a learned sink logit (an extra softmax column with no value). The
output projection is grouped: heads are split in `o_groups` groups, each projected on its own to
`o_lora_rank` (`o_a_proj`), then mixed to hidden (`o_b_proj`).

Shapes: B batch, T tokens, H hidden, Hh heads, D head_dim, N compressed entries, m ratio.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.deepseek_v4_state import (
    AttentionState,
    CompressorState,
    empty_rows,
    new_compressor_state,
)
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import RopeConfig, compute_inv_freq

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, the statistics in float32."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class InterleavedRotary(nn.Module):
    """cos/sin for V4's rotary: `rope_dim / 2` frequencies, one per interleaved channel pair.

    `inv_freq` is a non-persistent float32 buffer, recomputed whenever the module is moved or
    materialised (as `RotaryEmbedding` in layers/rotary.py, which is neox-layout and full-dim)."""

    def __init__(self, rope_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rope_dim, self.rope = rope_dim, rope
        inv_freq, self.attention_scaling = compute_inv_freq(rope, rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [rope_dim / 2] float32

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        inv_freq, self.attention_scaling = compute_inv_freq(self.rope, self.rope_dim)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [P] int64 -> (cos, sin), each [P, rope_dim / 2] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [P, rope_dim / 2]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of x as interleaved pairs (x0, x1) ->
    (x0 cos - x1 sin, x1 cos + x0 sin), in float32; the leading channels pass through.
    cos/sin [..., rope_dim / 2] must broadcast against x's leading dims (add the head axis yourself)."""
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.float().unflatten(-1, (-1, 2))  # [..., rope_dim / 2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def entry_positions(num_entries: int, ratio: int, device: torch.device) -> torch.Tensor:
    """Compressed entry n sits at the position of its window's first token, n * ratio: [N] int64."""
    return torch.arange(num_entries, device=device) * ratio


def closed_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries a query at each position may see: those whose window ended at or
    before it, (pos + 1) // ratio. [T] int64."""
    return (positions + 1) // ratio


class WindowCompressor(nn.Module):
    """Softmax-gated pooling of every `ratio` tokens into one entry of `head_dim`, then `kv_norm`
    and rotary at the entry's position. A trailing partial window produces nothing (it is the state
    a cached version must carry).

    `overlap=False` (HCA): entry n pools tokens [n*m, (n+1)*m) with per-channel weights
    softmax_j(gate_j + position_bias_j).
    `overlap=True` (CSA and its indexer): projections are 2*head_dim wide, a series Ca (first half)
    and Cb (second half); entry n pools the 2m slots [Ca of window n-1, Cb of window n], so windows
    overlap by m; entry 0 has no previous window (those slots get zero softmax weight).
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(head_dim, eps)

    def _slots(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv/gate [B, N, m, 2D] -> the 2m slots each entry pools: kv [B, N, 2m, D], gate (same)."""
        D = self.head_dim
        prev_kv = F.pad(kv[:, :-1, :, :D], (0, 0, 0, 0, 1, 0))  # [B, N, m, D]; window -1 is empty
        prev_gate = F.pad(gate[:, :-1, :, :D], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        return torch.cat((prev_kv, kv[..., D:]), dim=2), torch.cat((prev_gate, gate[..., D:]), dim=2)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., T, H], positions [T] -> per-token (kv, gate + position_bias[pos % m]), each [..., T, width]."""
        return self.kv_proj(hidden), self.gate_proj(hidden) + self.position_bias[positions % self.ratio]

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int, rotary: InterleavedRotary) -> torch.Tensor:
        """Projections of N consecutive closed windows, from window `first`, kv/gate [B, N', m, width]
        with N' = N + 1 when overlapping and first > 0 (window first - 1 lends its Ca half), else N
        -> entries [B, N, D], normed and rotated at their positions."""
        if self.overlap:
            kv, gate = self._slots(kv, gate)  # [B, N', 2m, D] each
            if first > 0:
                kv, gate = kv[:, 1:], gate[:, 1:]  # window first - 1 was only there for its Ca
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)  # over the pooled slots
        entries = self.kv_norm((kv * weights).sum(dim=2))  # [B, N, D]
        cos, sin = rotary(entry_positions(entries.shape[1], self.ratio, kv.device) + first * self.ratio, kv.dtype)
        return apply_rope_tail(entries, cos, sin)

    def forward(self, hidden: torch.Tensor, rotary: InterleavedRotary) -> torch.Tensor:
        """hidden [B, T, H] -> entries [B, N, D] with N = T // ratio."""
        B, T, _ = hidden.shape
        N, m = T // self.ratio, self.ratio
        if N == 0:
            return hidden.new_zeros(B, 0, self.head_dim)
        kv, gate = self.project(hidden[:, : N * m], torch.arange(N * m, device=hidden.device))  # [B, N*m, width]
        return self.pool(kv.unflatten(1, (N, m)), gate.unflatten(1, (N, m)), 0, rotary)

    def step(self, state: CompressorState, hidden: torch.Tensor, positions: torch.Tensor,
             rotary: InterleavedRotary) -> CompressorState:
        """Feed one request's next tokens: hidden [T, H] at positions [T] (state.end onwards) ->
        the state with their projections appended and an entry for every window they close."""
        kv, gate = self.project(hidden, positions)  # [T, width] each
        state = replace(state, kv=state.kv.append(kv), gate=state.gate.append(gate))
        m, first, last = self.ratio, state.entries.shape[0], state.end // self.ratio  # new entries [first, last)
        if last == first:
            return state
        lo = max(0, first - 1) * m if self.overlap else first * m
        windows = (last * m - lo) // m
        kv_w = state.kv.span(lo, last * m).view(1, windows, m, -1)  # [1, N', m, width]
        gate_w = state.gate.span(lo, last * m).view(1, windows, m, -1)
        return replace(state, entries=torch.cat((state.entries, self.pool(kv_w, gate_w, first, rotary)[0])))


class IndexerScorer(nn.Module):
    """index score(t, n) = sum_h w(t, h) * relu(q(t, h) . k(n)) / sqrt(Di), w = weights_proj(x) / sqrt(Hi)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_scale, self.w_scale = head_dim**-0.5, num_heads**-0.5
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """q [B, T, Hi, Di], keys [B, N, Di], hidden [B, T, H] -> scores [B, T, N] float32."""
        dots = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, T, Hi, N]
        head_weights = self.weights_proj(hidden).float() * self.w_scale  # [B, T, Hi]
        return (F.relu(dots) * self.q_scale * head_weights.unsqueeze(-1)).sum(dim=2)


class Indexer(WindowCompressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at `index_head_dim`
    (the index keys), its own query heads from the attention's q latent, and the top-k pick."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, ratio: int,
                 topk: int, eps: float) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.num_heads, self.topk = num_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, num_heads, head_dim)

    def select(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
               rotary: InterleavedRotary) -> torch.Tensor:
        """hidden [B, T, H], q_latent [B, T, Rq], positions [T] -> visible [B, T, N] bool: entry n is
        among the query's top `index_topk` closed entries (equal scores: the lower entry first)."""
        return self.pick(self(hidden, rotary), hidden, q_latent, positions, rotary)

    def pick(self, keys: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
             rotary: InterleavedRotary) -> torch.Tensor:
        """`select` given the index keys [B, N, Di] (the closed ones and possibly later ones)."""
        B, T, _ = hidden.shape
        N = keys.shape[1]
        visible = torch.zeros(B, T, N, dtype=torch.bool, device=hidden.device)
        if N == 0:
            return visible
        cos, sin = rotary(positions, hidden.dtype)  # [T, rope_dim / 2]
        q = self.q_b_proj(q_latent).view(B, T, self.num_heads, self.head_dim)  # [B, T, Hi, Di]
        q = apply_rope_tail(q, cos[:, None], sin[:, None])
        scores = self.scorer(q, keys, hidden)  # [B, T, N]
        closed = torch.arange(N, device=hidden.device) < closed_entries(positions, self.ratio)[:, None]  # [T, N]
        scores = scores.masked_fill(~closed, float("-inf"))
        # Ties (a score is exactly 0 when every head's relu is; common with few index heads) go to
        # the lower entry: a stable sort makes the pick independent of how many entries exist, so an
        # incremental step with N entries picks what a full forward with more would. torch.topk's
        # tie order depends on N.
        picked = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(self.topk, N)]  # [B, T, k]
        # A query with fewer than k closed entries also picks future ones; drop those.
        return visible.scatter_(-1, picked, True) & closed


class SparseCompressor(WindowCompressor):
    """CSA's compressor (overlapping windows at head_dim) plus the indexer that picks per query."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, indexer: Indexer, eps: float) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.indexer = indexer


def sink_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Softmax attention with one K=V head and a per-head sink logit (a column with no value).

    q [B, T, Hh, D], kv [B, S, D], visible [B or 1, T, S] bool (every query sees >= 1 key),
    sinks [Hh] -> [B, T, Hh, D]."""
    logits = torch.einsum("bthd,bsd->bhts", q, kv) * scale  # [B, Hh, T, S]
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:3], 1)  # [B, Hh, T, 1]
    probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share is dropped
    return torch.einsum("bhts,bsd->bthd", probs, kv)


def sliding_window_visible(positions: torch.Tensor, window: int,
                           key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """[T, S] bool: key j is visible to query i when i - window < j <= i (keys = the queries by default)."""
    keys = positions if key_positions is None else key_positions
    diff = positions[:, None] - keys[None, :]  # [T, S]: query - key
    return (diff >= 0) & (diff < window)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of the input ([..., G, in]) goes through rows
    [g*out, (g+1)*out) of `weight` [G*out, in] -> [..., G, out]."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])  # [G, out, in]
        return torch.einsum("...gi,goi->...go", x, w)


class DeepseekV4Attention(nn.Module):
    """One V4 attention block of any layer kind; parameter names match the HF checkpoint."""

    def __init__(self, *, layer_type: str, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, sliding_window: int, compress_ratio: int,
                 index_n_heads: int, index_head_dim: int, index_topk: int, eps: float) -> None:
        super().__init__()
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer type {layer_type!r} is not a DeepSeek-V4 attention kind; known: {LAYER_TYPES}")
        if (num_heads * head_dim) % o_groups:
            raise ValueError(f"o_groups {o_groups} must divide num_attention_heads * head_dim ({num_heads * head_dim})")
        self.layer_type, self.num_heads, self.head_dim = layer_type, num_heads, head_dim
        self.sliding_window, self.eps, self.scale = sliding_window, eps, head_dim**-0.5
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.o_a_proj = GroupedLinear(num_heads * head_dim // o_groups, o_lora_rank, o_groups)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.compressor: WindowCompressor | None = None
        if layer_type == HCA:
            self.compressor = WindowCompressor(hidden_size, head_dim, compress_ratio, overlap=False, eps=eps)
        elif layer_type == CSA:
            indexer = Indexer(hidden_size, q_lora_rank, index_n_heads, index_head_dim, compress_ratio, index_topk, eps)
            self.compressor = SparseCompressor(hidden_size, head_dim, compress_ratio, indexer, eps)

    @property
    def rope_kind(self) -> str:
        """Sliding layers rotate with the "main" rotary; compressed layers with the "compress" one."""
        return "main" if self.compressor is None else "compress"

    def _compressed(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
                    rotary: InterleavedRotary) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (entries [B, N, D], visible [B or 1, T, N] bool) of this layer's compressor."""
        assert self.compressor is not None
        entries = self.compressor(hidden, rotary)  # [B, N, D]
        if isinstance(self.compressor, SparseCompressor):
            return entries, self.compressor.indexer.select(hidden, q_latent, positions, rotary)
        N = entries.shape[1]
        closed = torch.arange(N, device=hidden.device) < closed_entries(positions, self.compressor.ratio)[:, None]
        return entries, closed[None]  # [1, T, N]

    def _project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B, T, H] -> (q_latent [B, T, Rq], q [B, T, Hh, D], kv [B, T, D]), q and kv rotated."""
        B, T, _ = hidden.shape
        q_latent = self.q_a_norm(self.q_a_proj(hidden))  # [B, T, Rq]
        q = self.q_b_proj(q_latent).view(B, T, self.num_heads, self.head_dim)  # [B, T, Hh, D]
        q = apply_rope_tail(unweighted_rms_norm(q, self.eps), cos[:, None], sin[:, None])
        kv = apply_rope_tail(self.kv_norm(self.kv_proj(hidden)), cos, sin)  # [B, T, D]: K and V
        return q_latent, q, kv

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """q [B, T, Hh, D], keys [B, S, D] (K = V), visible [B or 1, T, S] -> [B, T, H]."""
        return self.output(sink_attention(q, keys, visible, self.sinks, self.scale), cos, sin)

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention's per-head result [B, T, Hh, D] -> the block's output [B, T, H]."""
        # V carried rotary at its key's position; rotating back by the query's position leaves the
        # rope channels a function of the relative distance.
        return self.output_proj(apply_rope_tail(out, cos[:, None], -sin[:, None]))

    def output_proj(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped output projection of the rotated-back heads [B, T, Hh, D] -> [B, T, H]."""
        B, T = out.shape[:2]
        grouped = self.o_a_proj(out.reshape(B, T, self.o_a_proj.groups, -1))  # [B, T, G, o_lora_rank]
        return self.o_b_proj(grouped.flatten(2))

    def forward_full(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: InterleavedRotary) -> torch.Tensor:
        """Cache-free attention over whole sequences from position 0.

        hidden [B, T, H], positions [T] (0..T-1), `rotary`: this layer's kind (see `rope_kind`) -> [B, T, H]."""
        cos, sin = rotary(positions, hidden.dtype)  # [T, rope_dim / 2]
        q_latent, q, kv = self._project(hidden, cos, sin)
        visible = sliding_window_visible(positions, self.sliding_window)[None]  # [1, T, T]
        if self.compressor is not None:
            entries, entry_visible = self._compressed(hidden, q_latent, positions, rotary)
            kv = torch.cat((kv, entries), dim=1)  # [B, T + N, D]
            visible = torch.cat((visible.expand(entry_visible.shape[0], -1, -1), entry_visible), dim=-1)  # [B|1, T, T+N]
        return self._attend(q, kv, visible, cos, sin)

    def forward_step(self, hidden: torch.Tensor, positions: torch.Tensor, state: AttentionState,
                     rotary: InterleavedRotary) -> tuple[torch.Tensor, AttentionState]:
        """One request's next tokens, any count: hidden [T, H] at positions [T] = state.end + 0..T-1
        -> (output [T, H], the state with these tokens in). Equals `forward_full` on the whole
        sequence at these positions. The new state keeps every row it was given (`trim` drops the
        ones behind the window); windows the tokens close are compressed before anyone attends,
        since the closing token already sees its entry."""
        T = hidden.shape[0]
        expected = torch.arange(state.end, state.end + T, device=positions.device)
        if T == 0 or not torch.equal(positions, expected):
            raise ValueError(f"forward_step takes T >= 1 tokens at positions {state.end}..{state.end}+T-1, "
                             f"got {T} at {positions.tolist()[:4]}...")
        cos, sin = rotary(positions, hidden.dtype)  # [T, rope_dim / 2]
        q_latent, q, kv = self._project(hidden[None], cos, sin)  # [1, T, Rq], [1, T, Hh, D], [1, T, D]
        window = state.window.append(kv[0])  # [S + T, D], positions [window.start, end + T)
        key_positions = torch.arange(window.start, window.end, device=hidden.device)
        keys, visible = window.rows, sliding_window_visible(positions, self.sliding_window, key_positions)  # [T, S+T]
        state = replace(state, window=window)
        if self.compressor is not None:
            c = self.compressor.step(state.compressor, hidden, positions, rotary)  # entries [N, D]
            if isinstance(self.compressor, SparseCompressor):
                indexer = self.compressor.indexer
                ix = indexer.step(state.indexer, hidden, positions, rotary)  # index keys [N, Di]
                entry_visible = indexer.pick(ix.entries[None], hidden[None], q_latent, positions, rotary)[0]
                state = replace(state, indexer=ix)
            else:
                n = torch.arange(c.entries.shape[0], device=hidden.device)
                entry_visible = n < closed_entries(positions, self.compressor.ratio)[:, None]  # [T, N]
            keys, visible = torch.cat((keys, c.entries)), torch.cat((visible, entry_visible), dim=-1)
            state = replace(state, compressor=c)
        return self._attend(q, keys[None], visible[None], cos, sin)[0], state

    def new_state(self, dtype: torch.dtype, device: torch.device | str) -> AttentionState:
        """An empty request's state for this layer."""
        def compressor(c: WindowCompressor) -> CompressorState:
            return new_compressor_state(c.ratio, c.overlap, c.head_dim, dtype, device)

        c = self.compressor
        return AttentionState(
            window_size=self.sliding_window,
            window=empty_rows(self.head_dim, dtype, device),
            compressor=None if c is None else compressor(c),
            indexer=compressor(c.indexer) if isinstance(c, SparseCompressor) else None,
        )


def check_rope_dim(rope_dim: int, head_dim: int, index_head_dim: int) -> None:
    if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, index_head_dim):
        raise ValueError(
            f"rotary dim {rope_dim} (head_dim * partial_rotary_factor) must be even and at most head_dim "
            f"({head_dim}) and index_head_dim ({index_head_dim})"
        )


