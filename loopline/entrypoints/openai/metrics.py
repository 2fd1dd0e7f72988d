"""Prometheus metrics of one server, in a per-app ``CollectorRegistry`` (several servers may share a process).

Per-request figures (latencies, token counts, exit depths, final status) are
recorded by the HTTP layer from every output delta of its requests (streamed or
not: ``OutputStream(on_delta=...)``), through a :class:`RequestTracker` per engine request; per-step figures come from the
engine client's step listener; gauges and the engine's own running totals are
read from the engine snapshot at scrape time. Engine-side series (gauges, engine
totals, step series, ``loopline:replica_healthy``) carry a ``replica`` label: one
series per data-parallel replica ("0" for a single engine) or per prefill/decode
worker ("prefill-0", "decode-0", ...); the per-request series are measured by the
front end and have none.

Names are vLLM's with the ``loopline:`` prefix where vLLM has the series
(``vllm:time_to_first_token_seconds`` is ``loopline:time_to_first_token_seconds``);
docs/serving.md lists them side by side, and docs/grafana-loopline.json charts them.
The series vLLM's dashboards read are also served under vLLM's own names (``vllm:``
prefix, vLLM's ``engine`` label instead of ``replica`` on engine-side series), always:
a vLLM dashboard or autoscaler works unchanged. Where the two differ in meaning the
``vllm:`` series follows vLLM (``vllm:iteration_tokens_total``: a generated token
once, when sampled; a prompt's tokens once, when its prefill finishes; the
``loopline:`` one counts a token per loop row).
"""
from __future__ import annotations

import time

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from loopline.entrypoints.async_llm import AsyncLLM, EngineSnapshot, ReplicaState, StepRecord
from loopline.engine.deltas import OutputDelta
from loopline.outputs import RequestMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: ``finished_reason`` values of ``loopline:request_success_total`` (vLLM's label and values).
FINISHED_REASONS = ("stop", "length", "abort")

#: Values of the ``status`` label of ``loopline:requests_total``.
STATUSES = ("stop", "length", "abort", "error", "rejected")

CONTENT_TYPE = CONTENT_TYPE_LATEST

_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)


class _Both:
    """One measurement recorded in several series (a ``loopline:`` one and its ``vllm:`` twin)."""

    __slots__ = ("series",)

    def __init__(self, *series) -> None:
        self.series = series

    def inc(self, amount: float = 1) -> None:
        for m in self.series:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self.series:
            m.observe(value)


