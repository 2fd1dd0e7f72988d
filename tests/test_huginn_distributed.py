"""Huginn (``huginn_raven``) under prefill/decode disaggregation and data-parallel replicas (issue #46): a
request prefilled by one engine and decoded by another, or served by one of two replicas, gets exactly
what one engine gives it -- tokens, exit iterations (fixed and the convergence exit) and logprobs, greedy
and seeded sampling, with latent seeds -- and the handoff moves every plane (core, prelude, coda) and the
slot's own rows (latent state, prelude output, latent seed, log p)."""
from __future__ import annotations

import asyncio
import time

import pytest
from engine_testing import run_arrivals  # tests/ is on pythonpath (pyproject.toml)
from matching import FP8_LOGPROB_ATOL, approx_floats

from loopline import AsyncLLM
from loopline.config import EngineArgs
from loopline.core.request import RequestStatus
from loopline.engine import LLMEngine
from loopline.engine.input_processor import child_request_id, parent_request_id
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.sampling_params import SamplingParams

BASE = {"skip_tokenizer_init": True, "device": "cpu", "dtype": "float32", "max_num_seqs": 3, "block_size": 4,
        "max_num_batched_tokens": 8, "max_num_loops": 8, "enable_prefix_caching": True}


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn_distributed"), seed=0)


def workload() -> dict:
    """Greedy and seeded requests at fixed iterations and with the convergence exit, several latent seeds,
    a shared prefix, and one that ends with its first token (on the prefill side)."""
    shared = list(range(100, 113))
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2, max_loops=8, min_loops=2,
                            exit_threshold=0.05)
    sampled = SamplingParams(max_tokens=7, temperature=1.0, seed=5, ignore_eos=True, logprobs=0, max_loops=6,
                             exit_threshold=0.1, latent_seed=3)
    return {"g": (shared + [5, 9, 41], greedy),
            "s": (shared + list(range(7, 26)), sampled),
            "fixed": ([300, 2, 41, 41, 8, 90, 17], greedy.clone(exit_threshold=1.0, max_loops=5, latent_seed=9)),
            "p": ([11] * 10, sampled.clone(seed=8, repetition_penalty=1.2, latent_seed=0, max_loops=8)),
            "one": ([7, 8, 9], greedy.clone(max_tokens=1))}


def result(out) -> list:
    return [(c.token_ids, c.exit_depths, c.finish_reason, c.token_logprobs) for c in out.outputs]


def single(path, requests, **extra) -> dict:
    return run_arrivals(LLMEngine(EngineArgs(model=str(path), **BASE, **extra)), requests)


def handed_off(path, requests, **extra) -> tuple[dict, set, LLMEngine, LLMEngine]:
    """A prefill-only engine and a decode engine stepped in turn, as a PD worker pair: prompt pages (every
    plane) that became final are streamed into pages the decode engine reserved when the first arrived,
    and each ready request moves with the rest of its pages. Returns the outputs, the requests whose pages
    left before their prompt finished, and both engines. ``extra``: more engine arguments for both."""
    prefill = LLMEngine(EngineArgs(model=str(path), **BASE, **extra), prefill_only=True)
    decode = LLMEngine(EngineArgs(model=str(path), **BASE, **extra))
    done, sent, early = {}, {}, set()

    def put(child, first, kv):
        if first == 0:
            req = prefill.scheduler.requests[child]
            decode.handoff.reserve(child, req.prompt_token_ids, req.params._cache_salt)
        decode.handoff.write_pages(child, first, kv)

    for rid, (prompt, params) in requests.items():
        prefill.add_request(rid, {"prompt_token_ids": prompt}, params)
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for out in prefill.step():
            if out.finished:  # ended with its first token: what it sent is dropped
                done[out.request_id] = out
                child = child_request_id(out.request_id, 0)
                sent.pop(child, None)
                decode.handoff.release(child)
        for child, pages in prefill.handoff.final_prompt_pages().items():
            if pages > sent.get(child, 0) and child not in prefill.handoff.ready():
                put(child, sent.get(child, 0), prefill.handoff.export_pages(child, sent.get(child, 0), pages).clone())
                sent[child] = pages
                if prefill.scheduler.requests[child].status == RequestStatus.PREFILL:  # chunks still to run
                    early.add(parent_request_id(child))
        for child in prefill.handoff.ready():
            first = sent.pop(child, 0)
            handoff, rest = prefill.handoff.take(child, first)
            if first == 0:
                decode.handoff.reserve(child, handoff.prompt_token_ids, handoff.params._cache_salt)
            decode.handoff.write_pages(child, first, rest)
            decode.handoff.adopt(handoff)
        done.update((o.request_id, o) for o in decode.step() if o.finished)
    return done, early, prefill, decode


