"""Structured outputs on a CUDA device (the bitmask unpacked and applied on the GPU, CUDA graphs, the
overlapped engine): every kind's outputs match, batched with an unconstrained request that stays exactly
as when run alone. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.structured.test_structured_outputs import KINDS, check_kind_batched_with_a_free_request, make_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engine():
    return make_engine(device="cuda", dtype="float32")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_output_matches_on_the_gpu(engine, kind):
    check_kind_batched_with_a_free_request(engine, kind)
