"""fp8 full-attention KV caches (--kv-cache-dtype fp8) through a tiny Qwen3 on CPU, fp32, torch
reference backend: paged prefill chunks and decode steps of packed requests against the same steps
on caches in the model's dtype; and the unscaled binding is unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_models import BLOCK_SIZE, NUM_BLOCKS, PagedRun
from tiny_models import save_tiny_model

from tandem.attention import get_attention_backend
from tandem.kv.tensors import LayerCache
from tandem.models.loader import load_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3_fp8")
    save_tiny_model(tmp, "qwen3", seed=0, num_hidden_layers=3)
    ours, _ = load_checkpoint(tmp, torch.float32, "cpu", progress=False)
    return ours


def make_caches(model, fp8: bool) -> list[tuple[LayerCache, ...]]:
    """One zeroed full-attention cache per layer, shaped as tandem/kv/tensors.py allocates them."""
    caches = []
    for spec in model.kv_cache_specs():
        if fp8:
            spec = replace(spec, page_dtype=torch.float8_e4m3fn)
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        pages = torch.zeros(shape, dtype=spec.stored_dtype)
        scales = torch.zeros(shape[:-1], dtype=torch.float32) if spec.scaled else None
        caches.append((LayerCache(0, pages, scales=scales),))
    return caches


def prompts(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    return {"a": torch.randint(0, vocab, (60,), generator=g), "b": torch.randint(0, vocab, (37,), generator=g)}


def teacher_forced(model, caches: list[tuple[LayerCache, ...]] | None) -> torch.Tensor:
    """On `caches` (None: those already bound), prefill chunks of `a` and `b` packed, then `a`
    decoding next to `b`'s last chunk and both decoding (across block edges) -> every token's
    logits [97, V]."""
    if caches is not None:
        model.bind_kv_caches(caches)
    a, b = prompts(model).values()
    run = PagedRun(model, bind=False)
    out = {"a": [], "b": []}
    for chunks in ({"a": a[:30], "b": b[:30]}, {"b": b[30:34], "a": a[30:31]}, {"a": a[31:48]}):
        for rid, logits in run.step(chunks).items():
            out[rid].append(logits)
    for t in range(48, 60):
        chunks = {"a": a[t : t + 1]} | ({"b": b[34 + t - 48 : 35 + t - 48]} if t < 51 else {})
        for rid, logits in run.step(chunks).items():
            out[rid].append(logits)
    return torch.cat([torch.cat(out["a"]), torch.cat(out["b"])])


def greedy(model, caches, prompt: torch.Tensor, n: int) -> list[int]:
    model.bind_kv_caches(caches)
    run = PagedRun(model, bind=False)
    tok = int(run.step({"r": prompt})["r"][-1].argmax())
    out = [tok]
    for _ in range(n - 1):
        tok = int(run.step({"r": torch.tensor([tok])})["r"][-1].argmax())
        out.append(tok)
    return out


def test_fp8_caches_logits_close_to_unquantized(model):
    want = teacher_forced(model, make_caches(model, fp8=False))
    fp8_caches = make_caches(model, fp8=True)
    got = teacher_forced(model, fp8_caches)
    assert want.shape == got.shape == (97, model.args.vocab_size)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.05, rel  # quantized (not equal), but close
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    # The next-token choice survives quantization almost everywhere.
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    # The caches really hold fp8 with scales: every written slot has a positive scale.
    (layer0,) = fp8_caches[0]
    assert layer0.pages.dtype == torch.float8_e4m3fn
    assert (layer0.scales > 0).sum() == 2 * 97 * model.args.num_key_value_heads


def test_fp8_caches_greedy_first_tokens_mostly_equal(model):
    prompt = prompts(model)["a"][:40]
    want = greedy(model, make_caches(model, fp8=False), prompt, 8)
    got = greedy(model, make_caches(model, fp8=True), prompt, 8)
    assert got[:2] == want[:2]
    assert sum(x == y for x, y in zip(got, want)) >= 6, (got, want)


def test_bind_kv_caches_hands_scales_to_each_layer(model):
    caches = make_caches(model, fp8=True)
    model.bind_kv_caches(caches)
    for attn, (cache,) in zip(model.attention_layers(), caches):
        assert attn.kv_cache is cache.pages and attn.kv_scales is cache.scales
    model.bind_kv_caches(make_caches(model, fp8=False))
    assert all(attn.kv_scales is None for attn in model.attention_layers())


class OldCall:
    """The torch backend called as before `kv_scales` existed; records what each layer passed."""

    def __init__(self) -> None:
        self.inner = get_attention_backend("torch")
        self.seen: list[torch.Tensor | None] = []

    def forward(self, q, k, v, kv_cache, step, group, scale, kv_scales=None):  # noqa: ANN001
        self.seen.append(kv_scales)
        return self.inner.forward(q, k, v, kv_cache, step, group, scale)


def test_unscaled_binding_is_bitwise_unchanged(model):
    want = teacher_forced(model, make_caches(model, fp8=False))
    spy = OldCall()
    layers = model.attention_layers()
    try:
        for attn in layers:
            attn.set_backend(spy)
        got = teacher_forced(model, make_caches(model, fp8=False))
    finally:
        for attn in layers:
            attn.set_backend(spy.inner)
    assert torch.equal(got, want)
    assert spy.seen and all(s is None for s in spy.seen)
    # And the pre-scales binding call (pages and group only) is the same binding.
    caches = make_caches(model, fp8=False)
    model.bind_kv_caches(caches)
    for attn, (cache,) in zip(layers, caches):
        attn.bind_kv_cache(cache.pages, cache.group)
    assert torch.equal(teacher_forced(model, None), want)


def test_the_engine_serves_a_full_attention_model_with_fp8_pages(tmp_path) -> None:
    """--kv-cache-dtype fp8 through the engine (tiny Qwen3-MoE, torch backend on CPU): the pages
    and scales are allocated and bound, and greedy tokens mostly follow the exact cache."""
    from tandem import LLM, SamplingParams

    save_tiny_model(tmp_path, "qwen3_moe", seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(10, 60)), list(range(200, 237))]
    exact = [o.token_ids for o in LLM(str(tmp_path), device="cpu", kv_cache_memory="16MiB").generate(prompts, params)]
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    cache = llm.engine.kv_caches[0][0]
    assert cache.pages.dtype == torch.float8_e4m3fn and cache.scales is not None
    assert all(a.kv_scales is cache_of[0].scales for a, cache_of in zip(llm.engine.model.attention_layers(),
                                                                       llm.engine.kv_caches))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(g[:3] == e[:3] for g, e in zip(got, exact))
