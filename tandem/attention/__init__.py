"""Attention backends, one per cache-group kind. `torch_ref` is the reference every fast kernel is
tested against; the registry maps a name to a backend class."""

from tandem.attention.backend import AttentionBackend, get_attention_backend, register_attention_backend

__all__ = ["AttentionBackend", "get_attention_backend", "register_attention_backend"]
