"""DeepSeek-V4 served by the engine on its paged cache groups (sliding window, CSA with its indexer,
HCA), against transformers' `generate` on tiny random checkpoints saved with `save_pretrained`
(DeepSeek's own tensor names), fp32 on CPU: batched greedy generation with chunked prefill not
aligned to the ratios, prefix-cache hits (which restore CSA's overlap from a snapshot), n-gram
speculation with rollback, preemption, and `tandem serve` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")
from safetensors.torch import load_file, save_file
from test_deepseek_v4 import BASE, CASES, _randomize
from tiny_models import tokenizer_vocab_size, write_tokenizer_files
from transformers import DeepseekV4Config
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4

from tandem import LLM, SamplingParams
from tandem.models.deepseek_v4 import checkpoint_name

N = 24
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def save_v4(out_dir: Path, case: str, **overrides) -> HFDeepseekV4:
    torch.manual_seed(0)
    hf = HFDeepseekV4(DeepseekV4Config(**{**BASE, **CASES[case][0], **overrides})).eval()
    _randomize(hf, seed=len(case))
    hf.save_pretrained(out_dir)
    write_tokenizer_files(out_dir)
    return hf


@pytest.fixture(scope="module", params=["all_kinds", "hash"])
def v4(request, tmp_path_factory) -> tuple[Path, HFDeepseekV4]:
    d = tmp_path_factory.mktemp(request.param)
    return d, save_v4(d, request.param)


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def reference(hf: HFDeepseekV4, prompt: list[int], n: int = N) -> list[int]:
    # The explicit mask matters: generate() would take token 0 (its pad id) in a prompt for padding.
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_batch_with_chunked_prefill_matches_transformers(v4) -> None:
    """Four requests at once, prompts prefilled in 11-token chunks (not aligned to the ratios 4, 8
    / 16, the window 6 / 10 or the blocks) while the others decode."""
    model_dir, hf = v4
    ps = prompts((5, 37, 70, 18))
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=11)
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == reference(hf, p), len(p)
    eng = llm.engine
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and all(p.num_free == p.num_slots for p in eng.kv.state_pools if p)


def test_logits_through_the_paged_caches_match_transformers(v4) -> None:
    """Prefill and every decode step's logits (the engine's logprobs) against transformers' own
    cache-free forward of the whole sequence, within 1e-4."""
    model_dir, hf = v4
    p = prompts((41,), seed=6)[0]
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=9)
    out = llm.generate([p], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p + out.token_ids[:-1]]), use_cache=False).logits[0, len(p) - 1:], -1)
    for i, lp in enumerate(out.logprobs):
        for alt in lp.top:
            assert abs(alt.logprob - ref[i, alt.token_id].item()) < 1e-4, (i, alt)


def test_real_ratios_cross_the_128_boundary(tmp_path) -> None:
    """V4's own ratios (4 and 128) and window (128): a 133-token prompt and decode past 256 close
    two HCA windows, in 50-token chunks."""
    hf = save_v4(tmp_path, "real_ratios", max_position_embeddings=320)
    ps = prompts((133, 90), seed=7)
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=50)
    params = SamplingParams(max_tokens=130, temperature=0.0, ignore_eos=True)
    for p, o in zip(ps, llm.generate(ps, params)):
        assert o.token_ids == reference(hf, p, 130)


def test_prefix_hits_reuse_whole_units_and_stay_exact(v4) -> None:
    """Requests sharing a 150-token prefix: the second and later reuse 128 tokens (a multiple of the
    prefix unit, where every group's blocks and compressed windows end: 64 or 128 tokens with
    8-token blocks) and CSA's overlap comes back from its snapshot into a state slot another
    request used before."""
    model_dir, hf = v4
    shared = prompts((150,), seed=1)[0]
    # The last prompt leaves one token after its hit: that step takes the decode path, which
    # restores the snapshot on the device; the others restore it in the prefill path.
    ps = [shared + tail for tail in prompts((10, 7, 12), seed=2)] + [shared[:128] + [7]]
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="8MiB", block_size=8)
    assert llm.engine.kv.unit in (64, 128)
    first = llm.generate(ps[:1], GREEDY)[0]
    rest = llm.generate(ps[1:3], GREEDY)
    # Alone, after the others: its state slot's ring last held another request's later tokens.
    rest += llm.generate(ps[3:], GREEDY)
    assert first.num_cached_tokens == 0 and [o.num_cached_tokens for o in rest] == [128, 128, 128]
    for p, o in zip(ps, [first, *rest]):
        assert o.token_ids == reference(hf, p)


def test_ngram_speculation_with_rollback_equals_plain_greedy(v4) -> None:
    model_dir, _ = v4
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() * 4 for n in (7, 5, 11)]
    want = [o.token_ids for o in LLM(str(model_dir), device="cpu", kv_cache_memory="8MiB").generate(ps, GREEDY)]
    spec = LLM(str(model_dir), device="cpu", kv_cache_memory="8MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.token_ids for o in spec.generate(ps, GREEDY)] == want
    drafted = accepted = 0.0
    for metric in spec.engine.metrics.registry.collect():
        for s in metric.samples:
            drafted += s.value if s.name == "tandem:spec_decode_num_draft_tokens_total" else 0
            accepted += s.value if s.name == "tandem:spec_decode_num_accepted_tokens_total" else 0
    assert 0 < accepted < drafted  # drafts were accepted, and some rejected (rolled back)


def test_preemption_recompute_stays_exact(tmp_path) -> None:
    hf = save_v4(tmp_path, "all_kinds")
    ps = prompts((60, 75, 50, 66), seed=4)
    # A budget for about 230 tokens of context: the four need about 340, so the scheduler must preempt.
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory=160 * 1024, max_model_len=120, max_num_seqs=4,
              enable_prefix_caching=False)
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.token_ids == reference(hf, p)


def test_fp8_pages_stay_close_to_the_exact_cache(tmp_path) -> None:
    """--kv-cache-dtype fp8: window K=V, entries and index keys stored as e4m3 with a scale each
    (the state ring stays fp32); the logits move, a little."""
    save_v4(tmp_path, "all_kinds")
    p = prompts((45,), seed=8)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=20)
    exact = LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB").generate([p], params)[0]
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB", kv_cache_dtype="fp8")
    caches = llm.engine.kv_caches
    assert caches[1][0].pages.dtype == torch.float8_e4m3fn and caches[1][1].index_scales is not None
    assert caches[1][1].state["compressor"].dtype == torch.float32
    fp8 = llm.generate([p], params)[0]
    # Decode steps read the prompt's pages back: compare their logprobs while the tokens agree.
    gaps = []
    for i, (a, b) in enumerate(zip(exact.logprobs, fp8.logprobs)):
        want = {t.token_id: t.logprob for t in a.top}
        gaps += [abs(t.logprob - want[t.token_id]) for t in b.top if t.token_id in want]
        if exact.token_ids[i] != fp8.token_ids[i]:
            break
    # Near-ties move (this random model's distributions are flat), a broken cache moves them all.
    assert fp8.token_ids[:5] == exact.token_ids[:5]
    assert 1e-4 < max(gaps) < 0.6, max(gaps)


def test_native_tensor_names_load_the_same_model(tmp_path) -> None:
    """DeepSeek's native spelling (no `model.` prefix, `embed`, `hc_head_fn`, ...) and the one
    save_pretrained writes name the same parameters."""
    saved = tmp_path / "saved"
    save_v4(saved, "hash")
    native = tmp_path / "native"
    native.mkdir()
    for f in saved.iterdir():
        if f.suffix != ".safetensors":
            (native / f.name).write_bytes(f.read_bytes())
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    tensors = load_file(saved / "model.safetensors")
    renamed = {top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
    assert {checkpoint_name(k) for k in renamed} == {checkpoint_name(k) for k in tensors}
    save_file(renamed, native / "model.safetensors")
    p = prompts((30,), seed=5)
    a = LLM(str(saved), device="cpu", kv_cache_memory="8MiB").generate(p, GREEDY)[0].token_ids
    b = LLM(str(native), device="cpu", kv_cache_memory="8MiB").generate(p, GREEDY)[0].token_ids
    assert a == b


def test_what_it_cannot_run_is_refused_in_one_line(tmp_path) -> None:
    save_v4(tmp_path, "hash")
    with pytest.raises(ValueError, match="num_speculative_tokens 5: .* rolls back at most 4 tokens"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB",
            speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match="'dspark' reads the target's hidden states"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB",
            speculative_config={"method": "dspark", "model": str(tmp_path)})
    with pytest.raises(ValueError, match="--attention-backend triton: DeepSeek-V4's Triton attention runs on CUDA"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB", attention_backend="triton")



def test_grouped_moe_executor_clamps_and_gives_the_reference_tokens(tmp_path) -> None:
    """The fused executor (sort + grouped GEMMs; on CPU in fp32) with V4's SwiGLU clamp."""
    hf = save_v4(tmp_path, "hash")
    ps = prompts((21, 40), seed=9)
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB", moe_backend="grouped")
    assert all(b.executor.limit == BASE["swiglu_limit"] for b in llm.engine.model.moe_blocks().values())
    for p, o in zip(ps, llm.generate(ps, GREEDY)):
        assert o.token_ids == reference(hf, p)


