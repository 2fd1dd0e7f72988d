"""Huginn on the Triton attention backend (#46) equals the torch backend, on the CPU interpreter (the GPU when
there is one): the fused rotary + K/V store, the work-list attention of prompt chunks beside decode rows, the
fused decode kernel, each of Huginn's three KV stages (prelude, core, coda planes) and the exit copy of
convergence exits. Huginn's interleaved RoPE is applied before the backend, which gets the identity rotation.

``slow``: the interpreter runs the kernels of 8 layers per loop. Run it with ``pytest -m slow``.
"""
from __future__ import annotations

import pytest
from engine_testing import (
    assert_same_tokens_depths_logprobs,
    run_arrivals,
    tokens_depths_logprobs,
)
from triton_testing import DEVICE, fused_decode_for_every_split_count, spy_on_kernel

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.models.ops import TORCH_OPS
from loopline.sampling_params import SamplingParams
from loopline.worker.backends import Backends
from loopline.worker.decode_state import SlotOps


def generate(path, backends=None, threshold: float = 0.5) -> dict:
    engine = LLMEngine(EngineArgs(model=str(path), device=DEVICE, dtype="float32", skip_tokenizer_init=True,
                                  max_num_seqs=2, block_size=8, max_num_batched_tokens=16, max_model_len=64,
                                  max_num_loops=5, enforce_eager=True), backends=backends)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0, max_loops=5, min_loops=1,
                            exit_threshold=threshold)
    # a 16-token budget: the 21-token prompt runs in chunks next to the other request's decode rows (at fixed
    # iterations of 3 against the prompt's 5: the two start and exit in different steps)
    short = params if threshold < 1 else params.clone(max_loops=3)
    requests = {"a": ([5, 9, 100, 3], short), "b": ([(7 * j) % 500 for j in range(21)], params)}
    return tokens_depths_logprobs(run_arrivals(engine, requests))


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0.5, 1.0], ids=["convergence", "fixed"])
def test_huginn_on_the_triton_attention_equals_torch(tmp_path, threshold):
    """(Fixed iterations: the prelude and the coda run gathered, for decode rows that start or exit and for
    prompt chunks at loop 1 or their last loop, with a work list of their own; loopline/worker/loop_stack.py.)"""
    path = make_tiny_huginn_checkpoint(tmp_path / "huginn")
    want = generate(path, threshold=threshold)
    launches = []
    with spy_on_kernel("decode_attention_kernel", launches):
        got = generate(path, Backends(fused_decode_for_every_split_count(), TORCH_OPS, SlotOps()), threshold)
    assert launches  # decode-only steps through the fused decode kernel
    assert_same_tokens_depths_logprobs(got, want)
    if threshold < 1:
        assert min(d for _, ds, _ in want.values() for d in ds) < 5  # early exits: the exit copy ran
