"""Prometheus metrics of one server, in a per-app ``CollectorRegistry`` (several servers may share a process).

Per-request figures (latencies, token counts, exit depths, final status) are
recorded by the HTTP layer from the ``RequestOutput``s it streams, through a
:class:`RequestTracker` per engine request; per-step figures come from the
engine thread's step listener; gauges read the engine snapshot at scrape time.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from loopline.entrypoints.async_llm import AsyncLLM, StepRecord
from loopline.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

#: Values of the ``status`` label of ``loopline:requests_total``.
STATUSES = ("stop", "length", "abort", "error", "rejected")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric the server exports (names prefixed ``loopline:``)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        labels = {"model_name": model_name}
        num_loops = async_llm.engine.config.num_loops

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=reg).labels(**labels)

        requests = counter("loopline:requests", "Requests by final status: stop / length / abort (finished engine "
                           "requests), error (rejected as invalid, 4xx), rejected (over the concurrency limit, 429)",
                           ("status",))
        self.requests = {s: requests.labels(status=s, **labels) for s in STATUSES}
        self.prompt_tokens = counter("loopline:prompt_tokens", "Prompt tokens of accepted requests").labels(**labels)
        self.generation_tokens = counter("loopline:generation_tokens", "Generated tokens").labels(**labels)
        self.ttft = histogram("loopline:time_to_first_token_seconds", "Time from arrival to the first token", _LATENCY_BUCKETS)
        self.itl = histogram("loopline:inter_token_latency_seconds", "Time between consecutive output tokens", _LATENCY_BUCKETS)
        self.e2e = histogram("loopline:e2e_request_latency_seconds", "Time from arrival to the last token", _LATENCY_BUCKETS)
        self.exit_depth = histogram("loopline:exit_depth", "Loop at which each generated token exited",
                                    tuple(range(1, num_loops + 1)))
        self.steps = counter("loopline:engine_steps", "Engine steps that ran at least one row").labels(**labels)
        self.rows = counter("loopline:engine_rows", "Rows run (a row: one decode token or prefill chunk at one loop)").labels(**labels)
        self.rows_per_step = histogram("loopline:rows_per_step", "Rows batched together in one engine step", _ROW_BUCKETS)

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, ["model_name"], registry=reg).labels(**labels).set_function(read)

        snap = lambda: async_llm.snapshot  # noqa: E731
        gauge("loopline:num_requests_running", "Sequences running (decode slots or prefill)", lambda: snap().num_running)
        gauge("loopline:num_requests_waiting", "Sequences waiting for admission", lambda: snap().num_waiting)
        gauge("loopline:kv_cache_used_blocks", "KV blocks in use (all planes)", lambda: snap().kv_used_blocks)
        gauge("loopline:kv_cache_total_blocks", "KV blocks in the pool", lambda: snap().kv_total_blocks)
        gauge("loopline:kv_cache_usage_perc", "Fraction of KV blocks in use",
              lambda: snap().kv_used_blocks / snap().kv_total_blocks if snap().kv_total_blocks else 0.0)
        # Counters owned by the engine, exported as gauges of their running totals.
        gauge("loopline:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
              lambda: snap().prefix_cache_queries)
        gauge("loopline:prefix_cache_hits_total", "Prompt tokens served from the prefix cache",
              lambda: snap().prefix_cache_hits)
        gauge("loopline:num_preemptions_total", "Requests preempted (snapshotted to CPU memory)",
              lambda: snap().num_preemptions)
        self.in_flight = Gauge("loopline:http_requests_in_flight", "Generation HTTP requests being served",
                               ["model_name"], registry=reg).labels(**labels)
        async_llm.add_step_listener(self._on_step)

    def _on_step(self, rec: StepRecord) -> None:  # engine thread; prometheus_client is thread-safe
        self.steps.inc()
        self.rows.inc(rec.rows)
        self.rows_per_step.observe(rec.rows)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one engine request's outputs: TTFT, inter-token gaps, tokens, exit depths, final status."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self.last_token_time: float | None = None
        self.first_token_latency: float | None = None
        self.seen: list[int] = []  # tokens already counted per completion
        self.done = False
        self.status: str | None = None

    def accepted(self, prompt_tokens: int) -> None:
        self.m.prompt_tokens.inc(prompt_tokens)

    def observe(self, out: RequestOutput) -> None:
        if self.done:
            return
        now = time.monotonic()
        if len(self.seen) < len(out.outputs):
            self.seen += [0] * (len(out.outputs) - len(self.seen))
        new = 0
        for comp in out.outputs:
            k = self.seen[comp.index]
            for d in comp.exit_depths[k:]:
                self.m.exit_depth.observe(d)
            new += len(comp.token_ids) - k
            self.seen[comp.index] = len(comp.token_ids)
        if new:
            self.m.generation_tokens.inc(new)
            if self.last_token_time is None:
                self.first_token_latency = now - self.start
                self.m.ttft.observe(self.first_token_latency)
            else:
                gap = (now - self.last_token_time) / new
                for _ in range(new):
                    self.m.itl.observe(gap)
            self.last_token_time = now
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs]
            self.finish("abort" if "abort" in reasons else "length" if "length" in reasons else "stop")

    def finish(self, status: str) -> None:
        """Records the final status once (later calls are ignored)."""
        if self.done:
            return
        self.done = True
        self.status = status
        self.m.requests[status].inc()
        if status != "abort":
            self.m.e2e.observe(time.monotonic() - self.start)
