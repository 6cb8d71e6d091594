"""DSpark block drafter (`tandem_dspark_v1`, the demo model's `dspark/`): serving side.

The drafter reads the target's hidden states and drafts a whole block in one forward pass; only a
low-rank Markov correction runs token by token. Format: the demo model card
(`tandem/assets/demo/README.md`, "DSpark drafter weight format"); the training-side module
(`tandem/demo/dspark.py`) is the reference the tests hold this one to. Nothing here imports the demo.

Input contract, for a request whose target forward has covered positions 0..t and whose target
just produced the next token x[t+1] (sampled from the logits at position t, not yet fed back):

- `feats [N, W, F]`: for positions j = t-W+1 .. t, oldest first, with positions below 0 clamped to
  0 (a request with t+1 < W repeats position 0's row at the front; `window_positions`), the
  OUTPUT hidden states of the target decoder layers `target_layers` at position j, concatenated
  along the feature axis in `target_layers` order: F = len(target_layers) * Ht. A layer's output
  is the residual stream after that layer, before the final norm even for the last layer (the
  demo reads layer 7 of 8): HF's `hidden_states[l + 1]`, except that HF puts the normed output
  in place of the last layer's. In Tandem's Qwen3 models a decoder layer returns
  `(mlp_out, residual)`; its output is their sum. Only positions of accepted tokens count: after
  verifying [x[t+1], d_1..d_K] at positions t+1..t+1+K with a drafts accepted, rows t+1..t+1+a
  join the window, the rejected rows are dropped, and the new t is t+1+a.
- `known [N]` int64: x[t+1], the token the target produced from position t (after prefill: the
  first sampled token; after verification: the correction or bonus token).
- `k`: drafts per request, 0..block_size each.

Output (`DSparkDraft`): drafts for x[t+2 .. t+1+k], their logits and the distribution each was
drawn from, and the confidence head's estimate of P(draft i accepted | drafts before it accepted).
Drafts are prefix-consistent: the block forward does not depend on k, so drafting k tokens and
keeping the first j gives the j-token draft (greedy; sampled too, drawing from a request's own
generator), which lets a controller draft the block and cut it where the confidence falls.

Target tensors (embedding, final norm, lm_head) are shared, not copied: `bind_target`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tandem.models.layers.norm import RMSNorm

ARCHITECTURE = "tandem_dspark_v1"
# Target tensors the drafter uses, by checkpoint name (the config's `shares_target`).
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
SHARED_TARGET = (EMBED, FINAL_NORM, LM_HEAD)
_INT_FIELDS = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "block_size", "window",
               "markov_rank", "vocab_size", "target_hidden_size")


class DSparkFormatError(ValueError):
    """A `dspark/` directory that is not a `tandem_dspark_v1` drafter; the message names the file."""


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int  # d
    num_layers: int
    num_heads: int
    intermediate_size: int  # I (SwiGLU)
    block_size: int  # B: most drafts per forward
    window: int  # W: target positions read
    markov_rank: int  # r
    target_layers: tuple[int, ...]  # 0-based target decoder layers whose outputs are read
    vocab_size: int  # V
    target_hidden_size: int  # Ht

    @property
    def feature_size(self) -> int:
        """F: one position's fused target features."""
        return len(self.target_layers) * self.target_hidden_size

    @classmethod
    def from_file(cls, path: Path) -> DSparkConfig:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DSparkFormatError(f"{path}: cannot read it as JSON ({e})") from None
        if not isinstance(raw, dict):
            raise DSparkFormatError(f"{path}: expected a JSON object")
        if raw.get("architecture") != ARCHITECTURE:
            raise DSparkFormatError(f"{path}: architecture is {raw.get('architecture')!r}, expected {ARCHITECTURE!r}")
        for key in _INT_FIELDS:
            v = raw.get(key)
            if type(v) is not int or v <= 0:
                raise DSparkFormatError(f"{path}: {key!r} must be a positive integer, got {v!r}")
        layers = raw.get("target_layers")
        if (not isinstance(layers, list) or not layers or any(type(i) is not int or i < 0 for i in layers)
                or len(set(layers)) != len(layers)):
            raise DSparkFormatError(f"{path}: 'target_layers' must be a non-empty list of distinct layer indices "
                                    f"(>= 0), got {layers!r}")
        if raw["hidden_size"] % raw["num_heads"]:
            raise DSparkFormatError(f"{path}: hidden_size {raw['hidden_size']} is not a multiple of "
                                    f"num_heads {raw['num_heads']}")
        shared = raw.get("shares_target", list(SHARED_TARGET))
        if not isinstance(shared, list) or not set(shared) <= set(SHARED_TARGET):
            raise DSparkFormatError(f"{path}: 'shares_target' {shared!r} names target tensors this drafter does not "
                                    f"know (it uses {list(SHARED_TARGET)})")
        return cls(**{k: raw[k] for k in _INT_FIELDS}, target_layers=tuple(layers))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of `model.safetensors` and its shape (the model card's table)."""
        d, ht, v, r, inter = (self.hidden_size, self.target_hidden_size, self.vocab_size, self.markov_rank,
                              self.intermediate_size)
        shapes = {"fc.weight": (d, self.feature_size), "in_norm.weight": (d,), "embed_proj.weight": (d, ht),
                  "slots": (self.block_size + 1, d), "pos": (self.window + self.block_size + 1, d)}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "qkv.weight": (3 * d, d),
                           p + "o.weight": (d, d), p + "gate_up.weight": (2 * inter, d), p + "down.weight": (d, inter)})
        shapes.update({"norm.weight": (d,), "out_proj.weight": (ht, d), "markov_w1.weight": (v, r),
                       "markov_w2.weight": (v, r), "conf_head.weight": (1, d), "conf_head.bias": (1,)})
        return shapes


