"""HF `model_type` -> architecture class. Adding an architecture is one file plus one line here."""

from __future__ import annotations

import importlib

from tandem.models.base import CausalLM

# Lazy "module:Class" paths, so importing the registry does not import every architecture.
_ARCHITECTURES: dict[str, str] = {
    "qwen3": "tandem.models.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "tandem.models.qwen3_moe:Qwen3MoeForCausalLM",
    "deepseek_v4": "tandem.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_ARCHITECTURES))


def get_model_class(model_type: str) -> type[CausalLM]:
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}")
    module, name = _ARCHITECTURES[model_type].split(":")
    return getattr(importlib.import_module(module), name)
