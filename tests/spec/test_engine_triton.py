"""Speculative rounds on the Triton backends (attention, layer kernels, decode-state kernels) equal plain
decoding on the torch backend: the GPU path's kernels see draft rows (one query through the work list) and
verify rows (K+1 queries, frozen positions on scratch, exit copies between verify loops), and the
pipeline's lane rows and its step after sampling. On the CPU this
runs in Triton's interpreter (``slow``); on a GPU in seconds."""
from __future__ import annotations

import pytest
import torch
from engine_testing import assert_same_tokens_depths_logprobs, run_arrivals, small_gqa_model, tokens_depths_logprobs
from triton_testing import DEVICE  # before any loopline kernel module

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroForCausalLM
from loopline.sampling_params import SamplingParams


def generate(model: OuroForCausalLM, backend: str, speculative: dict | None, backends=None) -> dict:
    engine = LLMEngine(EngineArgs(device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=3,
                                  num_kv_blocks=120, block_size=8, max_num_batched_tokens=40, max_model_len=200,
                                  attention_backend=backend, kernel_backend=backend, speculative_config=speculative),
                       model=model, backends=backends)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.7, logprobs=0)
    # chunked prompts next to speculating rows
    requests = {f"r{i}": ([(i * 31 + j) % 250 for j in range(n)], params) for i, n in enumerate([5, 50, 21])}
    out = tokens_depths_logprobs(run_arrivals(engine, requests))
    assert speculative is None or engine.stats.spec_num_drafts > 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [
    {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False},
    # the pipeline's drafting lanes, draft store and step after sampling are TritonSlotOps kernels here
    {"method": "loop", "scheme": "pipeline", "draft_loops": 1, "adaptive": False, "disable_by_batch_size": None},
], ids=["draft_verify", "pipeline"])
def test_speculation_on_triton_kernels_equals_plain_torch_decoding(speculative):
    model = small_gqa_model(DEVICE)
    want = generate(model, "torch", None)
    from loopline.worker.backends import select_backends

    got = generate(model, "triton", speculative, select_backends("triton", "triton", torch.device(DEVICE)))
    assert_same_tokens_depths_logprobs(got, want)
    assert min(d for _, ds, _ in want.values() for d in ds) < model.config.total_ut_steps  # exit copies ran
