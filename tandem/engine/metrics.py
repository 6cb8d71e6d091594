"""Engine metrics: Prometheus collectors with vLLM's names under the `tandem:` prefix, and the
periodic stats line the engine logs while busy."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between generated tokens.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("tandem:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", labels, registry=r)
        self.prefix_queries = Counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r)
        self.prefix_hits = Counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r)
        self.preemptions = Counter("tandem:num_preemptions", "Requests preempted (to be recomputed).", labels, registry=r)
        self.model_steps = Counter("tandem:model_steps", "Forward passes, by how they ran (cuda_graph or eager).",
                                   labels + ["mode"], registry=r)
        self.success = Counter("tandem:request_success", "Finished requests.", labels + ["finished_reason"], registry=r)
        self.model_name = model_name

    def label(self, metric):  # noqa: ANN001, ANN201 - prometheus types
        return metric.labels(model_name=self.model_name)


@dataclass
class StatsWindow:
    """Token counts since the last stats line."""

    start: float
    prefix_queries_at_start: int = 0
    prefix_hits_at_start: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def line(self, running: int, waiting: int, kv_usage: float, prefix_queries: int, prefix_hits: int) -> str:
        dt = max(time.monotonic() - self.start, 1e-9)
        queries = prefix_queries - self.prefix_queries_at_start
        hit = 100.0 * (prefix_hits - self.prefix_hits_at_start) / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {self.prompt_tokens / dt:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / dt:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100.0 * kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%"
        )
