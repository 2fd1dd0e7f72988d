"""Compare engine outputs exactly where they are discrete and with a tolerance where they are floats.

Rounding both sides to a few decimals is not a tolerance: two values 1e-7 apart on either side of a
rounding boundary compare unequal. `approx_floats` wraps every float in a nested structure in
`pytest.approx`, so `approx_floats(a) == b` compares tokens, depths and text exactly and each float
within `abs_tol`.
"""
from __future__ import annotations

from typing import Any

import pytest

# A logprob from a different batch composition moves in its last float32 bits (~1e-6 at |lp| ~ 10).
LOGPROB_ATOL = 1e-4
# Not for FP8 KV caches: float noise of 1e-7 in a K/V before its store can round it to the neighbouring E4M3
# value, 1/16 away, and every layer after it sees that difference (a logprob moves by ~1e-3).
FP8_LOGPROB_ATOL = 1e-2


def approx_floats(obj: Any, abs_tol: float = LOGPROB_ATOL) -> Any:
    """`obj` with every float (at any depth of lists, tuples and dicts) replaced by `pytest.approx`."""
    if isinstance(obj, float):
        return pytest.approx(obj, rel=0, abs=abs_tol)
    if isinstance(obj, dict):
        return {k: approx_floats(v, abs_tol) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(approx_floats(v, abs_tol) for v in obj)
    return obj


def closer_to_fp8(got: list[float], fp8: list[float], full: list[float], rid: str) -> None:
    """Logprobs of an engine with an FP8 KV cache: within FP8's own error of the oracle storing FP8, and 3x
    closer to it than to the oracle without FP8 (so a cache that stores no FP8 fails)."""
    near = sum(abs(a - b) for a, b in zip(got, fp8))
    assert got == pytest.approx(fp8, abs=FP8_LOGPROB_ATOL), rid
    assert 3 * near < sum(abs(a - b) for a, b in zip(got, full)), rid
