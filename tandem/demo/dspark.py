"""A DSpark-style block drafter (our own design after the DSpark description in deepseek-ai/DeepSpec).

Given the target's hidden states up to position t (from a few chosen layers) and the next token
x[t+1] (the one the target just produced), it drafts x[t+2 .. t+1+K] for K <= `block` in ONE
forward pass:

    ctx_j   = fc(concat(h_l1[j], h_l2[j], ...))          for the last `window` positions j <= t
    seq     = [ctx_{t-window+1} .. ctx_t, embed(x[t+1]) + slot_0, slot_1, .., slot_K]
    z       = `num_layers` bidirectional transformer layers over seq
    base_i  = lm_head(norm(z at slot_i))                    (target's lm_head, frozen, shared)
    logit_i = base_i + W2 @ W1[y_{i-1}]                     (low-rank Markov bias, sequential:
                                                              y_0 = x[t+1], y_i = argmax logit_i)
    conf_i  = sigmoid(conf_head(z at slot_i))               (P(draft i accepted | 1..i-1 accepted))

Only the Markov step is sequential and it is one [r] gather + one [V, r] matvec per position.
Weights: `dspark/model.safetensors` with `dspark/config.json` beside the target: see `TENSORS` and the model card.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.demo.modeling import RMSNorm


class _Layer(nn.Module):
    def __init__(self, d: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        d, n_src = cfg["hidden_size"], len(cfg["target_layers"])
        self.fc = nn.Linear(n_src * cfg["target_hidden_size"], d, bias=False)
        self.in_norm = RMSNorm(d)
        self.embed_proj = nn.Linear(cfg["target_hidden_size"], d, bias=False)  # target's embedding -> d
        self.slots = nn.Parameter(torch.randn(cfg["block_size"] + 1, d) * 0.02)  # [K+1, d]; slot 0 = known token
        self.pos = nn.Parameter(torch.randn(cfg["window"] + cfg["block_size"] + 1, d) * 0.02)
        self.layers = nn.ModuleList(_Layer(d, cfg["num_heads"], cfg["intermediate_size"])
                                    for _ in range(cfg["num_layers"]))
        self.norm = RMSNorm(d)
        self.out_proj = nn.Linear(d, cfg["target_hidden_size"], bias=False)  # into the target's lm_head space
        self.markov_w1 = nn.Embedding(cfg["vocab_size"], cfg["markov_rank"])  # [V, r]
        self.markov_w2 = nn.Linear(cfg["markov_rank"], cfg["vocab_size"], bias=False)  # weight [V, r]
        nn.init.zeros_(self.markov_w2.weight)
        self.conf_head = nn.Linear(d, 1)

    def block_states(self, feats: torch.Tensor, known_emb: torch.Tensor) -> torch.Tensor:
        """feats [N, W, n_src*Ht] (fused target hidden states of the last W positions),
        known_emb [N, Ht] (target embedding of x[t+1]) -> slot states [N, K, d]."""
        ctx = self.in_norm(self.fc(feats))  # [N, W, d]
        slots = self.slots.unsqueeze(0).expand(feats.shape[0], -1, -1).clone()  # [N, K+1, d]
        slots[:, 0] = slots[:, 0] + self.embed_proj(known_emb)
        x = torch.cat([ctx, slots], dim=1) + self.pos  # [N, W+K+1, d]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x[:, -self.cfg["block_size"]:])  # [N, K, d]

    def base_logits(self, z: torch.Tensor, lm_head: torch.Tensor, final_norm: nn.Module) -> torch.Tensor:
        """z [N, K, d] -> [N, K, V] through the target's final norm and lm_head weight [V, Ht]."""
        return final_norm(self.out_proj(z)) @ lm_head.to(z.dtype).T

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] token ids -> [..., V] bias W2 @ W1[prev]."""
        return self.markov_w2(self.markov_w1(prev))

    def confidence(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conf_head(z).squeeze(-1).float())  # [N, K]

    @torch.no_grad()
    def draft(self, feats: torch.Tensor, known: torch.Tensor, known_emb: torch.Tensor, lm_head: torch.Tensor,
              final_norm: nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy draft of k tokens -> (tokens [N, k], confidences [N, k])."""
        z = self.block_states(feats, known_emb)
        base = self.base_logits(z[:, :k], lm_head, final_norm).float()
        prev, toks = known, []
        for i in range(k):  # the Markov head is the only sequential part
            prev = (base[:, i] + self.markov_bias(prev).float()).argmax(-1)
            toks.append(prev)
        return torch.stack(toks, 1), self.confidence(z[:, :k])


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes in dspark/model.safetensors (the weight format the engine loads)."""
    d, ht, v = cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"]
    shapes = {
        "fc.weight": (d, len(cfg["target_layers"]) * ht),
        "in_norm.weight": (d,),
        "embed_proj.weight": (d, ht),
        "slots": (cfg["block_size"] + 1, d),
        "pos": (cfg["window"] + cfg["block_size"] + 1, d),
    }
    for i in range(cfg["num_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "qkv.weight": (3 * d, d),
                       p + "o.weight": (d, d), p + "gate_up.weight": (2 * cfg["intermediate_size"], d),
                       p + "down.weight": (d, cfg["intermediate_size"])})
    shapes.update({"norm.weight": (d,), "out_proj.weight": (ht, d), "markov_w1.weight": (v, cfg["markov_rank"]),
                   "markov_w2.weight": (v, cfg["markov_rank"]), "conf_head.weight": (1, d), "conf_head.bias": (1,)})
    return shapes
