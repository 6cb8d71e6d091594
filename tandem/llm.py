"""Offline use: `tandem.LLM(model_dir).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from tandem.config import (
    CacheConfig, EngineConfig, ModelConfig, OffloadConfig, RunnerConfig, SchedulerConfig, SpecConfig, parse_size,
    resolve_device, resolve_dtype,
)
from tandem.core import SamplingParams, TokenLogprobs
from tandem.engine.engine import LLMEngine


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": what went wrong


class LLM:
    """Generate for a list of prompts (strings or token-id lists) with continuous batching."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        kv_cache_memory: str | int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        enforce_eager: bool = False,
        attention_backend: str = "auto",
        moe_backend: str = "auto",
        fused_ops: bool = True,
        max_k: int = 0,
        cpu_threads: int | None = None,
        speculative_config: str | dict[str, Any] | None = None,
        cpu_moe: bool = False,
        n_cpu_moe: int | None = None,
        gpu_resident_moe_layers: str | tuple[int, ...] | None = None,
        cpu_moe_threads: int | None = None,
        cpu_moe_dtype: str = "auto",
        cpu_moe_act_dtype: str = "auto",
        cpu_moe_handoff: str = OffloadConfig.cpu_moe_handoff,
        hot_experts: str | None = None,
        hot_expert_memory: str | int | None = None,
        stream_experts: str = "auto",
        stream_experts_min_tokens: int | None = None,
        stream_experts_memory: str | int | None = None,
        async_scheduling: bool | None = None,
        prefill_graph_max_tokens: int = RunnerConfig.prefill_graph_max_tokens,
    ) -> None:
        """Keyword arguments as `tandem serve`'s flags; `speculative_config` is the
        `--speculative-config` JSON (or its dict), e.g. {"method": "ngram", "num_speculative_tokens": 3}.
        `max_k` alone only sizes the CUDA graphs' query lengths (no speculation)."""
        dev = resolve_device(device)
        config = EngineConfig(
            model=ModelConfig(model, resolve_dtype(dtype, dev), dev, max_model_len, seed=seed),
            cache=CacheConfig(block_size, gpu_memory_utilization,
                              parse_size(kv_cache_memory) if kv_cache_memory is not None else None,
                              enable_prefix_caching, kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, async_scheduling=async_scheduling),
            spec=SpecConfig.parse(speculative_config, max_k),
            runner=RunnerConfig(attention_backend, moe_backend, enforce_eager, fused_ops, cpu_threads,
                                prefill_graph_max_tokens),
            offload=OffloadConfig(cpu_moe, n_cpu_moe, OffloadConfig.parse_layers(gpu_resident_moe_layers)
                                  if isinstance(gpu_resident_moe_layers, str) else gpu_resident_moe_layers,
                                  cpu_moe_threads, cpu_moe_dtype, cpu_moe_act_dtype=cpu_moe_act_dtype,
                                  cpu_moe_handoff=cpu_moe_handoff, hot_experts=hot_experts,
                                  hot_expert_memory=parse_size(hot_expert_memory) if hot_expert_memory is not None
                                  else None, stream_experts=stream_experts,
                                  stream_experts_min_tokens=stream_experts_min_tokens,
                                  stream_experts_memory=parse_size(stream_experts_memory)
                                  if stream_experts_memory is not None else None),
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        # Every prompt is validated before any is queued: a bad one leaves nothing behind.
        requests = []
        for prompt, p in zip(prompts, per_prompt):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            requests.append(self.engine.new_request(f"offline-{next(self._ids)}", ids, p))
        results = {r.request_id: Completion(list(r.prompt_token_ids)) for r in requests}
        order = list(results)
        for r in requests:
            self.engine.add(r)
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="Generating")
        while self.engine.has_unfinished:
            for out in self.engine.step():
                c = results[out.request_id]
                c.token_ids.extend(out.new_token_ids)
                c.text += out.new_text
                c.num_cached_tokens = out.num_cached_tokens
                if out.logprobs:
                    c.logprobs.extend(out.logprobs)
                if out.finished:
                    c.finish_reason, c.error = out.finish_reason, out.error
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
             **template_kwargs: Any) -> Completion:
        """Render `messages` with the checkpoint's chat template (kwargs such as enable_thinking go
        to the template) and generate the assistant's reply."""
        return self.generate([self.chat_prompt(messages, **template_kwargs)], sampling_params)[0]

    def chat_prompt(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """The token ids of `messages` rendered with the checkpoint's chat template;
        ChatTemplateError (a ValueError) when the tokenizer has none."""
        from tandem.server.chat_template import ChatTemplate, ChatTemplateError

        tok = self.tokenizer
        if tok.chat_template is None:
            raise ChatTemplateError(f"{tok.model_dir}: the tokenizer has no chat template")
        return tok.encode(ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(messages,
                                                                                            kwargs=template_kwargs))
