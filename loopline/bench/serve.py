"""``loopline bench serve``: drives a running OpenAI-compatible server over HTTP.

Each request is ``POST {base_url}/v1/completions`` with ``prompt`` as token ids,
``stream=true``, ``max_tokens=output_len``, ``ignore_eos=true``, greedy. Arrivals
are Poisson at ``request_rate`` requests/s (``inf``: all at t = 0); with
``concurrency`` at most that many requests are in flight (closed loop when the
rate is ``inf``), like ``vllm bench serve --max-concurrency``.

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
from dataclasses import dataclass
from typing import Any

from loopline.bench.metrics import RequestTiming, latency_metrics
from loopline.bench.workload import Workload


@dataclass(frozen=True)
class ServeSpec:
    base_url: str
    output_len: int
    request_rate: float = math.inf
    concurrency: int | None = None
    model: str | None = None
    seed: int = 0
    timeout_s: float = 600.0


def _chunk_tokens(chunk: dict[str, Any]) -> tuple[int, list[int]]:
    """(tokens in this chunk, their exit depths if the server reports them)."""
    count, depths = 0, []
    for choice in chunk.get("choices") or []:
        d = choice.get("exit_depths") or []
        depths += d
        count += len(d) or len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
    return count, depths


async def _one_request(client: Any, spec: ServeSpec, model: str | None, prompt: list[int]) -> RequestTiming:
    payload: dict[str, Any] = {"prompt": prompt, "max_tokens": spec.output_len, "stream": True, "ignore_eos": True,
                               "temperature": 0.0, "stream_options": {"include_usage": True}}
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


async def _resolve_model(client: Any, model: str | None) -> str | None:
    if model:
        return model
    try:
        resp = await client.get("/v1/models")
        data = resp.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001 -- the model field is optional for loopline's server
        return None


async def run_serve_async(spec: ServeSpec, workload: Workload, transport: Any = None,
                          progress: Any = None) -> dict[str, Any]:
    """Sends every prompt of ``workload``; returns the latency/throughput record."""
    import httpx

    rng = random.Random(spec.seed)
    limit = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    # NOTE: httpx pools at most 100 connections and keeps 20 alive by default: at concurrency 128 the
    # client itself would queue 28 requests and reconnect for most others. One kept-alive connection
    # per request in flight, as vllm bench serve's client does.
    width = spec.concurrency or len(workload.prompts)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(base_url=spec.base_url.rstrip("/"), timeout=spec.timeout_s, transport=transport,
                                 limits=limits) as client:
        model = await _resolve_model(client, spec.model)

        async def guarded(prompt: list[int]) -> RequestTiming:
            if limit is None:
                timing = await _one_request(client, spec, model, prompt)
            else:
                async with limit:
                    timing = await _one_request(client, spec, model, prompt)
            if progress is not None:
                progress(1)
            return timing

        t0 = time.perf_counter()
        tasks = []
        for prompt in workload.prompts:
            tasks.append(asyncio.create_task(guarded(prompt)))
            if math.isfinite(spec.request_rate):
                await asyncio.sleep(rng.expovariate(spec.request_rate))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    depths = [d for t in timings if t.error is None for d in (t.exit_depths or [])]
    record = {"variant": "serve", "model": model, **latency_metrics(list(timings), duration, workload.input_tokens),
              "mean_loops_per_token": sum(depths) / len(depths) if depths else None}
    errors = [t.error for t in timings if t.error]
    record["errors"] = errors[:5]
    return record


def run_serve(spec: ServeSpec, workload: Workload, transport: Any = None, progress: Any = None) -> dict[str, Any]:
    return asyncio.run(run_serve_async(spec, workload, transport, progress))
