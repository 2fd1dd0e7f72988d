"""Benchmark metrics: per-request latencies and the bytes-read model behind GB/s.

Latency definitions follow ``vllm bench serve`` (docs/benchmarks/README.md):

* **TTFT** -- submit (``add_request`` or HTTP send) to the first output token;
* **TPOT** -- per request, ``(last token time - first token time) / (tokens - 1)``;
* **ITL** -- every gap between consecutive token arrivals, pooled over requests;
* **E2EL** -- submit to the last token.

Offline, a token "arrives" when the ``step()`` that produced it returns, so
times have the resolution of one engine step.

Every percentile is pooled: taken over all requests' values (TTFT, TPOT, E2EL:
one value per request) or all inter-token gaps (ITL), never an average of
per-request percentiles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loopline.models.family import family_of
from loopline.models.ouro import OuroConfig


@dataclass
class RequestTiming:
    """Timestamps (``time.perf_counter`` seconds) of one request."""

    submit: float
    token_times: list[float] = field(default_factory=list)  # one per arrival (a chunk may carry several tokens)
    num_tokens: int = 0
    exit_depths: list[int] | None = None
    error: str | None = None

    def on_tokens(self, total_tokens: int, now: float) -> None:
        """Records an arrival if the request's cumulative token count grew."""
        if total_tokens > self.num_tokens:
            self.token_times.append(now)
            self.num_tokens = total_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.submit if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_tokens - 1)

    @property
    def e2el(self) -> float | None:
        return self.token_times[-1] - self.submit if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary_ms(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    return {"mean": sum(ms) / len(ms) if ms else None, "p50": percentile(ms, 50), "p99": percentile(ms, 99)}


def latency_metrics(timings: list[RequestTiming], duration_s: float, input_tokens: int) -> dict:
    """Throughput and latency percentiles (milliseconds) of one run."""
    done = [t for t in timings if t.error is None and t.num_tokens > 0]
    out_tokens = sum(t.num_tokens for t in done)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(timings) - len(done),
        "input_tokens": input_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (input_tokens + out_tokens) / duration_s if duration_s > 0 else None,
        "ttft_ms": _summary_ms([t.ttft for t in done if t.ttft is not None]),
        "tpot_ms": _summary_ms([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": _summary_ms([g for t in done for g in t.itls]),
        "e2el_ms": _summary_ms([t.e2el for t in done if t.e2el is not None]),
    }


# --- bytes read (the GB/s estimate) ------------------------------------------------------


@dataclass(frozen=True)
class ByteModel:
    """Bytes a step must read from memory, from the architecture and dtype.

    * ``body``: one traversal of the shared stack -- every decoder layer, the final
      norm and the exit gate -- read once per step whatever the number of rows;
    * ``head``: ``lm_head``, read once by a step in which at least one token exits;
    * ``kv_per_token_loop``: K and V of one position at one loop, all layers.
    The embedding (one row per started token) is left out.
    """

    body: int
    head: int
    kv_per_token_loop: int

    @classmethod
    def for_config(cls, cfg: OuroConfig, dtype: torch.dtype) -> "ByteModel":
        """The model family's reads of one loop (``Family.loop_reads``) in ``dtype``."""
        elem = torch.empty((), dtype=dtype).element_size()
        body, head, kv = family_of(cfg).loop_reads(cfg)
        return cls(body=body * elem, head=head * elem, kv_per_token_loop=kv * elem)

    def kv_read(self, prompt_len: int, exit_depths: list[int], prefill_loops: int) -> int:
        """KV bytes one request's attention reads.

        Prefill: each of ``prefill_loops`` loops reads the prompt's keys once
        (one chunk; chunked prefill re-reads earlier chunks, so this is a lower
        bound). Decode: output token ``k >= 1`` is computed at position
        ``prompt_len + k - 1`` and each of its ``exit_depths[k]`` loops reads
        ``prompt_len + k`` positions. Token 0 comes from the prefill.
        """
        decode = sum(d * (prompt_len + k) for k, d in enumerate(exit_depths) if k >= 1)
        return (prefill_loops * prompt_len + decode) * self.kv_per_token_loop

    def bytes_read(self, traversals: int, head_reads: int, kv_bytes: int) -> int:
        """``traversals * body + head_reads * head + kv_bytes``."""
        return traversals * self.body + head_reads * self.head + kv_bytes


#: Peak HBM bandwidth (GB/s, 1e9 bytes) by substring of ``torch.cuda.get_device_name()``.
#: NOTE: vendor figures; H100 is the SXM part (the PCIe card has 2,000 GB/s).
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "B200": 8000.0}


def peak_gbps(device_name: str | None) -> float | None:
    for key, value in PEAK_GBPS.items():
        if device_name and key in device_name:
            return value
    return None


def interval_union_s(intervals: list[tuple[int, int]]) -> float:
    """Total length (seconds) of a union of ``(start_ns, end_ns)`` intervals."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e9