@pytest.mark.timeout(180)
def test_tandem_serve_streams_a_v4_checkpoint(tmp_path) -> None:
    from serve_proc import start_serve

    vocab = tokenizer_vocab_size()
    save_v4(tmp_path, "all_kinds", vocab_size=vocab + -vocab % 64)
    proc, url = start_serve(str(tmp_path), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
                            "--max-model-len", "256", "--log-level", "warning")
    try:
        body = {"model": tmp_path.name, "prompt": "The compressed cache", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert whole["usage"]["completion_tokens"] == 12, whole
        text, usage = "", None
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
        assert text == whole["choices"][0]["text"] and usage["completion_tokens"] == 12
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}).json()
        assert chat["usage"]["completion_tokens"] <= 5 and chat["choices"][0]["message"]["role"] == "assistant"
        bad = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["message"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "tandem:generation_tokens_total" in metrics
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_triton_attention_gives_the_reference_tokens(tmp_path) -> None:
    """fp32 on the GPU: decode and verify steps through the Triton kernel against transformers."""
    hf = save_v4(tmp_path, "all_kinds")
    ps = prompts((5, 37, 70, 18))
    for backend in ("triton", "torch"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_memory="64MiB", attention_backend=backend,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        assert llm.engine.model._kernel == (backend == "triton")
        for p, o in zip(ps, llm.generate(ps, GREEDY)):
            assert o.token_ids == reference(hf, p), (backend, len(p))


def test_a_v4_checkpoint_is_planned_from_its_tensors(tmp_path) -> None:
    from tandem.offload.planner import plan_memory

    save_v4(tmp_path, "all_kinds")
    plan = plan_memory(tmp_path, torch.float32, "cpu", max_model_len=128)
    assert plan.fits and not plan.from_config_only and plan.kv_groups
    # Every tensor of the checkpoint (the routers' bias buffers too), in fp32.
    assert sum(plan.weights.values()) == sum(t.numel() * 4 for t in HFDeepseekV4.from_pretrained(tmp_path).state_dict().values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("handoff", ["hostfunc", "poll"])
def test_on_cuda_captured_decode_graphs_give_the_reference_tokens(tmp_path, handoff) -> None:
    """V4's decode and verify steps captured and replayed (fp32, Triton attention; the torch MoE
    executor is not capturable, so every expert is on the CPU), the tokens against transformers.
    With the doorbell (poll) the shared expert runs on the GPU between the request and the wait."""
    hf = save_v4(tmp_path, "all_kinds")
    ps = prompts((5, 37, 70, 18))
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_memory="64MiB", attention_backend="triton",
              cpu_moe=True, cpu_moe_handoff=handoff, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.engine.runner.graphs, "no graph was captured"
    assert (llm.engine.model.cpu_experts.doorbell is not None) == (handoff == "poll")
    for p, o in zip(ps, llm.generate(ps, GREEDY)):
        assert o.token_ids == reference(hf, p), len(p)
    eager = llm.engine.metrics.model_steps.labels(model_name=llm.engine.model_name, mode="eager")._value.get()
    assert eager == 0


def test_an_fp8_native_checkpoint_is_refused_by_name(tmp_path) -> None:
    from tandem.models.loader import CheckpointError

    save_v4(tmp_path, "hash")
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(k for k in tensors if k.endswith("attn.wq_a.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor {name} is F8_E4M3: FP8 / FP4 weights"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode_and_verify_steps_read_nothing_back_to_the_host(tmp_path, kv_cache_dtype) -> None:
    """What a CUDA graph needs of the decode path, checked without a GPU: its forward runs under
    FakeTensorMode, which refuses any host read of a value (.item(), .tolist(), torch.equal, a
    tensor's truth); the prefill path, which does read some, is refused there. The MoE executor
    is swapped for a stand-in (the torch one syncs by design; the grouped one is checked on CUDA)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from tandem.core import Request
    from tandem.engine.scheduler import ScheduledRequest

    save_v4(tmp_path, "all_kinds")
    eng = LLM(str(tmp_path), device="cpu", kv_cache_memory="8MiB", kv_cache_dtype=kv_cache_dtype).engine
    for block in eng.model.moe_blocks().values():
        block.set_executor(lambda hidden, ids, w: hidden * w.sum(-1, keepdim=True))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts((30, 41), seed=12))]
    for r in reqs:  # prompts in the cache, last token left to decode
        assert eng.kv.allocate_slots(r, r.num_tokens - 1)
        eng.runner.execute([ScheduledRequest.of(r, r.num_tokens - 1)])
        r.num_computed_tokens = r.num_tokens - 1
        assert eng.kv.allocate_slots(r, 3)
    for batch in ([ScheduledRequest.of(r, 1) for r in reqs], [ScheduledRequest.of(r, 1, (5, 6)) for r in reqs]):
        ids, pos, step = eng.runner.build_step(batch)
        with FakeTensorMode(allow_non_fake_inputs=True):
            assert eng.model(ids, pos, step).shape == (len(ids), BASE["hidden_size"])
    prefill = Request("p", prompts((20,), seed=13)[0], SamplingParams(max_tokens=1))
    assert eng.kv.allocate_slots(prefill, 19)
    ids, pos, step = eng.runner.build_step([ScheduledRequest.of(prefill, 19)])
    with pytest.raises(DataDependentOutputException), FakeTensorMode(allow_non_fake_inputs=True):
        eng.model(ids, pos, step)
