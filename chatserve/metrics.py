"""Prometheus metrics for one app: server-side request timings, plus engine counters read at scrape time.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `chatserve:time_to_first_token_seconds`),
and so does the `model_name` label every metric carries (the served model name). The registry is
per app, so two apps in one process (tests) never share counters.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from chatserve.sampling_params import RequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0)

# engine.stats() key -> (metric name, help). Counters are cumulative in the engine.
_ENGINE_GAUGES = {
    "num_running": ("chatserve:num_requests_running", "Requests in the running batch."),
    "num_waiting": ("chatserve:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_usage": ("chatserve:kv_cache_usage_perc", "KV-cache block usage, 0..1 (1 = full)."),
}
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("chatserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("chatserve:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("chatserve:num_preemptions", "Requests preempted (blocks freed, recomputed later)."),
    "prompt_tokens_computed": ("chatserve:prompt_tokens_computed",
                               "Prompt tokens fed to the target model (prefix-cache hits not included)."),
    "spec_num_drafts": ("chatserve:spec_decode_num_drafts", "Verification steps with at least one draft token."),
    "spec_num_draft_tokens": ("chatserve:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_num_accepted_tokens": ("chatserve:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class _EngineCollector:
    """Reads engine.stats() on each scrape; a failing engine yields no engine metrics, not a 500."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:
            return
        for key, (name, doc) in _ENGINE_GAUGES.items():
            if stats.get(key) is not None:
                yield self._one(GaugeMetricFamily(name, doc, labels=["model_name"]), stats[key])
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if stats.get(key) is not None:
                yield self._one(CounterMetricFamily(name, doc, labels=["model_name"]), stats[key])
        if stats.get("spec_accepted_by_position") is not None:
            per_position = CounterMetricFamily("chatserve:spec_decode_num_accepted_tokens_per_pos",
                                               "Accepted draft tokens by their position in the draft.",
                                               labels=["model_name", "position"])
            for position, count in enumerate(stats["spec_accepted_by_position"]):
                per_position.add_metric([self.model_name, str(position)], float(count))
            yield per_position

    def _one(self, family, value):
        family.add_metric([self.model_name], float(value))
        return family


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram("chatserve:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("chatserve:inter_token_latency_seconds",
                             "Time between output tokens (a burst of n accepted tokens counts n times gap/n).",
                             label, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("chatserve:e2e_request_latency_seconds", "Request arrival to finish.", label,
                             buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("chatserve:request_queue_time_seconds", "Time waiting before first scheduled.",
                               label, buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("chatserve:prompt_tokens", "Prompt tokens processed.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("chatserve:generation_tokens", "Tokens generated.", label,
                                         registry=r).labels(model_name)
        self.request_success = Counter("chatserve:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        r.register(_EngineCollector(engine, model_name))

    def start_request(self) -> "RequestTimer":
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Server-side clock for one request: observes latency metrics and fills in stats after a cancel."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        # The server's own view in the engine's record type (finish_time = the latest token so far),
        # so ttft_ms and tpot_ms use the engine's formulas.
        self.times = RequestStats(arrival_time=time.perf_counter())
        self.is_finished = False

    def on_delta(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now, times = time.perf_counter(), self.times
        if times.first_token_time is None:
            times.first_token_time = now
            self.metrics.ttft.observe(now - times.arrival_time)
        else:
            gap = (now - times.finish_time) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        times.finish_time = now
        times.num_generated += num_tokens

    def finish(self, finish_reason: str, prompt_tokens: int, stats: RequestStats | None) -> None:
        """Count the request once; `stats` is the engine's (None after a cancel or disconnect)."""
        if self.is_finished:
            return
        self.is_finished = True
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.times.arrival_time)
        if stats is not None and stats.queue_ms is not None:
            m.queue.observe(stats.queue_ms / 1000.0)
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(stats.num_generated if stats is not None else self.num_tokens)
        m.request_success.labels(model_name=m.model_name, finished_reason=finish_reason).inc()

    @property
    def num_tokens(self) -> int:
        return self.times.num_generated

    @property
    def ttft_ms(self) -> float | None:
        return self.times.ttft_ms

    @property
    def tpot_ms(self) -> float | None:
        return self.times.tpot_ms
