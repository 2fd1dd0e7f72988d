"""Ouro at fixed depth: the host counts each decode row's loops (loopline/worker/fixed_loops.py), so a step in
which no decode row exits samples nothing and reads nothing back (``OuroStack``, loopline/worker/loop_stack.py;
at one request three steps in four). Held to the independent reference (tests/reference.py) token for token
and to the same engine with the host's knowledge switched off; a rule that leaves out one exiting row fails."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_testing import assert_same_tokens_depths_logprobs, run_arrivals, tokens_depths_logprobs
from reference import reference_generate

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.worker.fixed_loops import FixedLoops


def engine(tiny, **kw) -> LLMEngine:
    kw = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True, "block_size": 4, "max_num_seqs": 4, **kw}
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw))


def requests_for(tiny, max_loops: list[int], seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {f"r{i}": ([rng.randrange(3, tiny.cfg["vocab_size"]) for _ in range(3 + 5 * i)],
                      SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, max_loops=m))
            for i, m in enumerate(max_loops)}


def count_sampling(eng: LLMEngine) -> list[int]:
    """Counts the sampler's calls (one list entry per call: the rows it sampled)."""
    calls, sampler = [], eng.runner.sampler

    class Counting:
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, tensors):
            calls.append(logits.shape[0])
            return sampler(logits, tensors)

    eng.runner.sampler = Counting()
    return calls


def assert_equal_reference(tiny, outputs: dict, requests: dict) -> None:
    for rid, (prompt, p) in requests.items():
        tokens, depths, logprobs = reference_generate(tiny.state_dict, tiny.cfg, prompt, p.max_tokens,
                                                      max_loops=p.max_loops)
        got = outputs[rid].outputs[0]
        assert (got.token_ids, got.exit_depths) == (tokens, depths), rid
        assert got.token_logprobs == pytest.approx(logprobs, abs=1e-4), rid


def test_one_request_samples_once_a_token(tiny_gqa):
    """Alone at fixed depth a request's token exits every R-th step: the sampler runs in those steps only
    (the prompt's last step samples token 0), and the tokens are the reference's."""
    eng = engine(tiny_gqa)
    calls = count_sampling(eng)
    requests = requests_for(tiny_gqa, [4])
    outputs = run_arrivals(eng, requests)
    assert_equal_reference(tiny_gqa, outputs, requests)
    assert calls == [1] * 6, calls  # six tokens, six sampling steps of one row
    assert eng.stats.steps >= 5 * 4  # (while the engine ran R steps a decode token)


def check_staggered(tiny, monkeypatch, **kw) -> object:
    """Rows at their own loops and depths (max_loops 4 / 2 / 3 / 1), chunked prompts, arrivals mid-run: the
    same tokens, depths and logprobs as the reference and as the engine that samples every step (the host's
    count switched off), in fewer sampling calls of fewer rows. Returns the counting engine."""
    requests = requests_for(tiny, [4, 2, 3, 1], seed=1)
    arrivals = {"r2": 3, "r3": 9}
    kw = {"max_num_batched_tokens": 8, **kw}
    eng = engine(tiny, **kw)
    calls = count_sampling(eng)
    outputs = run_arrivals(eng, requests, arrivals)
    assert_equal_reference(tiny, outputs, requests)
    monkeypatch.setattr(FixedLoops, "step", lambda self, dec, *_: (np.ones(len(dec), bool),) * 2)
    blind = engine(tiny, **kw)
    every = count_sampling(blind)
    assert_same_tokens_depths_logprobs(tokens_depths_logprobs(outputs),
                                       tokens_depths_logprobs(run_arrivals(blind, requests, arrivals)))
    assert len(calls) < len(every) and sum(calls) < sum(every), (len(calls), len(every))
    return eng


@pytest.mark.parametrize("overlap,mode", [(False, "refill"), (True, "refill"), (False, "no_refill")],
                         ids=["sync", "overlapped", "no_refill"])
def test_staggered_rows_match_the_reference_and_the_engine_that_knows_nothing(tiny_gqa, monkeypatch, overlap, mode):
    """:func:`check_staggered` synchronous, overlapped and in cohorts (``no_refill``: the host applies the
    device's cohort rule)."""
    check_staggered(tiny_gqa, monkeypatch, async_scheduling=overlap, scheduling_mode=mode)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap,mode", [(False, "refill"), (True, "refill"), (True, "no_refill")],
                         ids=["sync", "overlapped", "no_refill"])
def test_staggered_rows_on_the_gpu_with_graphs(tiny_gqa, monkeypatch, overlap, mode):
    """:func:`check_staggered` on a GPU, the steps replayed CUDA graphs (decode and mixed): a step where no row
    exits replays its graph and then samples nothing."""
    eng = check_staggered(tiny_gqa, monkeypatch, device="cuda", num_kv_blocks=512, attention_backend="triton",
                          async_scheduling=overlap, scheduling_mode=mode)
    assert eng.runner.graphs is not None and eng.runner.graphs.replays["decode"] > 10, eng.runner.graphs.replays


def test_a_rule_that_misses_an_exit_breaks_exactness(tiny_gqa, monkeypatch):
    """The tests above can fail: a host rule that calls one exiting step exit-free loses that token."""
    step = FixedLoops.step
    seen = []

    def wrong(self, decode, prefill, prefill_loops):
        starts, exits = step(self, decode, prefill, prefill_loops)
        seen.append(bool(exits.any()))
        if sum(seen) == 3 and exits.any():  # the third step with an exit: called exit-free
            exits = np.zeros_like(exits)
        return starts, exits

    monkeypatch.setattr(FixedLoops, "step", wrong)
    requests = requests_for(tiny_gqa, [4])
    with pytest.raises(AssertionError):  # (the request may also stall: bounded)
        assert_equal_reference(tiny_gqa, run_arrivals(engine(tiny_gqa), requests, max_steps=500), requests)
