"""DeepSeek-V4 (V4-Flash / V4-Pro), the torch reference: a full-sequence forward with no cache.

A decoder whose residual is `hc_mult` parallel streams (manifold-constrained hyper-connections,
mHC): each block reads a learned, per-token mix of the streams and writes its output back into all
of them, the streams themselves mixed by a doubly-stochastic matrix (Sinkhorn). Attention blocks
are sliding-window, compressed sparse (CSA) or heavily compressed (HCA) per `layer_types`
(deepseek_v4_attention.py); feed-forward blocks are MoE, hash-routed on `mlp_layer_types ==
"hash_moe"` (deepseek_v4_moe.py).

Parameter names equal `transformers`' `DeepseekV4ForCausalLM` names, except the routed experts: HF
keeps them fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), Tandem
per expert (`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, as the native checkpoint and
Tandem's MoE executors do). `hf_state_dict_to_tandem` converts.

Three forwards, equal at every position: `forward_full` (cache-free, whole sequences),
`forward_step` (packed chunks of several requests, each on its own `DeepseekV4State`, with
`deepseek_v4_state.rollback` for speculative steps) and `forward`, what the engine runs: the same
incremental step on state kept in the paged cache groups of `kv_cache_specs` (deepseek_v4_paged.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core import StepMetadata
from tandem.kv.spec import KVCacheSpec
from tandem.kv.tensors import LayerCache
from tandem.models import deepseek_v4_decode as decode
from tandem.models import deepseek_v4_paged as paged
from tandem.models.base import CausalLM
from tandem.models.deepseek_v4_attention import (
    CSA,
    HCA,
    LAYER_TYPES,
    SLIDING,
    DeepseekV4Attention,
    InterleavedRotary,
    check_rope_dim,
    unweighted_rms_norm,
)
from tandem.models.deepseek_v4_moe import DeepseekV4MoE
from tandem.models.deepseek_v4_state import AttentionState, DeepseekV4State, trim
from tandem.models.layers.mlp import check_activation
from tandem.models.layers.norm import RMSNorm
from tandem.models.layers.rotary import RopeConfig
from tandem.models.qwen3 import require

logger = logging.getLogger("tandem")

MLP_LAYER_TYPES = ("hash_moe", "moe")
# Longest query the sync-free decode path takes on a sliding-only model; with compressed layers it
# is the smallest ratio + 1: the state ring (3 windows with CSA's overlap, else 2) must still hold
# both windows a closing token pools after the step wrote its tokens' rows (deepseek_v4_decode.py).
DECODE_MAX_QUERY = 16
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # native configs' per-layer `compress_ratios`


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"][:n])
    elif cfg.get("compress_ratios"):
        types = tuple(_RATIO_TO_LAYER_TYPE[int(r)] for r in cfg["compress_ratios"][:n])
    else:
        raise ValueError("config has neither 'layer_types' nor 'compress_ratios'")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if len(types) != n or bad:
        raise ValueError(f"layer_types must list {n} entries from {LAYER_TYPES}; got {list(types)}")
    return types


def _mlp_layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    if cfg.get("mlp_layer_types"):
        types = tuple(cfg["mlp_layer_types"][:n])
    else:
        n_hash = int(cfg.get("num_hash_layers", 3))
        types = tuple("hash_moe" if i < n_hash else "moe" for i in range(n))
    if len(types) != n or set(types) - set(MLP_LAYER_TYPES):
        raise ValueError(f"mlp_layer_types must list {n} entries from {MLP_LAYER_TYPES}; got {list(types)}")
    return types


def _rope(params: dict[str, Any], max_pos: int) -> RopeConfig:
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}  # the rope dim is read apart
    return RopeConfig.from_hf({"rope_parameters": params, "max_position_embeddings": max_pos})


def _ropes(cfg: dict[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) rotary. Either the nested `rope_parameters: {main: ..., compress: ...}` that
    transformers writes, or the native spelling: `rope_theta` for sliding layers and
    `compress_rope_theta` plus the `rope_scaling` (YaRN) for compressed layers."""
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return _rope(rp["main"], max_pos), _rope(rp["compress"], max_pos)
    scaling = {k: v for k, v in (cfg.get("rope_scaling") or rp).items() if k not in ("main", "compress")}
    compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    return _rope(main, max_pos), _rope(compress, max_pos)