class ServerMetrics:
    """Every metric the server exports (names prefixed ``loopline:``)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        labels = {"model_name": model_name}
        num_loops = async_llm.config.num_loops

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=reg)

        def one_histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple) -> _Both:
            """``name`` (``loopline:...``) and its ``vllm:`` twin."""
            return _Both(one_histogram(name, doc, buckets), one_histogram(_vllm(name), doc, buckets))

        requests = counter("loopline:requests", "Requests by final status: stop / length / abort (finished engine "
                           "requests), error (rejected as invalid, 4xx), rejected (over the concurrency limit, 429)",
                           ("status",))
        self.requests = {s: requests.labels(status=s, **labels) for s in STATUSES}
        self.prompt_tokens = _Both(*(counter(n, "Prompt tokens of accepted requests").labels(**labels)
                                     for n in ("loopline:prompt_tokens", "vllm:prompt_tokens")))
        self.generation_tokens = _Both(*(counter(n, "Generated tokens").labels(**labels)
                                         for n in ("loopline:generation_tokens", "vllm:generation_tokens")))
        self.ttft = histogram("loopline:time_to_first_token_seconds", "Time from arrival to the first token", _LATENCY_BUCKETS)
        self.itl = histogram("loopline:inter_token_latency_seconds", "Time between consecutive output tokens", _LATENCY_BUCKETS)
        self.e2e = histogram("loopline:e2e_request_latency_seconds", "Time from arrival to the last token", _LATENCY_BUCKETS)
        self.exit_depth = one_histogram("loopline:exit_depth", "Loop at which each generated token exited",
                                    tuple(range(1, num_loops + 1)))
        # Engine-side series carry a ``replica`` label (vLLM's ``engine``): "0" without data parallelism.
        replicas = [r.name for r in async_llm.replicas()]

        def per_replica(metric) -> list:
            return [metric.labels(replica=r, **labels) for r in replicas]

        self.steps = per_replica(counter("loopline:engine_steps", "Engine steps that ran at least one row", ("replica",)))
        self.rows = per_replica(counter("loopline:engine_rows", "Rows run (a row: one decode token or prefill chunk at "
                                        "one loop)", ("replica",)))
        self.rows_per_step = per_replica(Histogram("loopline:rows_per_step", "Rows batched together in one engine step",
                                                   ["model_name", "replica"], buckets=_ROW_BUCKETS, registry=reg))
        self.iteration_tokens = per_replica(Histogram(
            "loopline:iteration_tokens_total", "Tokens scheduled in one engine step (decode rows + prefill chunk tokens)",
            ["model_name", "replica"], buckets=_ITERATION_BUCKETS, registry=reg))
        success = [counter(n, "Finished engine requests by finished_reason", ("finished_reason",))
                   for n in ("loopline:request_success", "vllm:request_success")]
        self.request_success = {r: _Both(*(f.labels(finished_reason=r, **labels) for f in success))
                                for r in FINISHED_REASONS}
        self.params_n = one_histogram("vllm:request_params_n", "The n request parameter", _PARAMS_N_BUCKETS)
        self.params_max_tokens = one_histogram("vllm:request_params_max_tokens", "The max_tokens request parameter "
                                               "(the effective one)", _TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram("loopline:request_prompt_tokens", "Prompt tokens per finished request",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("loopline:request_generation_tokens",
                                                   "Generated tokens per finished request (all n completions)", _TOKEN_BUCKETS)
        self.request_num_preemptions = histogram("loopline:request_num_preemptions",
                                                 "Preemptions per finished request", _PREEMPTION_BUCKETS)
        self.tpot = histogram("loopline:request_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (generated tokens - 1)", _LATENCY_BUCKETS)
        # From the engine's RequestMetrics (first_scheduled_time, first/last token time): only
        # observed when the engine records when a request was first scheduled.
        self.queue_time = histogram("loopline:request_queue_time_seconds", "Time from arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("loopline:request_prefill_time_seconds",
                                      "Time from first scheduled to the first token", _LATENCY_BUCKETS)
        self.decode_time = histogram("loopline:request_decode_time_seconds", "Time from the first to the last token",
                                     _LATENCY_BUCKETS)
        self.inference_time = histogram("loopline:request_inference_time_seconds",
                                        "Time from first scheduled to the last token", _LATENCY_BUCKETS)

        def gauge(name: str, doc: str, read: Callable[[ReplicaState], float], vllm: bool = False) -> None:
            for name, label in ((name, "replica"), (_vllm(name), "engine"))[:2 if vllm else 1]:
                family = Gauge(name, doc, ["model_name", label], registry=reg)
                for i, r in enumerate(replicas):
                    family.labels(model_name, r).set_function(lambda i=i: read(async_llm.replicas()[i]))

        gauge("loopline:num_requests_running", "Sequences running (decode slots or prefill)",
              lambda r: r.snapshot.num_running, vllm=True)
        gauge("loopline:num_requests_waiting", "Sequences waiting for admission", lambda r: r.snapshot.num_waiting,
              vllm=True)
        # vLLM splits the waiting requests by reason; every loopline waiting request waits for capacity
        # (a slot or KV pages): "deferred" is always 0
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Requests waiting, by why: capacity (a slot or KV "
                          "pages) or deferred (never in loopline)", ["model_name", "engine", "reason"], registry=reg)
        for i, r in enumerate(replicas):
            by_reason.labels(model_name, r, "capacity").set_function(
                lambda i=i: async_llm.replicas()[i].snapshot.num_waiting)
            by_reason.labels(model_name, r, "deferred").set(0)
        gauge("loopline:kv_cache_used_blocks", "KV blocks in use (all planes)", lambda r: r.snapshot.kv_used_blocks)
        gauge("loopline:kv_cache_total_blocks", "KV blocks in the pool", lambda r: r.snapshot.kv_total_blocks)
        gauge("loopline:kv_cache_usage_perc", "Fraction of KV blocks in use", lambda r: r.snapshot.kv_used_blocks
              / r.snapshot.kv_total_blocks if r.snapshot.kv_total_blocks else 0.0, vllm=True)
        cfg, info = async_llm.config, async_llm.info
        cache_info = Gauge("vllm:cache_config_info", "The KV cache configuration (value 1; the labels say it)",
                           ["model_name", "engine", "block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching"],
                           registry=reg)
        for r in replicas:
            cache_info.labels(model_name, r, str(cfg.block_size), str(cfg.args.kv_cache_dtype), str(info.kv_pages),
                              str(bool(cfg.args.enable_prefix_caching))).set(1)
        vllm_iteration = Histogram(  # one family, a child per replica
            "vllm:iteration_tokens_total", "Tokens per engine step: each generated token once, when sampled; each "
            "prompt's tokens once, when its prefill finishes", ["model_name", "engine"], buckets=_ITERATION_BUCKETS,
            registry=reg)
        self.vllm_iteration_tokens = [vllm_iteration.labels(model_name, r) for r in replicas]
        gauge("loopline:replica_healthy", "1 while the engine replica serves, 0 once it stopped (the health route "
              "says why)", lambda r: float(r.problem is None))
        # Running totals the engine keeps: exported as counters read at scrape time.
        reg.register(_EngineTotals(model_name, async_llm.replicas, {
            "loopline:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", lambda s: s.prefix_cache_queries),
            "loopline:prefix_cache_hits": ("Prompt tokens served from the prefix cache", lambda s: s.prefix_cache_hits),
            "loopline:num_preemptions": ("Requests preempted (snapshotted to CPU memory)", lambda s: s.num_preemptions),
        }))
        reg.register(_EngineTotals(model_name, async_llm.replicas, {
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", lambda s: s.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prompt tokens served from the prefix cache", lambda s: s.prefix_cache_hits),
            "vllm:num_preemptions": ("Requests preempted (snapshotted to CPU memory)", lambda s: s.num_preemptions),
        }, label="engine"))
        if cfg.args.speculative_config is not None:  # as vLLM: the series exist when speculation is configured
            reg.register(_EngineTotals(model_name, async_llm.replicas, {
                "vllm:spec_decode_num_drafts": ("Speculative rounds (loop self-speculation)",
                                                lambda s: s.spec_num_drafts),
                "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed", lambda s: s.spec_num_draft_tokens),
                "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted",
                                                         lambda s: s.spec_num_accepted_tokens),
            }, label="engine"))
            reg.register(_AcceptedPerPosition(model_name, async_llm.replicas))
        self.in_flight = Gauge("loopline:http_requests_in_flight", "Generation HTTP requests being served",
                               ["model_name"], registry=reg).labels(**labels)
        async_llm.add_step_listener(self._on_step)

    def _on_step(self, rec: StepRecord) -> None:  # the engine client's thread; prometheus_client is thread-safe
        r = rec.replica
        self.steps[r].inc()
        self.rows[r].inc(rec.rows)
        self.rows_per_step[r].observe(rec.rows)
        self.iteration_tokens[r].observe(rec.scheduled_tokens)
        if rec.iteration_tokens:
            self.vllm_iteration_tokens[r].observe(rec.iteration_tokens)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one engine request's deltas: TTFT, inter-token gaps, tokens, exit depths, final status."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self.last_token_time: float | None = None
        self.first_token_latency: float | None = None
        self.seen: dict[int, int] = {}  # tokens counted per completion
        self.reasons: dict[int, str] = {}  # finish reason per completion
        self.done = False
        self.status: str | None = None
        self.prompt_tokens = 0
        self.timing: RequestMetrics | None = None  # the engine's, as of the latest delta

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.m.prompt_tokens.inc(prompt_tokens)

    def observe(self, delta: OutputDelta) -> None:
        """One delta of the request (what its changed completions added)."""
        if self.done:
            return
        if delta.head is not None:
            params = delta.head[2]
            self.m.params_n.observe(params.n)
            if params.max_tokens is not None:
                self.m.params_max_tokens.observe(params.max_tokens)
        now = time.monotonic()
        new = 0
        for comp in delta.outputs:
            for d in comp.exit_depths:
                self.m.exit_depth.observe(d)
            new += len(comp.token_ids)
            self.seen[comp.index] = self.seen.get(comp.index, 0) + len(comp.token_ids)
            if comp.finish_reason is not None:
                self.reasons[comp.index] = comp.finish_reason
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
        self.timing = delta.metrics
        if delta.finished:
            reasons = list(self.reasons.values())
            self.finish("abort" if "abort" in reasons else "length" if "length" in reasons else "stop")

    def finish(self, status: str) -> None:
        """Records the final status once (later calls are ignored)."""
        if self.done:
            return
        self.done = True
        self.status = status
        self.m.requests[status].inc()
        self.m.request_success[status].inc()
        if status == "abort":
            return
        m, now = self.m, time.monotonic()
        m.e2e.observe(now - self.start)
        generated = sum(self.seen.values())
        m.request_prompt_tokens.observe(self.prompt_tokens)
        m.request_generation_tokens.observe(generated)
        if generated > 1 and self.first_token_latency is not None and self.last_token_time is not None:
            first = self.start + self.first_token_latency
            m.tpot.observe((self.last_token_time - first) / (generated - 1))
        timing = self.timing
        m.request_num_preemptions.observe(timing.num_preemptions if timing is not None else 0)
        if timing is not None and timing.first_scheduled_time is not None:
            t = timing
            m.queue_time.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.first_token_time is not None:
                m.prefill_time.observe(max(0.0, t.first_token_time - t.first_scheduled_time))
            if t.first_token_time is not None and t.last_token_time is not None:
                m.decode_time.observe(max(0.0, t.last_token_time - t.first_token_time))
                m.inference_time.observe(max(0.0, t.last_token_time - t.first_scheduled_time))


class _EngineTotals(Collector):
    """Counters whose values each engine replica keeps (read at scrape time): ``name -> (help, read)``."""

    def __init__(self, model_name: str, replicas: Callable[[], list[ReplicaState]],
                 totals: dict[str, tuple[str, Callable[[EngineSnapshot], float]]], label: str = "replica") -> None:
        self.model_name = model_name
        self.label = label
        self.replicas = replicas
        self.totals = totals

    def collect(self) -> Iterator[CounterMetricFamily]:
        replicas = self.replicas()
        for name, (doc, read) in self.totals.items():
            family = CounterMetricFamily(name, doc, labels=["model_name", self.label])
            for r in replicas:
                family.add_metric([self.model_name, r.name], read(r.snapshot))
            yield family


class _AcceptedPerPosition(Collector):
    """``vllm:spec_decode_num_accepted_tokens_per_pos``: accepted drafts by their position in the round (the
    rounds that accepted exactly ``j`` drafts are position ``j-1``'s count minus position ``j``'s)."""

    def __init__(self, model_name: str, replicas: Callable[[], list[ReplicaState]]) -> None:
        self.model_name, self.replicas = model_name, replicas

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the round",
                                     labels=["model_name", "engine", "position"])
        for r in self.replicas():
            for pos, count in enumerate(r.snapshot.spec_accepted_per_pos):
                family.add_metric([self.model_name, r.name, str(pos)], count)
        yield family


def _vllm(name: str) -> str:
    """vLLM's name of a ``loopline:`` series."""
    return "vllm:" + name.removeprefix("loopline:")
