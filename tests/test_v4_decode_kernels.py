"""DeepSeek-V4's decode path with its Triton kernels wired in (the attention, the indexer's
scores, the mHC and the compressors' entries, with prefix caching the overlap snapshot's write and
restore), against the same path in torch, through the engine: greedy tokens equal. Without CUDA the
kernels run in Triton's interpreter on CPU tensors (the kernels' own tests are in
test_v4_attention_kernel.py, test_v4_indexer_kernel.py, test_v4_mhc_kernel.py and
test_v4_compress_kernel.py)."""

from __future__ import annotations

import pytest
from triton_interp import interpret_without_cuda, interpreted_module, kernel_test_setup  # noqa: F401 (autouse)

interpret_without_cuda()  # before anything imports Triton

pytest.importorskip("transformers.models.deepseek_v4")
from test_deepseek_v4_engine import prompts, save_v4  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    attention = interpreted_module("tandem.kernels.deepseek_v4_attention", "_v4_attention_kernel", language=True)
    indexer = interpreted_module("tandem.kernels.deepseek_v4_indexer", "_indexer_scores_kernel", language=True)
    mhc = interpreted_module("tandem.kernels.deepseek_v4_mhc", "_hc_pre_kernel", language=True)
    compress = interpreted_module("tandem.kernels.deepseek_v4_compress", "_pool_kernel", language=True)
    yield next(attention), next(indexer), next(mhc), next(compress)
    for gen in (compress, mhc, indexer, attention):
        gen.close()


def test_decode_steps_through_the_kernels_give_the_torch_tokens(kernels, tmp_path, monkeypatch) -> None:
    save_v4(tmp_path, "all_kinds")
    ps = prompts((9, 30), seed=11)
    kw = dict(device="cpu", kv_cache_memory="8MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # the interpreter is slow
    want = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(ps, params)]
    llm = LLM(str(tmp_path), **kw)
    llm.engine.model._kernel = True  # what --attention-backend triton sets on CUDA
    calls = []
    names = ("deepseek_v4_paged_attention", "deepseek_v4_indexer_scores", "deepseek_v4_hc_pre", "deepseek_v4_hc_merge",
             "deepseek_v4_compress_entries")
    for mod, name in zip((*kernels[:3], kernels[2], kernels[3]), names):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, fn=fn, name=name, **k: (calls.append(name), fn(*a, **k))[1])
    got = [o.token_ids for o in llm.generate(ps, params)]
    assert set(names) <= set(calls)
    assert got == want


def test_prefix_hits_through_the_kernels_give_the_torch_tokens(kernels, tmp_path, monkeypatch) -> None:
    """With prefix caching: a decode step crossing a prefix boundary writes the overlap snapshot in
    `_pool_kernel`, and a later request hitting that prefix with one token left restores it in its
    decode step (`deepseek_v4_snapshot_restore`). The snapshots are scrambled before the first request and
    every state ring before the hit, so the hit's tokens hold only if the kernels wrote and
    restored the snapshot: the torch path's."""
    import torch

    save_v4(tmp_path, "all_kinds")
    first = prompts((120,), seed=12)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # decodes past 128
    kw = {"device": "cpu", "kv_cache_memory": "8MiB", "block_size": 8}

    def scramble(llm: LLM, what: str, g: torch.Generator) -> None:
        for layer in llm.engine.kv_caches:
            for cache in layer:
                for t in getattr(cache, what).values():
                    t.copy_(torch.randn(t.shape, generator=g) * 10)

    def run(llm: LLM) -> list[list[int]]:
        g = torch.Generator().manual_seed(0)
        scramble(llm, "snapshots", g)  # a snapshot the step does not write stays garbage
        a = llm.generate([first], params)[0]
        scramble(llm, "state", g)  # nothing a hit needs is left in the rings but the snapshots
        hit = llm.generate([first + a.token_ids[:8] + [7]], params)[0]
        assert a.num_cached_tokens == 0 and hit.num_cached_tokens == 128
        return [a.token_ids, hit.token_ids]

    want = run(LLM(str(tmp_path), **kw))
    llm = LLM(str(tmp_path), **kw)
    assert llm.engine.kv.unit in (64, 128)
    llm.engine.model._kernel = True
    compress, seen = kernels[3], {"restored": 0, "snapshots": 0}
    restore, entries = compress.deepseek_v4_snapshot_restore, compress.deepseek_v4_compress_entries

    def spy_restore(rings, snapshots, slots, restore_ids, *a):
        seen["restored"] += int((restore_ids >= 0).sum())
        return restore(rings, snapshots, slots, restore_ids, *a)

    def spy_entries(*a, snapshots=None, **k):
        seen["snapshots"] += snapshots is not None
        return entries(*a, snapshots=snapshots, **k)

    monkeypatch.setattr(compress, "deepseek_v4_snapshot_restore", spy_restore)
    monkeypatch.setattr(compress, "deepseek_v4_compress_entries", spy_entries)
    assert run(llm) == want
    assert seen["restored"] >= 1 and seen["snapshots"] > 0
