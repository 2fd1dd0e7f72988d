"""Peak capacity: the highest request rate a server configuration holds within a TTFT bound.

A rate *holds* when every request completed and the run's TTFT statistic (``p99`` by
default, pooled over requests) is at or under the bound. :func:`find_capacity` steps
through rates in increasing order and stops at the first that does not hold (a higher
rate only queues more); ``refine`` bisects between the last rate that held and the first
that did not. Runs go through a callable, so the search is tested without a server.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from loopline.errors import InvalidRequestError

STATS = ("p50", "p99", "mean")


@dataclass(frozen=True)
class TTFTBound:
    """``stat`` of TTFT (milliseconds, pooled over a run's requests) must be <= ``ms``."""

    ms: float
    stat: str = "p99"

    def __post_init__(self) -> None:
        if not (self.ms > 0 and math.isfinite(self.ms)):
            raise InvalidRequestError(f"ttft_bound_ms must be a finite number > 0, got {self.ms}",
                                      param="ttft_bound_ms")
        if self.stat not in STATS:
            raise InvalidRequestError(f"ttft_bound_stat must be one of {', '.join(STATS)}, got {self.stat!r}",
                                      param="ttft_bound_stat")

    def holds(self, run: dict[str, Any]) -> bool:
        value = (run.get("ttft_ms") or {}).get(self.stat)
        return run.get("failed", 0) == 0 and run.get("completed", 0) > 0 and value is not None and value <= self.ms

    def describe(self) -> str:
        return f"{self.stat} TTFT <= {self.ms:g} ms, no failed requests"


def check_rates(rates: list[float], param: str = "capacity_rates") -> list[float]:
    """Finite, positive, distinct rates in increasing order."""
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise InvalidRequestError(f"{param} must be finite request rates > 0, got {rates}", param=param)
    if len(set(rates)) != len(rates):
        raise InvalidRequestError(f"{param} must be distinct, got {rates}", param=param)
    return sorted(rates)


def find_capacity(run_at: Callable[[float, int], dict[str, Any]], rates: list[float], bound: TTFTBound,
                  refine: int = 0) -> dict[str, Any]:
    """Steps ``rates`` upwards with ``run_at(rate, step_index)`` until one does not hold.

    Returns ``{"bound", "capacity_rps", "first_failing_rps", "lower_bound_only", "steps"}``:
    ``capacity_rps`` is the highest rate that held (None when even the lowest did not);
    ``lower_bound_only`` is true when every rate held (the capacity is at least the highest
    rate tried). ``steps`` has one entry per run, in the order they ran.
    """
    if refine < 0:
        raise InvalidRequestError(f"capacity_refine must be >= 0, got {refine}", param="capacity_refine")
    rates = check_rates(rates)
    steps: list[dict[str, Any]] = []

    def step(rate: float) -> bool:
        run = run_at(rate, len(steps))
        ok = bound.holds(run)
        steps.append({"request_rate": rate, "holds": ok, "ttft_ms": run.get("ttft_ms"), "failed": run.get("failed"),
                      "completed": run.get("completed"), "output_throughput": run.get("output_throughput"),
                      "request_throughput": run.get("request_throughput")})
        return ok

    held, failing = None, None
    for rate in rates:
        if step(rate):
            held = rate
        else:
            failing = rate
            break
    if held is not None and failing is not None:
        lo, hi = held, failing
        for _ in range(refine):
            mid = (lo + hi) / 2
            if step(mid):
                lo = mid
            else:
                hi = mid
        held, failing = lo, hi
    return {"bound": {**asdict(bound), "text": bound.describe()}, "capacity_rps": held, "first_failing_rps": failing,
            "lower_bound_only": failing is None, "steps": steps}
