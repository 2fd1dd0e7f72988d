"""Speculative steps replayed from graph buckets on the Triton kernels (attention through its work list,
layer and decode-state kernels) equal plain decoding on the torch backend: the GPU graphs' input path
(padding rows and tokens of a bucket, draft and verify rows in one work list) on the CPU, in Triton's
interpreter (``slow``); on a GPU in seconds."""
from __future__ import annotations

import pytest
import torch
from engine_testing import assert_same_tokens_depths_logprobs, run_arrivals, small_gqa_model, tokens_depths_logprobs
from graph_testing import EagerCapturer
from triton_testing import DEVICE  # before any loopline kernel module

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroForCausalLM
from loopline.sampling_params import SamplingParams


def generate(model: OuroForCausalLM, backend: str, speculative: dict | None, backends=None) -> tuple[dict, int]:
    engine = LLMEngine(EngineArgs(device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
                                  num_kv_blocks=120, block_size=8, max_num_batched_tokens=40, max_model_len=100,
                                  attention_backend=backend, kernel_backend=backend, speculative_config=speculative,
                                  enforce_eager=True),
                       model=model, backends=backends)
    if speculative is not None:
        engine.runner.capture_graphs(100, 40, max_prefill_rows=3, capturer=EagerCapturer())
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, exit_threshold=0.7, logprobs=0)
    prompts = {"s0": 5, "s1": 11, "s2": 3, "plain": 6}  # three speculating rows pad to a 4-bucket
    requests = {rid: ([(i * 31 + j) % 250 for j in range(n)],
                      params.clone(repetition_penalty=1.1) if rid == "plain" else params)
                for i, (rid, n) in enumerate(prompts.items())}
    out = tokens_depths_logprobs(run_arrivals(engine, requests))
    graphs = engine.runner.graphs
    replays = graphs.replays["spec"] + graphs.replays["spec_draft"] if graphs is not None else 0
    return out, replays


@pytest.mark.slow
def test_speculative_graph_buckets_on_triton_kernels_equal_plain_torch_decoding():
    model = small_gqa_model(DEVICE)
    want, _ = generate(model, "torch", None)
    from loopline.worker.backends import select_backends

    got, replays = generate(model, "triton", {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 2,
                                              "draft_loops": 1, "adaptive": False},
                            select_backends("triton", "triton", torch.device(DEVICE)))
    assert replays > 10
    assert_same_tokens_depths_logprobs(got, want)
