"""The engine on the Triton attention backend equals the torch backend, on the CPU interpreter.

Covers what the GPU tests check on CUDA, where CI has none: rotary fused into the K/V store,
the predicated exit-copy kernel (early exits under ``last_exited``), steps that mix decode
rows with prompt chunks (attention over a work list), decode-only steps through the fused decode
attention kernel (rotary, K/V store and attention in one launch), and the fused layer kernels, including
the one-row GEMV with the coda skipped for a row whose token does not exit (the last request
decodes alone), and the fused decode-state kernels (rows from the device state, exit rule, advance).

``slow``: ~5 minutes in the interpreter on 2 CPU cores; each kernel also has a short test of its own
in the default run (tests/kernels, tests/attention). Run it with ``pytest -m slow``. The CUDA-core decode
kernel's engine test (an MHA model, torch layer kernels, ~25 s) runs by default for its first form.
"""
from __future__ import annotations

import pytest
from engine_testing import assert_same_tokens_depths_logprobs, run_arrivals, small_gqa_model, tokens_depths_logprobs
from triton_testing import DEVICE, fused_decode_for_every_split_count, spy_on_kernel, triton_backends

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroForCausalLM
from loopline.sampling_params import SamplingParams


def generate(model: OuroForCausalLM, backend: str, backends=None) -> dict:
    engine = LLMEngine(EngineArgs(device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
                                  num_kv_blocks=200, block_size=8, max_num_batched_tokens=48, max_model_len=300,
                                  attention_backend=backend, kernel_backend=backend, enforce_eager=True), model=model,
                       backends=backends)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.7, logprobs=0)
    # a 48-token budget: chunked prompts next to decoding rows
    requests = {f"r{i}": ([(i * 31 + j) % 250 for j in range(n)], params) for i, n in enumerate([5, 70, 33, 90])}
    return tokens_depths_logprobs(run_arrivals(engine, requests))


@pytest.mark.slow
def test_triton_backend_engine_equals_torch_backend():
    model = small_gqa_model(DEVICE)
    want = generate(model, "torch")
    assert len(want) == 4
    launches = []  # decode-only steps through the fused decode kernel (by default small GPU batches take it)
    with spy_on_kernel("decode_attention_kernel", launches):
        got = generate(model, "triton", triton_backends(fused_decode_for_every_split_count()))
    assert launches
    assert_same_tokens_depths_logprobs(got, want)
    depths = [d for _, ds, _ in want.values() for d in ds]
    assert min(depths) < model.config.total_ut_steps  # some tokens exit early, so the exit copy ran


@pytest.mark.parametrize("kind", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["one-softmax", "per-lane"])
def test_cuda_core_decode_engine_equals_torch_backend(kind):
    """An MHA model (Ouro's shape of attention) served with DecodeLaunch(cuda_cores=1 or 2): decode rows of
    every step, mixed ones included, through mha_decode_kernel; tokens, exit depths and logprobs equal the torch
    backend's (fp32). Layer kernels stay torch's, so form 1 (the FP8 rule's) runs in the default suite (~25 s);
    form 2, tested kernel by kernel in tests/attention, runs with ``-m slow``."""
    import dataclasses

    import torch

    from loopline.attention.triton_backend import DecodeLaunch, TritonAttentionBackend
    from loopline.models.ouro import OuroConfig
    from loopline.worker.backends import select_backends

    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    model = OuroForCausalLM(cfg).to(DEVICE)
    want = generate(model, "torch")
    attention = TritonAttentionBackend(decode_launch=DecodeLaunch(cuda_cores=kind))
    backends = dataclasses.replace(select_backends("torch", "torch", torch.device(DEVICE)), attention=attention)
    launches = []
    with spy_on_kernel("mha_decode_kernel", launches):
        got = generate(model, "torch", backends)
    assert launches
    assert_same_tokens_depths_logprobs(got, want)
