"""Engine metrics: Prometheus collectors with vLLM's names under the `tandem:` prefix, and the
periodic stats line the engine logs while busy."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

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
        self.model_steps = Counter("tandem:model_steps", ("Forward passes, by how they ran: cuda_graph; prefill_graph (a step with "
                                   "prefill work, from a prefill graph); prefill (a step with prefill work, eager); "
                                   "eager (a decode or verify step without a graph)."),
                                   labels + ["mode"], registry=r)
        self.drafter_steps = Counter("tandem:spec_decode_drafter_steps",
                                     "Drafter forward passes, by how they ran (cuda_graph, eager, prefill_graph, prefill).",
                                     labels + ["mode"], registry=r)
        self.success = Counter("tandem:request_success", "Finished requests.", labels + ["finished_reason"], registry=r)
        self.hot_expert_hit_rate = Gauge("tandem:hot_expert_hit_rate",
                                         "Share of a layer's (token, expert) pairs its hot experts on the GPU served, "
                                         "since start (updated with the stats line).", labels + ["layer"], registry=r)
        self.expert_stream_bytes = Counter("tandem:expert_stream_bytes", "Routed-expert bytes copied over PCIe for "
                                           "streamed prefill steps (updated with the stats line).", labels, registry=r)
        self.expert_stream_seconds = Counter("tandem:expert_stream_seconds", "Seconds the copy stream spent on them, "
                                             "first copy to last of each stats window.", labels, registry=r)
        # Speculative decoding, vLLM's names; each also labelled with the request's phase.
        spec = labels + ["phase"]
        self.spec_drafts = Counter("tandem:spec_decode_num_drafts", "Drafts verified.", spec, registry=r)
        self.spec_draft_tokens = Counter("tandem:spec_decode_num_draft_tokens", "Draft tokens verified.", spec,
                                         registry=r)
        self.spec_accepted_tokens = Counter("tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec,
                                            registry=r)
        self.spec_accepted_per_pos = Counter("tandem:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft (0: first).",
                                             spec + ["position"], registry=r)
        self.spec_k = Counter("tandem:spec_decode_k", "Request-steps by chosen draft depth K and phase", spec + ["k"],
                              registry=r)
        # adaptive "auto": what the goodput controller predicted, next to what happened.
        self.spec_predicted_accepted = Counter(
            "tandem:spec_decode_predicted_accepted_tokens",
            "Draft tokens the K controller expected to be accepted (compare num_accepted_tokens).", spec, registry=r)
        self.spec_steps_timed = Counter("tandem:spec_decode_timed_steps",
                                        "Decode / verify steps the K controller predicted the time of.", labels,
                                        registry=r)
        self.spec_step_predicted = Counter("tandem:spec_decode_step_predicted_seconds",
                                           "The K controller's predicted seconds of those steps.", labels, registry=r)
        self.spec_step_measured = Counter("tandem:spec_decode_step_measured_seconds",
                                          "Measured seconds of those steps.", labels, registry=r)
        self.model_name = model_name
        self._children: dict[tuple, object] = {}  # see child
        self._labelled: dict[int, object] = {}  # see label
        self._tallies: dict[str, DraftCounts] = {}  # the drafts counted since the last flush_drafts, by phase

    def label(self, metric):  # noqa: ANN001, ANN201 - prometheus types
        """metric.labels(model_name=...), looked up once: every request of every step counts its
        tokens and latencies here."""
        found = self._labelled.get(id(metric))
        if found is None:
            found = self._labelled[id(metric)] = self.child(metric, model_name=self.model_name)
        return found

    def child(self, metric, **labels: str):  # noqa: ANN001, ANN201 - prometheus types
        """metric.labels(**labels), looked up once: a step counts a dozen labelled children, and
        each prometheus_client lookup costs microseconds of host time a small GPU step notices."""
        key = (id(metric), *labels.values())
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(**labels)
        return found

    def count_draft(self, phase: str, num_draft: int, num_accepted: int, expected: float | None = None) -> None:
        """One verified draft of `num_draft` tokens whose first `num_accepted` were accepted
        (`expected`: the accepted tokens the K controller predicted, with adaptive auto). Tallied
        until `flush_drafts`, which the engine calls once a step: a dozen counter updates per
        draft were 8 us of host time a request a step (16 requests: 0.13 ms, on the CPU machine)."""
        tally = self._tallies.get(phase)
        if tally is None:
            tally = self._tallies[phase] = DraftCounts()
        tally.add(num_draft, num_accepted, expected)

    def flush_drafts(self) -> dict[str, DraftCounts]:
        """Add the tallied drafts to the counters (one update per counter and phase); returns them
        by phase, for the stats window."""
        out, self._tallies = self._tallies, {}
        for phase, counts in out.items():
            labels = {"model_name": self.model_name, "phase": phase}
            if counts.num_predicted:
                self.child(self.spec_predicted_accepted, **labels).inc(counts.expected_accepted)
            self.child(self.spec_drafts, **labels).inc(counts.num_drafts)
            self.child(self.spec_draft_tokens, **labels).inc(counts.num_draft_tokens)
            self.child(self.spec_accepted_tokens, **labels).inc(counts.num_accepted_tokens)
            for pos, n in enumerate(counts.accepted_per_pos):
                if n:
                    self.child(self.spec_accepted_per_pos, **labels, position=str(pos)).inc(n)
        return out

    def count_k(self, phase: str, k: int, n: int = 1) -> None:
        """n request-steps that chose draft depth `k` (0: no draft) in `phase`."""
        self.child(self.spec_k, model_name=self.model_name, phase=phase, k=str(k)).inc(n)

    def count_step_time(self, predicted: float, measured: float) -> None:
        """One step whose time the K controller predicted (every step under adaptive auto)."""
        self.label(self.spec_steps_timed).inc()
        self.label(self.spec_step_predicted).inc(predicted)
        self.label(self.spec_step_measured).inc(measured)


@dataclass
class DraftCounts:
    """Verified drafts of one phase (or of all phases together)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [position]: drafts accepted there
    expected_accepted: float = 0.0  # what the K controller predicted (adaptive auto)
    num_predicted: int = 0  # drafts that had a prediction

    def add(self, num_draft: int, num_accepted: int, expected: float | None = None) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if expected is not None:
            self.expected_accepted += expected
            self.num_predicted += 1
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def merge(self, other: DraftCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.expected_accepted += other.expected_accepted
        self.num_predicted += other.num_predicted
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for pos, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[pos] += a

    @property
    def mean_acceptance_length(self) -> float:
        """1 (the target's own token) + accepted draft tokens per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_pct(self) -> float:
        return 100.0 * self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_pos(self) -> str:
        """Acceptance rate at each draft position, over all drafts (a position a short draft lacks
        counts as rejected), as vLLM prints it: '0.550, 0.300'."""
        return ", ".join(f"{a / self.num_drafts:.3f}" for a in self.accepted_per_pos)


@dataclass
class StatsWindow:
    """Token counts since the last stats line."""

    start: float
    prefix_queries_at_start: int = 0
    prefix_hits_at_start: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    drafts: dict[str, DraftCounts] = field(default_factory=dict)  # {phase: its verified drafts}
    ks: dict[str, collections.Counter[int]] = field(default_factory=dict)  # {phase: {K: request-steps that chose it}}
    timed_steps: int = 0  # steps the K controller predicted the time of (adaptive auto)
    predicted_seconds: float = 0.0
    measured_seconds: float = 0.0

    def count_draft(self, phase: str, num_draft: int, num_accepted: int, expected: float | None = None) -> None:
        """One verified draft of `num_draft` tokens, in `phase`, whose first `num_accepted` were
        accepted (`expected`: what the K controller predicted)."""
        self.drafts.setdefault(phase, DraftCounts()).add(num_draft, num_accepted, expected)

    def add_drafts(self, by_phase: dict[str, DraftCounts]) -> None:
        """Drafts already summed by phase (`EngineMetrics.flush_drafts`)."""
        for phase, counts in by_phase.items():
            self.drafts.setdefault(phase, DraftCounts()).merge(counts)

    def count_step_time(self, predicted: float, measured: float) -> None:
        self.timed_steps += 1
        self.predicted_seconds += predicted
        self.measured_seconds += measured

    def count_k(self, phase: str, k: int, n: int = 1) -> None:
        """n request-steps' chosen draft depth `k` in `phase` (0: no draft). The draft verified
        may be shorter than K (a proposer can find fewer tokens); this counts the choice."""
        self.ks.setdefault(phase, collections.Counter())[k] += n

    @property
    def total(self) -> DraftCounts:
        """The drafts of every phase together."""
        out = DraftCounts()
        for counts in self.drafts.values():
            out.merge(counts)
        return out

    def line(self, running: int, waiting: int, kv_usage: float, prefix_queries: int, prefix_hits: int) -> str:
        dt = max(time.monotonic() - self.start, 1e-9)
        queries = prefix_queries - self.prefix_queries_at_start
        hit = 100.0 * (prefix_hits - self.prefix_hits_at_start) / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {self.prompt_tokens / dt:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / dt:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100.0 * kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%"
        ) + self._spec_part(dt)

    def _spec_part(self, dt: float) -> str:
        """vLLM's `SpecDecoding metrics:` part for all phases together, then `[phase] ...` for each
        phase that had drafts and `K: phase {K: share, ...}` (shares of that phase's request-steps,
        largest first). A window that counted K but verified no draft (every K was 0) says 'no
        drafts' in place of vLLM's part. Empty when the window saw neither."""
        total = self.total
        if not total.num_drafts and not self.ks:
            return ""
        parts = [self._overall(total, dt) if total.num_drafts else "no drafts"]
        parts += [self._phase_part(phase, c) for phase, c in sorted(self.drafts.items())]
        if self.ks:
            parts.append("K: " + ", ".join(f"{phase} {_shares(ks)}" for phase, ks in sorted(self.ks.items())))
        if self.timed_steps:
            n = self.timed_steps
            parts.append(f"step ms predicted {1e3 * self.predicted_seconds / n:.2f} / measured "
                         f"{1e3 * self.measured_seconds / n:.2f} over {n} steps")
        return "; SpecDecoding metrics: " + "; ".join(parts)

    @staticmethod
    def _overall(c: DraftCounts, dt: float) -> str:
        drafted, accepted = c.num_draft_tokens, c.num_accepted_tokens
        return (
            f"Mean acceptance length: {c.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {accepted / dt:.2f} tokens/s, Drafted throughput: {drafted / dt:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: {c.per_pos}, "
            f"Avg Draft acceptance rate: {c.acceptance_pct:.1f}%"
        )

    @staticmethod
    def _phase_part(phase: str, c: DraftCounts) -> str:
        return (
            f"[{phase}] mean acceptance length {c.mean_acceptance_length:.2f}, "
            f"accepted {c.num_accepted_tokens}/{c.num_draft_tokens} "
            f"({c.acceptance_pct:.1f}%), per-position {c.per_pos}"
        ) + (f", predicted accepted {c.expected_accepted / c.num_predicted:.2f} / realised "
             f"{c.num_accepted_tokens / c.num_drafts:.2f} per draft" if c.num_predicted else "")


def _shares(ks: collections.Counter[int]) -> str:
    """'{1: 80%, 0: 20%}': each K's share of the request-steps, largest first (ties: smaller K first)."""
    n = sum(ks.values())
    return "{" + ", ".join(f"{k}: {100.0 * c / n:.0f}%" for k, c in sorted(ks.items(), key=lambda kc: (-kc[1], kc[0]))) + "}"
