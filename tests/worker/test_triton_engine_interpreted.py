"""The engine on the Triton attention backend equals the torch backend, on the CPU interpreter.

Covers what the GPU tests check on CUDA, where CI has none: rotary fused into the K/V store,
the predicated exit-copy kernel (early exits under ``last_exited``), steps that mix decode
rows with prompt chunks (attention over a work list), decode-only steps through the fused decode
attention kernel (rotary, K/V store and attention in one launch), and the fused layer kernels, including
the one-row GEMV with the coda skipped for a row whose token does not exit (the last request
decodes alone), and the fused decode-state kernels (rows from the device state, exit rule, advance).

``slow``: ~5 minutes in the interpreter on 2 CPU cores; each kernel also has a short test of its own
in the default run (tests/kernels, tests/attention). Run it with ``pytest -m slow``.
"""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, fused_decode_for_every_split_count, spy_on_kernel, triton_backends

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroConfig, OuroForCausalLM
from loopline.sampling_params import SamplingParams


def generate(model: OuroForCausalLM, backend: str, backends=None) -> dict:
    engine = LLMEngine(EngineArgs(device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
                                  num_kv_blocks=200, block_size=8, max_num_batched_tokens=48, max_model_len=300,
                                  attention_backend=backend, kernel_backend=backend, enforce_eager=True), model=model,
                       backends=backends)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.7, logprobs=0)
    for i, n in enumerate([5, 70, 33, 90]):  # a 48-token budget: chunked prompts next to decoding rows
        engine.add_request(f"r{i}", [(i * 31 + j) % 250 for j in range(n)], params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, c.exit_depths, torch.tensor(c.token_logprobs))
    return out


@pytest.mark.slow
def test_triton_backend_engine_equals_torch_backend():
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = OuroForCausalLM(cfg).to(DEVICE)
    want = generate(model, "torch")
    assert len(want) == 4
    launches = []  # decode-only steps through the fused decode kernel (by default small GPU batches take it)
    with spy_on_kernel("decode_attention_kernel", launches):
        got = generate(model, "triton", triton_backends(fused_decode_for_every_split_count()))
    assert launches
    assert got.keys() == want.keys()
    for rid, (tokens, depths, logprobs) in want.items():
        assert got[rid][:2] == (tokens, depths), rid
        # logprobs see any K/V a token reads, e.g. deeper planes an exit copy should have filled
        torch.testing.assert_close(got[rid][2], logprobs, atol=1e-4, rtol=1e-4)
    depths = [d for _, ds, _ in want.values() for d in ds]
    assert min(depths) < cfg.total_ut_steps  # some tokens exit early, so the exit copy ran
