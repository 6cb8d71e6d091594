"""Tiny random checkpoints for tests: saved by `transformers` (the reference implementation), with
the built-in model's real tokenizer files beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

ASSETS = Path(__file__).resolve().parent.parent / "tandem" / "assets"
TOKENIZER_JSON = ASSETS / "builtin_tokenizer.json"


def tokenizer_vocab_size() -> int:
    data = json.loads(TOKENIZER_JSON.read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def save_tiny_model(out_dir: Path, kind: str = "qwen3_moe", seed: int = 0, **overrides: Any):
    """Save a tiny random `kind` model with transformers plus tokenizer files; returns the HF model
    (fp32, eval mode) so tests can compare against it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = tokenizer_vocab_size()
    vocab += -vocab % 64
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if kind == "qwen3_moe":
        common.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    common.update(overrides)
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(kind)
    # Random init at std 0.02 gives near-uniform logits, where greedy ties make token-identity
    # tests meaningless; wider weights give a peaked, deterministic distribution.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    write_tokenizer_files(out_dir)
    return model


def write_tokenizer_files(out_dir: Path) -> None:
    """The built-in model's tokenizer and chat template, and a generation config with no EOS."""
    shutil.copy(TOKENIZER_JSON, out_dir / "tokenizer.json")
    template = (ASSETS / "builtin_chat_template.jinja").read_text()
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None})
    )
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