def _read_weights(path: Path, cfg: DSparkConfig) -> dict[str, torch.Tensor]:
    """model.safetensors -> tensors (on CPU, as stored), checked against the config's names and shapes."""
    want = cfg.tensor_shapes()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            missing, extra = sorted(set(want) - names), sorted(names - set(want))
            if missing or extra:
                raise DSparkFormatError(f"{path}: not the tensors its config.json describes: missing {missing[:4]}"
                                        f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
                                        f"{' ...' if len(extra) > 4 else ''}")
            tensors = {name: f.get_tensor(name) for name in want}
    except DSparkFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise DSparkFormatError(f"{path}: cannot read it as safetensors ({e})") from None
    for name, t in tensors.items():
        if tuple(t.shape) != want[name] or not t.is_floating_point():
            raise DSparkFormatError(f"{path}: {name} is {t.dtype} {list(t.shape)}, expected a float tensor "
                                    f"{list(want[name])}")
    return tensors


class _BlockLayer(nn.Module):
    """Pre-norm bidirectional self-attention (no RoPE: `pos` is added once) + SwiGLU."""

    def __init__(self, d: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)  # gate: first I rows, up: last I
        self.down = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape  # [N, W+B+1, d]
        qkv = self.qkv(self.norm1(x)).view(n, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, heads, S, hd]
        attn = F.scaled_dot_product_attention(q, k, v)  # every position sees every other
        x = x + self.o(attn.transpose(1, 2).reshape(n, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@dataclass
class _Target:
    """The target tensors the drafter reads (references into the target, not copies)."""

    embed: torch.Tensor  # [V, Ht]
    lm_head: torch.Tensor  # [V, Ht]
    norm: RMSNorm  # the target's final norm (its weight, its eps)


@dataclass
class DSparkDraft:
    """One `propose` call's drafts, padded to the longest k of the batch (Kmax).

    Past a request's own k: tokens are -1 and logits, probs and confidence are 0."""

    tokens: torch.Tensor  # [N, Kmax] int64
    logits: torch.Tensor  # [N, Kmax, V] float32: base + Markov bias, before temperature
    probs: torch.Tensor  # [N, Kmax, V] float32: q, the distribution each draft was drawn from
    confidence: torch.Tensor  # [N, Kmax] float32: P(draft i accepted | drafts 1..i-1 accepted)
    k: tuple[int, ...]  # drafts per request (host)

    def request(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Request i's unpadded (tokens [k], probs [k, V], confidence [k])."""
        k = self.k[i]
        return self.tokens[i, :k], self.probs[i, :k], self.confidence[i, :k]


class DSparkDrafter(nn.Module):
    """Parameter names equal the tensor names of `dspark/model.safetensors`."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, ht, v = cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size
        self.fc = nn.Linear(cfg.feature_size, d, bias=False)
        self.in_norm = RMSNorm(d)
        self.embed_proj = nn.Linear(ht, d, bias=False)
        self.slots = nn.Parameter(torch.empty(cfg.block_size + 1, d))  # slot 0: the known token; 1..B: drafts
        self.pos = nn.Parameter(torch.empty(cfg.window + cfg.block_size + 1, d))  # [W context, known, B slots]
        self.layers = nn.ModuleList(_BlockLayer(d, cfg.num_heads, cfg.intermediate_size)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d)
        self.out_proj = nn.Linear(d, ht, bias=False)
        self.markov_w1 = nn.Embedding(v, cfg.markov_rank)  # [V, r]
        self.markov_w2 = nn.Linear(cfg.markov_rank, v, bias=False)  # weight [V, r]
        self.conf_head = nn.Linear(d, 1)
        self.source: Path | None = None
        self._target: _Target | None = None

    # ---- loading -----------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> DSparkDrafter:
        """Load a drafter directory (config.json + model.safetensors), or a model directory with
        one in `dspark/`. Refuses, naming the file, anything but a complete `tandem_dspark_v1`."""
        d = Path(path)
        if (d / "dspark").is_dir():
            d = d / "dspark"
        if not (d / "config.json").is_file():
            raise DSparkFormatError(f"{d}: no config.json (a DSpark drafter directory holds config.json and "
                                    f"model.safetensors)")
        cfg = DSparkConfig.from_file(d / "config.json")
        if not (d / "model.safetensors").is_file():
            raise DSparkFormatError(f"{d}: no model.safetensors")
        tensors = _read_weights(d / "model.safetensors", cfg)
        with torch.device("meta"):
            drafter = cls(cfg)
        drafter.load_state_dict({k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}, assign=True)
        drafter.source = d
        return drafter.eval().requires_grad_(False)

    def check_target(self, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        """Raise ValueError unless this drafter fits a target of these sizes."""
        cfg, where = self.cfg, self.source or "the DSpark drafter"
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"{where}: the drafter's vocab_size is {cfg.vocab_size} but the target's is "
                             f"{vocab_size}; use a drafter trained for this target")
        if cfg.target_hidden_size != hidden_size:
            raise ValueError(f"{where}: the drafter reads hidden states of size {cfg.target_hidden_size} "
                             f"(target_hidden_size) but the target's hidden_size is {hidden_size}")
        if max(cfg.target_layers) >= num_layers:
            raise ValueError(f"{where}: the drafter reads target layers {list(cfg.target_layers)} but the target "
                             f"has {num_layers} layers (0..{num_layers - 1})")

    def bind_target(self, tensors: Mapping[str, torch.Tensor], rms_norm_eps: float) -> None:
        """Share the target's tensors, given by checkpoint name (e.g. `dict(target.named_parameters())`
        of a Tandem model): `model.embed_tokens.weight`, `model.norm.weight` and `lm_head.weight`
        (a tied target has none: its embedding is used). They must be in the drafter's dtype and
        on its device; nothing is copied."""
        missing = [n for n in (EMBED, FINAL_NORM) if n not in tensors]
        if missing:
            raise ValueError(f"the target tensors given lack {missing}")
        embed, norm_w = tensors[EMBED], tensors[FINAL_NORM]
        lm_head = tensors.get(LM_HEAD, embed)
        cfg, p = self.cfg, self.fc.weight
        want = {EMBED: (cfg.vocab_size, cfg.target_hidden_size), FINAL_NORM: (cfg.target_hidden_size,),
                LM_HEAD: (cfg.vocab_size, cfg.target_hidden_size)}
        for name, t in ((EMBED, embed), (FINAL_NORM, norm_w), (LM_HEAD, lm_head)):
            if tuple(t.shape) != want[name]:
                raise ValueError(f"target {name} is {list(t.shape)} but the drafter expects {list(want[name])}")
            if t.dtype != p.dtype or t.device != p.device:
                raise ValueError(f"target {name} is {t.dtype} on {t.device} but the drafter is {p.dtype} on "
                                 f"{p.device}; load the drafter with the target's dtype and device")
        norm = RMSNorm(cfg.target_hidden_size, rms_norm_eps)
        norm.weight = nn.Parameter(norm_w.detach(), requires_grad=False)  # shares the target's storage
        self._target = _Target(embed.detach(), lm_head.detach(), norm)

    # ---- inputs ------------------------------------------------------------------------------

    def fuse(self, layer_outputs: Mapping[int, torch.Tensor] | Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's layer outputs, by layer index (a mapping, or a list of every layer's output),
        each [..., Ht] -> fused features [..., F], concatenated in `target_layers` order."""
        return torch.cat([layer_outputs[i] for i in self.cfg.target_layers], dim=-1)

    def window_positions(self, last: torch.Tensor) -> torch.Tensor:
        """last [N] int64 (t: the newest position with target hidden states) -> [N, W] positions
        t-W+1 .. t, oldest first, clamped at 0 (as the drafter was trained)."""
        back = torch.arange(self.cfg.window - 1, -1, -1, device=last.device)  # [W]: W-1 .. 0
        return (last[:, None] - back).clamp(min=0)

    # ---- forward -----------------------------------------------------------------------------

    def block_states(self, feats: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """feats [N, W, F], known [N] -> slot states z [N, B, d] for drafts 1..B (one forward)."""
        tgt = self._bound()
        n = feats.shape[0]
        ctx = self.in_norm(self.fc(feats))  # [N, W, d]
        known_slot = self.slots[0] + self.embed_proj(F.embedding(known, tgt.embed))  # [N, d]
        x = torch.cat([ctx, known_slot[:, None], self.slots[1:].expand(n, -1, -1)], dim=1) + self.pos  # [N, W+B+1, d]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x[:, -self.cfg.block_size:])  # [N, B, d]

    def base_logits(self, z: torch.Tensor) -> torch.Tensor:
        """z [..., d] -> [..., V] float32 through the target's final norm and lm_head."""
        tgt = self._bound()
        return F.linear(tgt.norm(self.out_proj(z)), tgt.lm_head).float()

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] token ids -> [..., V] float32: W2 · W1[prev]."""
        return self.markov_w2(self.markov_w1(prev)).float()

    def confidence(self, z: torch.Tensor) -> torch.Tensor:
        """z [..., d] -> [...] float32 in (0, 1)."""
        return torch.sigmoid(self.conf_head(z).squeeze(-1).float())

    @torch.no_grad()
    def propose(
        self,
        feats: torch.Tensor,  # [N, W, F]: see the module docstring
        known: torch.Tensor,  # [N] int64: x[t+1]
        k: Sequence[int],  # drafts per request, each 0..block_size
        temperature: float | torch.Tensor = 0.0,  # scalar or [N]; 0: greedy (argmax)
        generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    ) -> DSparkDraft:
        """Draft k[i] tokens for each request i.

        Draft j of a request is drawn from q_j = softmax(logits_j / T) (T > 0) or is its argmax
        (T = 0, q_j one-hot there: the proposal really is deterministic), where
        logits_j = base_j + W2·W1[y_{j-1}], y_0 = known, y_j the draft just chosen: the Markov
        correction is sequential, everything else is one batched forward. With one generator (or
        None: torch's default) the sampled rows draw together; with a list (one per request, None
        for greedy rows) each request draws k[i] times from its own, independent of its batch."""
        cfg = self.cfg
        k = tuple(int(x) for x in k)
        self._check_inputs(feats, known, k)
        n, dev = known.shape[0], known.device
        kmax = max(k, default=0)
        v = cfg.vocab_size
        if kmax == 0:
            f32 = {"dtype": torch.float32, "device": dev}
            return DSparkDraft(torch.full((n, 0), -1, dtype=torch.long, device=dev), torch.zeros(n, 0, v, **f32),
                               torch.zeros(n, 0, v, **f32), torch.zeros(n, 0, **f32), k)
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(n)  # [N]
        if (temp < 0).any() or not torch.isfinite(temp).all():
            raise ValueError("draft temperature must be finite and >= 0")
        greedy = temp == 0  # [N]
        any_sampled = not bool(greedy.all())
        per_request = generator is not None and not isinstance(generator, torch.Generator)
        if per_request and len(generator) != n:
            raise ValueError(f"got {len(generator)} generators for {n} requests")

        z = self.block_states(feats, known)[:, :kmax]  # [N, Kmax, d]
        base = self.base_logits(z)  # [N, Kmax, V]
        logits = torch.empty_like(base)
        probs = torch.zeros_like(base)
        tokens = torch.empty(n, kmax, dtype=torch.long, device=dev)
        safe_temp = torch.where(greedy, 1.0, temp)[:, None]  # [N, 1]: greedy rows' q is replaced below
        own_rows = [i for i, g in enumerate(greedy.tolist()) if not g] if per_request else []
        rows = torch.arange(n, device=dev)
        prev = known
        for j in range(kmax):  # the Markov correction is the only sequential part
            logits[:, j] = base[:, j] + self.markov_bias(prev)  # [N, V]
            tok = logits[:, j].argmax(-1)  # [N]
            if any_sampled:
                q = torch.softmax(logits[:, j] / safe_temp, dim=-1)  # [N, V]
                if per_request:  # a request draws only while it drafts: k[i] draws from its generator
                    drawn = tok.clone()
                    for i in own_rows:
                        if j < k[i]:
                            drawn[i] = torch.multinomial(q[i], 1, generator=generator[i])[0]
                else:
                    drawn = torch.multinomial(q, 1, generator=generator)[:, 0]
                tok = torch.where(greedy, tok, drawn)
                probs[:, j] = torch.where(greedy[:, None], 0.0, q)
            probs[rows[greedy], j, tok[greedy]] = 1.0  # a greedy draft's q is one-hot
            tokens[:, j] = tok
            prev = tok

        valid = torch.arange(kmax, device=dev) < torch.tensor(k, device=dev)[:, None]  # [N, Kmax]
        return DSparkDraft(tokens.masked_fill(~valid, -1), logits * valid[..., None], probs * valid[..., None],
                           self.confidence(z) * valid, k)

    @torch.no_grad()
    def draft_block(self, feats: torch.Tensor, known: torch.Tensor, kmax: int,
                    inv_temp: torch.Tensor | None = None, gumbel: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The serving path: `kmax` drafts for every request, with device tensors only (no host
        sync, fixed shapes), so a CUDA graph can capture it. Drafts are prefix-consistent, so the
        caller cuts each request's block to its own k.

        feats [N, W, F] and known [N] as for `propose`. Greedy (gumbel None): every draft is the
        argmax, as in `propose` with temperature 0. Sampling: inv_temp [N] (1 / temperature) and
        gumbel [N, kmax, V] standard Gumbel noise; draft j is argmax(logits_j * inv_temp + gumbel_j),
        which is a draw from q_j = softmax(logits_j * inv_temp) (the Gumbel-max trick); a row with
        zero noise and inv_temp 1 is greedy. Returns (tokens [N, kmax] int64, q [N, kmax, V] float32
        or None when greedy, confidence [N, kmax] float32)."""
        z = self.block_states(feats, known)[:, :kmax]  # [N, kmax, d]
        base = self.base_logits(z)  # [N, kmax, V]
        tokens, probs, prev = [], [], known
        for j in range(kmax):  # the Markov correction is the only sequential part
            logits = base[:, j] + self.markov_bias(prev)  # [N, V]
            if gumbel is None:
                tok = logits.argmax(-1)
            else:
                scaled = logits * inv_temp[:, None]
                tok = (scaled + gumbel[:, j]).argmax(-1)
                probs.append(torch.softmax(scaled, dim=-1))
            tokens.append(tok)
            prev = tok
        q = torch.stack(probs, dim=1) if probs else None
        return torch.stack(tokens, dim=1), q, self.confidence(z)

    # ---- helpers -----------------------------------------------------------------------------

    def _bound(self) -> _Target:
        if self._target is None:
            raise RuntimeError("DSparkDrafter.bind_target(...) must give it the target's embedding, final norm "
                               "and lm_head first")
        return self._target

    def _check_inputs(self, feats: torch.Tensor, known: torch.Tensor, k: tuple[int, ...]) -> None:
        cfg, n = self.cfg, known.shape[0] if known.dim() == 1 else -1
        if n < 0 or tuple(feats.shape) != (n, cfg.window, cfg.feature_size):
            raise ValueError(f"expected feats [N, {cfg.window}, {cfg.feature_size}] and known [N]; got "
                             f"{list(feats.shape)} and {list(known.shape)}")
        if len(k) != n or any(x < 0 or x > cfg.block_size for x in k):
            raise ValueError(f"k must give 0..{cfg.block_size} drafts for each of the {n} requests, got {list(k)}")
        if feats.dtype != self.fc.weight.dtype or feats.device != self.fc.weight.device:
            raise ValueError(f"feats are {feats.dtype} on {feats.device} but the drafter is {self.fc.weight.dtype} "
                             f"on {self.fc.weight.device}")