def test_handoff_gives_the_single_engines_outputs(huginn):
    requests = workload()
    ref = single(huginn, requests)
    got, early, prefill, decode = handed_off(huginn, requests)
    # pages left while later chunks still ran, also for prompts that run fewer iterations than max_num_loops
    assert early == {"g", "s", "fixed", "p"}
    assert approx_floats({k: result(v) for k, v in got.items()}) == {k: result(v) for k, v in ref.items()}
    depths = {d for o in ref.values() for d in o.outputs[0].exit_depths[1:]}
    assert len(depths) >= 3  # the convergence exit fired at varied iterations
    assert prefill.kv.num_used_blocks == 0 and decode.kv.num_used_blocks == 0
    assert not decode.runner.pages.snapshots and not prefill.runner.requests


@pytest.mark.slow  # ~7 s; default run: tests/test_huginn_fp8.py (the FP8 engine) and the handoff test above
def test_fp8_handoff_moves_fp8_pages_and_gives_the_single_engines_outputs(huginn):
    """With an FP8 cache the pages travel as their bytes (every plane), both sides hold the same calibrated
    scales, and the outputs are the single FP8 engine's."""
    requests = workload()
    ref = single(huginn, requests, kv_cache_dtype="fp8")
    got, _, prefill, decode = handed_off(huginn, requests, kv_cache_dtype="fp8")
    assert prefill.runner.k_cache.element_size() == 1 and prefill.runner.kv_scales.same_as(decode.runner.kv_scales)
    assert approx_floats({k: result(v) for k, v in got.items()}, FP8_LOGPROB_ATOL) == \
        {k: result(v) for k, v in ref.items()}
    assert prefill.kv.num_used_blocks == 0 and decode.kv.num_used_blocks == 0


async def _generate_all(llm, requests) -> dict:
    outs = await asyncio.gather(*(llm.generate_tokens(p, sp, rid) for rid, (p, sp) in requests.items()))
    return {o.request_id: o for o in outs}


def _idle(llm, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if llm.snapshot.kv_used_blocks == 0 and llm.snapshot.num_unfinished == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {llm.snapshot}")


@pytest.mark.slow  # two worker processes (~18 s on 2 cores). Default run: test_handoff_gives_the_single_engines_outputs
# moves every Huginn plane and the slot's rows between engines; tests/distributed/test_pd.py runs the worker processes
def test_pd_workers_give_the_single_engines_outputs(huginn):
    """One prefill and one decode worker process (gloo): every request equals one engine's, its pages
    streamed to the decode worker and its latent seed carried in the handoff."""
    requests = workload()
    llm = AsyncLLM(EngineArgs(model=str(huginn), prefill_workers=1, decode_workers=1, **BASE))
    try:
        got = asyncio.run(_generate_all(llm, requests))
        assert llm.client.num_handoffs == 4
        _idle(llm)
    finally:
        llm.shutdown()
    ref = single(huginn, requests)
    assert approx_floats({k: result(v) for k, v in got.items()}) == {k: result(v) for k, v in ref.items()}


@pytest.mark.slow  # two engine processes (~16 s on 2 cores). Default run: tests/distributed/test_dp.py runs replicas,
# and a Huginn request is one engine's (test_huginn_engine.py)
def test_dp_replicas_give_the_single_engines_outputs(huginn):
    """Two replicas (engine processes): requests spread over both, each equal to one engine's run of it."""
    requests = workload()
    llm = AsyncLLM(EngineArgs(model=str(huginn), data_parallel_size=2, **BASE))
    picks, choose = [], llm.client.router.choose
    llm.client.router.choose = lambda ids, loads: picks.append(choose(ids, loads)) or picks[-1]
    try:
        got = asyncio.run(_generate_all(llm, requests))
        _idle(llm)
    finally:
        llm.shutdown()
    assert set(picks) == {0, 1}
    ref = single(huginn, requests)
    assert approx_floats({k: result(v) for k, v in got.items()}) == {k: result(v) for k, v in ref.items()}
