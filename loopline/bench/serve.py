"""``loopline bench serve``: drives a running OpenAI-compatible server over HTTP.

Each request is ``POST {base_url}/v1/completions`` with ``prompt`` as token ids,
``stream=true``, ``max_tokens`` = the request's output length, ``ignore_eos=true``,
greedy. Arrivals are Poisson at ``request_rate`` requests/s (``inf``: all at t = 0);
with ``concurrency`` at most that many requests are in flight (closed loop when the
rate is ``inf``), like ``vllm bench serve --max-concurrency``.

A run is one or more **phases** over the same request set: ``initial`` and, with
replay, ``replay`` -- the same prompts sent again at once after the first phase has
drained, with the same arrival gaps, so the second phase shows what the server's
prefix cache does for repeated prompts. Around each phase the server's ``/metrics``
are read for the prefix-cache counters (summed over every series, so a data-parallel
front end's per-replica series count too).

A streamed chunk that carries tokens is one arrival for TTFT/ITL. Tokens per
chunk: the length of loopline's ``exit_depths`` extension (or ``token_ids``)
when present, else 1 per non-empty ``text``; the server's
``usage.completion_tokens`` wins when it sends usage. With ``exit_depths``
(loopline servers) the record also has the mean loops per token.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loopline.bench.metrics import RequestTiming, latency_metrics
from loopline.bench.workload import Workload, request_seed

PHASES = ("initial", "replay")

#: Server counters read before and after each phase (Prometheus names without ``_total``).
PREFIX_CACHE_COUNTERS = {"queries": "loopline:prefix_cache_queries", "hits": "loopline:prefix_cache_hits"}


@dataclass(frozen=True)
class ServeSpec:
    base_url: str
    request_rate: float = math.inf
    concurrency: int | None = None
    model: str | None = None
    seed: int = 0  # arrival gaps
    timeout_s: float = 600.0
    # every request's sampling fields (vLLM's bench serve flags; None: the server's default); temperature 0:
    # greedy. Sampled requests are seeded by their index (request_seed), so a run draws the same tokens again.
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def sampling(self, index: int) -> dict[str, Any]:
        """The request fields of prompt ``index``'s sampling."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        if self.temperature > 0:
            fields["seed"] = request_seed(self.seed, index)
        return {k: v for k, v in fields.items() if v is not None}


def _chunk_tokens(chunk: dict[str, Any]) -> tuple[int, list[int]]:
    """(tokens in this chunk, their exit depths if the server reports them)."""
    count, depths = 0, []
    for choice in chunk.get("choices") or []:
        d = choice.get("exit_depths") or []
        depths += d
        count += len(d) or len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
    return count, depths


async def _one_request(client: Any, model: str | None, prompt: list[int], max_tokens: int,
                       sampling: dict[str, Any]) -> RequestTiming:
    payload: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                               **sampling, "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    timing = RequestTiming(submit=time.perf_counter())
    tokens, depths = 0, []
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                timing.error = f"HTTP {resp.status_code}: {body}"
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    timing.error = f"in-stream error: {chunk['error']}"
                    return timing
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                n, d = _chunk_tokens(chunk)
                if n:
                    tokens += n
                    depths += d
                    timing.on_tokens(tokens, time.perf_counter())
    except Exception as e:  # noqa: BLE001 -- a failed request is reported, the benchmark goes on
        timing.error = f"{type(e).__name__}: {e}"
        return timing
    if usage_tokens is not None and timing.token_times:
        timing.num_tokens = usage_tokens
    timing.exit_depths = depths or None
    return timing


async def _models(client: Any) -> list[dict[str, Any]]:
    try:
        resp = await client.get("/v1/models")
        return resp.json().get("data") or []
    except Exception:  # noqa: BLE001 -- the model field is optional for loopline's server
        return []


async def _resolve_model(client: Any, model: str | None) -> str | None:
    if model:
        return model
    data = await _models(client)
    return data[0]["id"] if data else None


def parse_counters(text: str, names: dict[str, str]) -> dict[str, float]:
    """Sums every sample of each counter in a Prometheus text exposition (all label sets)."""
    out = {key: 0.0 for key in names}
    found = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, rest = line.partition(" ")
        base = metric.split("{", 1)[0]
        for key, name in names.items():
            if base in (name, name + "_total"):
                try:
                    out[key] += float(rest.split()[0])
                    found.add(key)
                except (ValueError, IndexError):
                    pass
    return {k: v for k, v in out.items() if k in found}


async def _prefix_cache_counters(client: Any) -> dict[str, float] | None:
    try:
        resp = await client.get("/metrics")
        if resp.status_code != 200:
            return None
        counters = parse_counters(resp.text, PREFIX_CACHE_COUNTERS)
    except Exception:  # noqa: BLE001 -- a server without /metrics still gets benchmarked
        return None
    return counters if len(counters) == len(PREFIX_CACHE_COUNTERS) else None