@dataclass(frozen=True)
class DeepseekV4Args:
    """The fields of a DeepSeek-V4 config.json this implementation reads."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_dim: int  # trailing channels of each head that carry rotary (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]  # per compressed layer type
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    main_rope: RopeConfig
    compress_rope: RopeConfig

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekV4Args:
        n = int(require(cfg, "num_hidden_layers"))
        head_dim = int(require(cfg, "head_dim"))
        if int(cfg.get("num_key_value_heads", 1)) != 1:
            raise ValueError("DeepSeek-V4 attention has one shared K=V head; num_key_value_heads must be 1")
        if int(cfg.get("n_shared_experts", 1)) != 1:
            raise ValueError("n_shared_experts must be 1 (V4's shared expert is one MLP of moe_intermediate_size)")
        # transformers writes both, and partial_rotary_factor wins; native configs have qk_rope_head_dim.
        if cfg.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(cfg["partial_rotary_factor"]))
        else:
            rope_dim = int(cfg.get("qk_rope_head_dim") or head_dim * 64 // 512)
        rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
        rates[CSA] = int(cfg.get("compress_rate_csa", rates[CSA]))
        rates[HCA] = int(cfg.get("compress_rate_hca", rates[HCA]))
        main_rope, compress_rope = _ropes(cfg, int(cfg.get("max_position_embeddings", 1 << 20)))
        args = cls(
            vocab_size=int(require(cfg, "vocab_size")),
            hidden_size=int(require(cfg, "hidden_size")),
            moe_intermediate_size=int(require(cfg, "moe_intermediate_size")),
            num_hidden_layers=n,
            num_attention_heads=int(require(cfg, "num_attention_heads")),
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(require(cfg, "q_lora_rank")),
            o_groups=int(require(cfg, "o_groups")),
            o_lora_rank=int(require(cfg, "o_lora_rank")),
            sliding_window=int(require(cfg, "sliding_window")),
            layer_types=_layer_types(cfg, n),
            compress_rates={CSA: rates[CSA], HCA: rates[HCA]},
            index_n_heads=int(require(cfg, "index_n_heads")),
            index_head_dim=int(require(cfg, "index_head_dim")),
            index_topk=int(require(cfg, "index_topk")),
            mlp_layer_types=_mlp_layer_types(cfg, n),
            n_routed_experts=int(require(cfg, "n_routed_experts")),
            num_experts_per_tok=int(require(cfg, "num_experts_per_tok")),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            main_rope=main_rope,
            compress_rope=compress_rope,
        )
        check_activation(str(cfg.get("hidden_act", "silu")))
        check_rope_dim(rope_dim, head_dim, args.index_head_dim)
        if min(args.compress_rates.values()) < 1 or args.sliding_window < 1 or args.hc_sinkhorn_iters < 1:
            raise ValueError("compress_rates, sliding_window and hc_sinkhorn_iters must be positive")
        return args


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N, N] logits -> a (nearly) doubly-stochastic matrix: a row softmax (+eps), then
    alternately columns and rows normalised to sum 1, `iters` column passes in all."""
    m = logits.softmax(dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """The mHC around one block. From the N streams of a token it computes, with one linear map of
    the RMS-normed flattened streams (`fn` [(2+N)N, N*H], `base`, per-output `scale` [3]):
    pre [N] (how the block input collapses the streams), post [N] (how the block output is written
    back to each stream) and comb [N, N] (how the streams mix, Sinkhorn-projected)."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., N, H] -> (collapsed block input [..., H], post [..., N], comb [..., N, N]), float32 weights.
        `kernel` (CUDA, streams [T, N, H]): in two Triton kernels (tandem/kernels/deepseek_v4_mhc.py),
        the norm and the linear map, then everything after it; the same math."""
        n = self.n
        if kernel:
            from tandem.kernels.deepseek_v4_mhc import (
                deepseek_v4_hc_mix,
                deepseek_v4_hc_pre,
            )

            mixes = deepseek_v4_hc_mix(streams, self.fn, self.norm_eps)  # [T, S, (2+N)N] split-K partials
            return deepseek_v4_hc_pre(streams, mixes, self.base, self.scale, self.hc_eps, self.iters)
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)  # [..., N*H]
        mixes = F.linear(flat, self.fn.float())  # [..., (2+N)N]
        sizes = [n, n, n * n]
        pre_w, post_w, comb_w = mixes.split(sizes, dim=-1)  # [..., N], [..., N], [..., N*N]
        pre_b, post_b, comb_b = self.base.float().split(sizes)
        pre_s, post_s, comb_s = self.scale.float().unbind()
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps  # [..., N]
        post = 2 * torch.sigmoid(post_w * post_s + post_b)  # [..., N]
        comb = sinkhorn((comb_w * comb_s + comb_b).unflatten(-1, (n, n)), self.iters, self.hc_eps)  # [..., N, N]
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)  # [..., H]
        return collapsed, post, comb

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              kernel: bool = False, block_out2: torch.Tensor | None = None) -> torch.Tensor:
        """new stream k = post_k * block_out + sum_j comb[j, k] * stream_j. [..., N, H]; with
        `block_out2` the block output is block_out + block_out2 (the MoE's routed and shared parts).
        `kernel` (CUDA, streams [T, N, H]): in one Triton kernel, with the same roundings."""
        if kernel:
            from tandem.kernels.deepseek_v4_mhc import deepseek_v4_hc_merge

            return deepseek_v4_hc_merge(streams, block_out, post, comb, block_out2)
        if block_out2 is not None:
            block_out = block_out + block_out2
        dtype = streams.dtype
        mixed = torch.einsum("...jk,...jh->...kh", comb.to(dtype), streams)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Final collapse of the N streams into one hidden state: sigmoid-weighted sum (+eps)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor, kernel: bool = False) -> torch.Tensor:  # [..., N, H] -> [..., H]
        """`kernel` (CUDA, streams [T, N, H]): the mHC's two Triton kernels, without post and comb."""
        if kernel:
            from tandem.kernels.deepseek_v4_mhc import (
                deepseek_v4_hc_head,
                deepseek_v4_hc_mix,
            )

            mixes = deepseek_v4_hc_mix(streams, self.hc_fn, self.norm_eps)  # [T, S, N]
            return deepseek_v4_hc_head(streams, mixes, self.hc_base, self.hc_scale, self.hc_eps)
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)  # [..., N*H]
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_idx: int) -> None:
        super().__init__()
        a, kind = args, args.layer_types[layer_idx]
        self.self_attn = DeepseekV4Attention(
            layer_type=kind, hidden_size=a.hidden_size, num_heads=a.num_attention_heads, head_dim=a.head_dim,
            q_lora_rank=a.q_lora_rank, o_groups=a.o_groups, o_lora_rank=a.o_lora_rank,
            sliding_window=a.sliding_window, compress_ratio=a.compress_rates.get(kind, 0),
            index_n_heads=a.index_n_heads, index_head_dim=a.index_head_dim, index_topk=a.index_topk,
            eps=a.rms_norm_eps,
        )
        is_hash = a.mlp_layer_types[layer_idx] == "hash_moe"
        self.mlp = DeepseekV4MoE(
            a.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok, a.scoring_func,
            a.routed_scaling_factor, a.swiglu_limit, hash_vocab_size=a.vocab_size if is_hash else None,
        )
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.attn_hc = HyperConnection(a.hidden_size, a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        self.ffn_hc = HyperConnection(a.hidden_size, a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)

    def forward_full(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                     rotary: InterleavedRotary) -> torch.Tensor:
        """streams [B, T, N, H], input_ids [B, T], positions [T] -> streams [B, T, N, H]."""
        B, T, _, H = streams.shape
        collapsed, post, comb = self.attn_hc(streams)  # [B, T, H]
        attn = self.self_attn.forward_full(self.input_layernorm(collapsed), positions, rotary)
        streams = HyperConnection.merge(streams, attn, post, comb)
        collapsed, post, comb = self.ffn_hc(streams)
        ffn = self.mlp(self.post_attention_layernorm(collapsed).view(B * T, H), input_ids.reshape(-1))  # [B*T, H]
        return HyperConnection.merge(streams, ffn.view(B, T, H), post, comb)

    def forward_step(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                     lengths: list[int], states: list[AttentionState], rotary: InterleavedRotary
                     ) -> tuple[torch.Tensor, list[AttentionState]]:
        """Packed tokens of several requests: streams [T, N, H], input_ids [T], positions [T], the
        requests' token counts `lengths` (sum T) and their states -> (streams [T, N, H], new states).
        mHC and the MoE run on all tokens at once; attention per request on its own state."""
        new_states: list[AttentionState] = []

        def attention(normed: torch.Tensor) -> torch.Tensor:
            outs = []
            for hidden, pos, state in zip(normed.split(lengths), positions.split(lengths), states):
                out, state = self.self_attn.forward_step(hidden, pos, state, rotary)
                outs.append(out)
                new_states.append(state)
            return torch.cat(outs)

        return self.forward_tokens(streams, input_ids, attention), new_states

    def forward_tokens(self, streams: torch.Tensor, input_ids: torch.Tensor,
                       attention: Callable[[torch.Tensor], torch.Tensor], kernel: bool = False) -> torch.Tensor:
        """Packed tokens: streams [T, N, H], input_ids [T] -> streams [T, N, H]; `attention` maps
        the normed block input [T, H] to the attention output [T, H] (whatever holds its state).
        `kernel`: the mHC in Triton (CUDA)."""
        collapsed, post, comb = self.attn_hc(streams, kernel)  # [T, H]
        streams = HyperConnection.merge(streams, attention(self.input_layernorm(collapsed)), post, comb, kernel)
        collapsed, post, comb = self.ffn_hc(streams, kernel)
        # The routed + shared sum happens in the merge (inside its kernel on CUDA).
        routed, shared = self.mlp.parts(self.post_attention_layernorm(collapsed), input_ids)  # [T, H] each
        return HyperConnection.merge(streams, routed, post, comb, kernel, shared)


class DeepseekV4Model(nn.Module):
    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        self.hc_mult = args.hc_mult
        ratios = [args.compress_rates[kind] for kind in args.layer_types if kind in args.compress_rates]
        self.decode_max_query = min(ratios) + 1 if ratios else DECODE_MAX_QUERY
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hc_head = HyperHead(args.hidden_size, args.hc_mult, args.hc_eps, args.rms_norm_eps)
        self.rotary_emb = nn.ModuleDict({
            "main": InterleavedRotary(args.rope_dim, args.main_rope),
            "compress": InterleavedRotary(args.rope_dim, args.compress_rope),
        })

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (every sequence from position 0, no padding) -> final hidden [B, T, H]."""
        hidden = self.embed_tokens(input_ids)  # [B, T, H]
        streams = hidden.unsqueeze(2).expand(-1, -1, self.hc_mult, -1)  # [B, T, N, H]: N copies
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [T]
        for layer in self.layers:
            rotary = self.rotary_emb[layer.self_attn.rope_kind]
            streams = layer.forward_full(streams, input_ids, positions, rotary)
        return self.norm(self.hc_head(streams))

    def forward_step(self, input_ids: list[torch.Tensor], states: list[DeepseekV4State]
                     ) -> tuple[torch.Tensor, list[DeepseekV4State]]:
        """Each request's next tokens (input_ids[i] [T_i], any T_i >= 1) on its state -> (final hidden
        [sum T_i, H] packed in request order, the new states, trimmed to their max_rollback)."""
        if len(input_ids) != len(states):
            raise ValueError(f"{len(input_ids)} token chunks for {len(states)} states")
        lengths = [int(ids.shape[0]) for ids in input_ids]
        ids = torch.cat(input_ids)  # [T]
        positions = torch.cat([torch.arange(s.length, s.length + n) for s, n in zip(states, lengths)]).to(ids.device)
        streams = self.embed_tokens(ids).unsqueeze(1).expand(-1, self.hc_mult, -1)  # [T, N, H]
        per_layer = [list(layer_states) for layer_states in zip(*(s.layers for s in states))]  # [layer][request]
        for i, layer in enumerate(self.layers):
            rotary = self.rotary_emb[layer.self_attn.rope_kind]
            streams, per_layer[i] = layer.forward_step(streams, ids, positions, lengths, per_layer[i], rotary)
        new_states = [
            replace(s, length=s.length + n, layers=tuple(trim(layer[r], s.max_rollback) for layer in per_layer))
            for r, (s, n) in enumerate(zip(states, lengths))
        ]
        return self.norm(self.hc_head(streams)), new_states

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata,
                      caches: Sequence[tuple[LayerCache, ...]], kernel: bool = False) -> torch.Tensor:
        """The serving forward: packed tokens of the step's requests (input_ids [T], positions [T])
        on the paged cache groups -> final hidden [T, H]. Each layer loads every request's state
        from the caches, runs the incremental reference on it and stores back what it added
        (deepseek_v4_paged.py); decode and verify steps (queries of at most `decode_max_query`
        tokens) run the sync-free path of deepseek_v4_decode.py instead, with `kernel` its attention,
        compressor entries, indexer scores and mHC in Triton."""
        streams = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.hc_mult, -1)  # [T, N, H]
        if step.max_query_len <= self.decode_max_query:
            ctx = decode.DecodeStep(positions, step, kernel)
            for layer, layer_caches in zip(self.layers, caches):
                attn = layer.self_attn
                rotary = self.rotary_emb[attn.rope_kind]
                streams = layer.forward_tokens(streams, input_ids, lambda x, attn=attn, c=layer_caches, rotary=rotary:
                                               decode.attention_step(attn, x, c, ctx, rotary), kernel)
            return self.norm(self.hc_head(streams, kernel))
        requests = [paged.PagedRequest(step, r) for r in range(step.num_requests)]
        lengths = [req.end - req.start for req in requests]
        for layer, layer_caches in zip(self.layers, caches):
            attn = layer.self_attn
            states = [paged.load(attn, layer_caches, req) for req in requests]
            streams, new_states = layer.forward_step(streams, input_ids, positions, lengths, states,
                                                     self.rotary_emb[attn.rope_kind])
            for req, new in zip(requests, new_states):
                paged.store(attn, layer_caches, req, new)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    args_class = DeepseekV4Args
    # Prefill chunks run the paged torch reference (deepseek_v4_paged.py); decode and verify steps
    # the sync-free path (deepseek_v4_decode.py), its attention in torch or in Triton. Its experts
    # clamp SwiGLU: the torch, grouped (and its small-batch Triton path) and CPU executors all do.
    attention_backends = ("torch", "triton")
    moe_executors = ("torch", "grouped")
    # Its decode path is sync-free, so the engine captures it in CUDA graphs (checked on CPU in
    # tests/test_deepseek_v4_engine.py; on the H200 the captured graphs give transformers' tokens).

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        self.args = args = DeepseekV4Args.from_hf(hf_config)
        self.model = DeepseekV4Model(args)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._caches: tuple[tuple[LayerCache, ...], ...] | None = None
        self._kernel = False  # decode / verify steps in V4's Triton kernels (`set_attention_backend`)
        self.to(dtype)

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The cache-free reference forward: input_ids [B, T] int64 -> logits [B, T, V] float32."""
        return self.compute_logits(self.model.forward_full(input_ids))

    def new_state(self, max_rollback: int = 0, device: torch.device | str = "cpu") -> DeepseekV4State:
        """An empty request state; it can later `rollback` up to `max_rollback` tokens at once (the
        speculative step's draft length), at the cost of keeping that many more rows per layer."""
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        layers = tuple(layer.self_attn.new_state(self.dtype, device) for layer in self.model.layers)
        return DeepseekV4State(length=0, max_rollback=max_rollback, layers=layers)

    def forward_step(self, input_ids: list[torch.Tensor], states: list[DeepseekV4State]
                     ) -> tuple[list[torch.Tensor], list[DeepseekV4State]]:
        """The incremental reference: each request's next tokens (input_ids[i] [T_i] int64, a prefill
        chunk, one decode token or a speculative step) on its state -> (logits [T_i, V] float32 per
        request, new states). Equal to `forward_full` of each whole sequence at these positions;
        `deepseek_v4_state.rollback` takes tokens back."""
        hidden, new_states = self.model.forward_step(input_ids, states)
        return list(self.compute_logits(hidden).split([int(ids.shape[0]) for ids in input_ids])), new_states

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        if self._caches is None:
            raise RuntimeError("DeepSeek-V4 has no KV cache bound; call model.bind_kv_caches() first")
        return self.model.forward_paged(input_ids, positions, step, self._caches, self._kernel)

    def attention_layers(self) -> list[DeepseekV4Attention]:
        """None takes a pluggable backend: `set_attention_backend` picks the decode attention."""
        return []

    def set_attention_backend(self, name: str) -> None:
        """"triton": decode / verify steps run V4's Triton kernels (CUDA): the attention (pages not in
        fp8), the compressors' entries, the indexer's scores and the mHC; "torch": the torch
        reference of each."""
        if name not in self.attention_backends:
            raise ValueError(f"attention backend {name!r}: DeepSeek-V4 runs {', '.join(self.attention_backends)}")
        if name == "triton" and self.model.embed_tokens.weight.device.type != "cuda":
            raise ValueError("--attention-backend triton: DeepSeek-V4's Triton attention runs on CUDA; use torch here")
        self._kernel = name == "triton"

    def bind_kv_caches(self, caches: Sequence[tuple[LayerCache, ...]]) -> None:
        """Per layer: its sliding-window cache, then its compressed cache (CSA / HCA layers)."""
        want = [len(s) for s in self.kv_cache_specs()]
        if [len(c) for c in caches] != want:
            raise ValueError(f"expected caches per layer {want}, got {[len(c) for c in caches]}")
        self._caches = tuple(caches)
        if self._kernel and caches and caches[0][0].scales is not None:
            logger.warning("--kv-cache-dtype fp8 with DeepSeek-V4: its Triton attention reads pages in --dtype, so "
                           "decode attention runs the torch gather (slow); the indexer's scores stay in Triton")

    def kv_cache_specs(self) -> list[tuple[KVCacheSpec, ...]]:
        """Per layer, its caches (tandem/kv/spec.py): every layer a sliding window of one shared
        K=V head; a CSA layer also one compressed entry per `ratio` tokens with the indexer's key
        beside it (overlapping windows); an HCA layer one entry per its (larger) ratio."""
        a = self.args
        window = KVCacheSpec("sliding_window", 1, a.head_dim, self.dtype, window=a.sliding_window, k_is_v=True)
        specs: list[tuple[KVCacheSpec, ...]] = []
        for kind in a.layer_types:
            if kind == CSA:
                specs.append((window, KVCacheSpec("compressed", 1, a.head_dim, self.dtype, ratio=a.compress_rates[CSA],
                                                  index_head_dim=a.index_head_dim, overlap=True)))
            elif kind == HCA:
                specs.append((window, KVCacheSpec("compressed", 1, a.head_dim, self.dtype, ratio=a.compress_rates[HCA])))
            else:
                specs.append((window,))
        return specs

    @classmethod
    def checkpoint_name(cls, key: str) -> str:
        """DeepSeek's spelling (the native checkpoints, and what `save_pretrained` writes) -> these
        parameter names; names already in this spelling pass through."""
        return checkpoint_name(key)

    @classmethod
    def ignored_checkpoint_keys(cls) -> tuple[str, ...]:
        return (*super().ignored_checkpoint_keys(), "mtp.")  # the MTP heads: speculative drafters, not served yet

    def moe_blocks(self) -> dict[int, DeepseekV4MoE]:
        """Layer index -> its MoE block: where the offload planner sets per-layer executors."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers)}


def hf_state_dict_to_tandem(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory `DeepseekV4ForCausalLM.state_dict()` -> this model's names: the fused
    `*.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `*.mlp.experts.down_proj` [E, H, I]
    become per-expert `*.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`; the rest is unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, down in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


# DeepSeek's checkpoint names -> Tandem's (transformers' in-memory names, per-expert routed experts).
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          **{f"hc_{b}_{p}": f"{b}_hc.{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")}}
_ATTN = {"attn_sink": "sinks", "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight",
         "wq_b.weight": "q_b_proj.weight", "wkv.weight": "kv_proj.weight", "norm.weight": "kv_norm.weight",
         "wo_a.weight": "o_a_proj.weight", "wo_b.weight": "o_b_proj.weight"}
_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
               "norm.weight": "kv_norm.weight"}
_INDEXER = {"wq_b.weight": "q_b_proj.weight", "weights_proj.weight": "scorer.weights_proj.weight"}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# (checkpoint prefix inside a layer, Tandem's prefix, leaf renames), most specific first
_SCOPES = (("attn.indexer.compressor.", "self_attn.compressor.indexer.", _COMPRESSOR),
           ("attn.indexer.", "self_attn.compressor.indexer.", _INDEXER),
           ("attn.compressor.", "self_attn.compressor.", _COMPRESSOR),
           ("attn.", "self_attn.", _ATTN),
           ("ffn.gate.", "mlp.gate.", {"bias": "e_score_correction_bias", "weight": "weight", "tid2eid": "tid2eid"}))
_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_FFN_KEY = re.compile(r"^ffn\.(experts\.\d+|shared_experts)\.(w[123])\.weight$")


def checkpoint_name(key: str) -> str:
    """One checkpoint tensor name -> this model's; an unknown name passes through unchanged (the
    loader then reports it as unexpected, by its own name)."""
    if key in _TOP:
        return _TOP[key]
    m = _LAYER_KEY.match(key)
    if m is None:
        return key
    layer, rest = m.groups()
    out = _LAYER.get(rest)
    if out is None and (ffn := _FFN_KEY.match(rest)):
        out = f"mlp.{ffn.group(1)}.{_SWIGLU[ffn.group(2)]}.weight"
    for prefix, target, leaves in _SCOPES if out is None else ():
        if rest.startswith(prefix):
            leaf = leaves.get(rest[len(prefix):])
            out = None if leaf is None else target + leaf
            break
    return key if out is None else f"model.layers.{layer}.{out}"
