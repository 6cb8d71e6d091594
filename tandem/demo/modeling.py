"""Training-side Qwen3 / Qwen3-MoE in plain PyTorch, with HF checkpoint tensor names.

Written for training speed (fused SDPA, experts stacked as [E, ...] tensors and run with a grouped
matmul on CUDA), not for serving: Tandem serves the saved checkpoint with `tandem.models`.
`hf_state_dict()` writes the experts back out per expert (`mlp.experts.{j}.gate_proj.weight`),
the layout Qwen3-MoE checkpoints use. The math follows Qwen3: RMSNorm, q/k RMSNorm per head,
rotate-half RoPE, GQA, SwiGLU, softmax router with top-k renormalised weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv  # [..., T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)  # fp32 norms under autocast
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # right padding is harmless
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class DenseMLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_GROUPED_MM_OK: bool | None = None


def _grouped_ok(device: torch.device) -> bool:
    """Whether torch._grouped_mm works here (Hopper, bf16); checked once against a loop."""
    global _GROUPED_MM_OK
    if _GROUPED_MM_OK is None:
        _GROUPED_MM_OK = False
        if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
            try:
                # Uneven groups (one empty) and a backward pass, as training uses it.
                x = torch.randn(53, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
                w = torch.randn(3, 32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
                offs = torch.tensor([7, 7, 53], device=device, dtype=torch.int32)
                y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
                y.float().square().sum().backward()
                ref = torch.cat([x[:7] @ w[0].T, x[7:7] @ w[1].T, x[7:] @ w[2].T])
                ok = torch.allclose(y.float(), ref.float(), atol=0.1, rtol=0.05)
                _GROUPED_MM_OK = bool(ok and w.grad is not None and torch.isfinite(w.grad).all())
            except Exception as e:  # noqa: BLE001
                print(f"grouped_mm unavailable ({e}); using a per-expert loop")
    return _GROUPED_MM_OK


class MoE(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, mi, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
        self.e, self.k = e, cfg["num_experts_per_tok"]
        self.gate = nn.Linear(h, e, bias=False)
        self.w_gate = nn.Parameter(torch.randn(e, mi, h) * 0.02)  # [E, I, H]
        self.w_up = nn.Parameter(torch.randn(e, mi, h) * 0.02)
        self.w_down = nn.Parameter(torch.randn(e, h, mi) * 0.02)  # [E, H, I]
        self.aux_loss = torch.zeros(())

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs [M, H] sorted by expert, counts [E] -> [M, H]."""
        if _grouped_ok(xs.device) and xs.dtype == torch.bfloat16:
            offs = counts.cumsum(0).to(torch.int32)
            g = torch._grouped_mm(xs, self.w_gate.to(xs.dtype).transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(xs, self.w_up.to(xs.dtype).transpose(-2, -1), offs=offs)
            return torch._grouped_mm(F.silu(g) * u, self.w_down.to(xs.dtype).transpose(-2, -1), offs=offs)
        outs, start = [], 0
        for j, n in enumerate(counts.tolist()):
            part = xs[start:start + n]
            start += n
            dt = part.dtype
            g = part @ self.w_gate[j].to(dt).T
            u = part @ self.w_up[j].to(dt).T
            outs.append((F.silu(g) * u) @ self.w_down[j].to(dt).T)
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        topw, topi = probs.topk(self.k, dim=-1)  # [T, k]
        topw = topw / topw.sum(-1, keepdim=True)
        flat = topi.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=self.e)
        xs = x[order // self.k]  # [T*k, H] grouped by expert
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            xs = xs.to(torch.bfloat16)
        ys = self._experts(xs, counts)  # [T*k, H]
        ys = ys * topw.flatten()[order, None].to(ys.dtype)
        out = torch.zeros_like(x).index_add_(0, order // self.k, ys.to(x.dtype))
        if self.training:  # switch-style load balancing
            frac = counts.float() / flat.numel()
            self.aux_loss = self.e * (frac * probs.mean(0)).sum()
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: dict[str, Any], moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if moe else DenseMLP(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """`forward(ids [B, T]) -> (logits [B, T, V], hidden states after each layer)`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.moe = cfg["model_type"] == "qwen3_moe"
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Block(cfg, self.moe) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.tied else self.lm_head.weight
        return self.norm(h) @ w.to(h.dtype).T

    def forward(self, ids: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        pos = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(pos, self.cfg["head_dim"], self.cfg["rope_theta"])
        x = self.embed_tokens(ids)
        hidden = []
        for layer in self.layers:
            x = layer(x, cos, sin)
            hidden.append(x)
        return (self.head(x) if logits else None), hidden

    def aux_loss(self) -> torch.Tensor:
        if not self.moe:
            return torch.zeros(())
        return sum(layer.mlp.aux_loss for layer in self.layers) / len(self.layers)

    def hf_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            t = t.detach().to("cpu", dtype)
            key = name if name.startswith("lm_head") else "model." + name
            if ".mlp.w_" in name:
                proj = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[name.rsplit(".", 1)[1]]
                base = key.rsplit(".", 1)[0]
                for j in range(t.shape[0]):
                    out[f"{base}.experts.{j}.{proj}.weight"] = t[j].clone().contiguous()
            else:
                out[key] = t.contiguous()
        return out


def hf_config(cfg: dict[str, Any], special: dict[str, int]) -> dict[str, Any]:
    """config.json contents for a training config (`special`: added-token ids)."""
    moe = cfg["model_type"] == "qwen3_moe"
    out = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        **cfg,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg["num_hidden_layers"],
        "rope_scaling": None,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": special["<|im_end|>"],
        "torch_dtype": "bfloat16",
    }
    if moe:
        out.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
                   router_aux_loss_coef=0.01)
    return out
