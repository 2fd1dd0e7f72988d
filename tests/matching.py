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


def approx_floats(obj: Any, abs_tol: float = LOGPROB_ATOL) -> Any:
    """`obj` with every float (at any depth of lists, tuples and dicts) replaced by `pytest.approx`."""
    if isinstance(obj, float):
        return pytest.approx(obj, rel=0, abs=abs_tol)
    if isinstance(obj, dict):
        return {k: approx_floats(v, abs_tol) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(approx_floats(v, abs_tol) for v in obj)
    return obj
