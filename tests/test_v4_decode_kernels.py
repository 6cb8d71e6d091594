"""DeepSeek-V4's decode path with its Triton kernels wired in (the attention, the indexer's
scores, the mHC and the compressors' entries), against the same path in torch, through the engine: greedy tokens equal. Without CUDA the
kernels run in Triton's interpreter on CPU tensors (the kernels' own tests are in
test_v4_attention_kernel.py, test_v4_indexer_kernel.py, test_v4_mhc_kernel.py and
test_v4_compress_kernel.py)."""

from __future__ import annotations

import pytest
from triton_interp import interpret_without_cuda, interpreted_module, kernel_test_setup  # noqa: F401 (autouse)

interpret_without_cuda()  # before anything imports Triton

pytest.importorskip("transformers.models.deepseek_v4")
from test_deepseek_v4_engine import GREEDY, prompts, save_v4  # noqa: E402

from tandem import LLM  # noqa: E402


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
    want = [o.token_ids for o in LLM(str(tmp_path), **kw).generate(ps, GREEDY)]
    llm = LLM(str(tmp_path), **kw)
    llm.engine.model._kernel = True  # what --attention-backend triton sets on CUDA
    calls = []
    names = ("deepseek_v4_paged_attention", "deepseek_v4_indexer_scores", "deepseek_v4_hc_pre", "deepseek_v4_hc_merge",
             "deepseek_v4_compress_entries")
    for mod, name in zip((*kernels[:3], kernels[2], kernels[3]), names):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, fn=fn, name=name, **k: (calls.append(name), fn(*a, **k))[1])
    got = [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert set(names) <= set(calls)
    assert got == want