def _prefix_cache_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


async def _send_all(client: Any, spec: ServeSpec, model: str | None, workload: Workload,
                    progress: Any) -> tuple[list[RequestTiming], float]:
    rng = random.Random(spec.seed)  # NOTE: re-seeded per phase, so a replay has the same arrival gaps
    limit = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None

    async def guarded(i: int) -> RequestTiming:
        request = (client, model, workload.prompts[i], workload.max_tokens(i), spec.sampling(i))
        if limit is None:
            timing = await _one_request(*request)
        else:
            async with limit:
                timing = await _one_request(*request)
        if progress is not None:
            progress(1)
        return timing

    t0 = time.perf_counter()
    tasks = []
    for i in range(workload.num_prompts):
        tasks.append(asyncio.create_task(guarded(i)))
        if math.isfinite(spec.request_rate) and i + 1 < workload.num_prompts:  # no idle gap after the last one
            await asyncio.sleep(rng.expovariate(spec.request_rate))
    timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - t0


def _phase_record(phase: str, spec: ServeSpec, model: str | None, workload: Workload, timings: list[RequestTiming],
                  duration: float, prefix_cache: dict[str, float] | None) -> dict[str, Any]:
    depths = [d for t in timings if t.error is None for d in (t.exit_depths or [])]
    errors = [t.error for t in timings if t.error]
    return {"variant": "serve", "phase": phase, "request_rate": spec.request_rate, "concurrency": spec.concurrency,
            "num_prompts": workload.num_prompts, "requested_output_tokens": workload.output_tokens, "model": model,
            **latency_metrics(timings, duration, workload.input_tokens),
            "mean_loops_per_token": sum(depths) / len(depths) if depths else None,
            "prefix_cache": prefix_cache, "errors": errors[:5]}


async def run_phases_async(spec: ServeSpec, workload: Workload, phases: tuple[str, ...] = ("initial",),
                           transport: Any = None, progress: Any = None) -> list[dict[str, Any]]:
    """Sends ``workload`` once per phase, back to back; one record per phase."""
    import httpx

    # NOTE: httpx pools at most 100 connections and keeps 20 alive by default: at concurrency 128 the
    # client itself would queue 28 requests and reconnect for most others. One kept-alive connection
    # per request in flight, as vllm bench serve's client does.
    width = spec.concurrency or workload.num_prompts
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    records = []
    async with httpx.AsyncClient(base_url=spec.base_url.rstrip("/"), timeout=spec.timeout_s, transport=transport,
                                 limits=limits) as client:
        model = await _resolve_model(client, spec.model)
        for phase in phases:
            before = await _prefix_cache_counters(client)
            timings, duration = await _send_all(client, spec, model, workload, progress)
            after = await _prefix_cache_counters(client)
            records.append(_phase_record(phase, spec, model, workload, timings, duration,
                                         _prefix_cache_delta(before, after)))
    return records


def run_phases(spec: ServeSpec, workload: Workload, phases: tuple[str, ...] = ("initial",), transport: Any = None,
               progress: Any = None) -> list[dict[str, Any]]:
    return asyncio.run(run_phases_async(spec, workload, phases, transport, progress))


def run_serve(spec: ServeSpec, workload: Workload, transport: Any = None, progress: Any = None) -> dict[str, Any]:
    """One phase: the latency/throughput record of sending every prompt of ``workload`` once."""
    return run_phases(spec, workload, ("initial",), transport, progress)[0]


def run_rates(spec: ServeSpec, rates: list[float], workload_for: Callable[[int], Workload], replay: bool = False,
              transport: Any = None, progress: Any = None) -> list[dict[str, Any]]:
    """Every rate in turn (each with its initial and, with ``replay``, replay phase).

    ``workload_for(k)`` gives rate ``k``'s request set; callers seed it with ``seed + k`` so
    a rate's initial phase never hits what an earlier rate left in the prefix cache."""
    import dataclasses

    phases = PHASES if replay else PHASES[:1]
    out = []
    for k, rate in enumerate(rates):
        out += run_phases(dataclasses.replace(spec, request_rate=rate, seed=spec.seed + k), workload_for(k), phases,
                          transport, progress)
    return out


def server_info(base_url: str, transport: Any = None, timeout_s: float = 30.0) -> tuple[str | None, int | None]:
    """(first served model id, its ``max_model_len``) from ``/v1/models``; Nones when not reported.
    Raises ``httpx.TransportError`` when nothing answers at ``base_url``."""
    import httpx

    async def fetch() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport) as client:
            try:
                resp = await client.get("/v1/models")
            except httpx.TransportError:
                raise  # nothing answers: the caller says so
            try:
                return resp.json().get("data") or []
            except Exception:  # noqa: BLE001 -- a server without /v1/models still serves; the model is optional
                return []

    data = asyncio.run(fetch())
    if not data:
        return None, None
    return data[0].get("id"), data[0].get("max_model_len")
