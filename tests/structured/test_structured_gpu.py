"""Structured outputs on a CUDA device (the bitmask unpacked and applied on the GPU, CUDA graphs, the
overlapped engine): every kind's outputs match, batched with an unconstrained request that stays exactly
as when run alone. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.structured.test_structured_outputs import FREE, KINDS, PROMPTS, assert_matches, constrained, drain, make_engine, result

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engine():
    return make_engine(device="cuda", dtype="float32")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_output_matches_on_the_gpu(engine, kind):
    greedy, check = constrained(kind, temperature=0.0, n=2)
    sampled, _ = constrained(kind, temperature=1.0, seed=3, n=2)
    reqs = {f"g{i}": (p, greedy) for i, p in enumerate(PROMPTS[:2])}
    reqs |= {f"s{i}": (p, sampled) for i, p in enumerate(PROMPTS)}
    reqs |= {"free": ("def f(x):\n", FREE)}
    out = drain(engine, reqs)
    unbounded = (KINDS[kind][0], engine) if kind == "json_object" else ()
    assert_matches([o for rid, o in out.items() if rid != "free"], check, *unbounded)
    alone = drain(engine, {"free": ("def f(x):\n", FREE)})
    assert result(out["free"]) == result(alone["free"])
