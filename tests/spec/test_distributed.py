"""Loop self-speculation across engines (#41): the decode workers of prefill/decode disaggregation and each
data-parallel replica speculate, and every request gets exactly what one plain engine gives it (tokens,
exit depths, logprobs), greedy and seeded sampling, adaptive exits."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from loopline import AsyncLLM, EngineArgs, SamplingParams
from loopline.engine import LLMEngine

# speculation pinned on: these tests check where it runs, not when it pays
SPEC = {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False,
        "disable_by_batch_size": None}
BASE = dict(dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256, block_size=4,
            skip_tokenizer_init=True)


def ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def workload() -> dict:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0, exit_threshold=0.6)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    return {"g0": (ids(9, 1), greedy), "g1": (ids(17, 2), greedy.clone(exit_threshold=1.0)),
            "s0": (ids(6, 3), seeded), "s1": (ids(12, 4), seeded.clone(seed=9, exit_threshold=0.6))}


def plain_outputs(tiny, requests: dict) -> dict:
    engine = LLMEngine(EngineArgs(model=str(tiny.path), **BASE))
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def served(llm: AsyncLLM, requests: dict) -> dict:
    async def main():
        outs = await asyncio.gather(*(llm.generate_tokens(p, sp, rid) for rid, (p, sp) in requests.items()))
        return {o.request_id: o for o in outs}
    return asyncio.run(main())


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g, w = got[rid].outputs[0], w.outputs[0]
        assert (g.token_ids, g.exit_depths) == (w.token_ids, w.exit_depths), rid
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4), rid


def settled(llm: AsyncLLM, timeout: float = 20.0) -> list:
    """Each engine's snapshot once none holds a request or a KV page."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = [r.snapshot for r in llm.replicas()]
        if all(s.num_unfinished == 0 and s.kv_used_blocks == 0 for s in snaps):
            return snaps
        time.sleep(0.05)
    raise AssertionError("engines not idle")


@pytest.mark.slow  # two worker processes (~8-10 s on 2 cores). Default run: a handed-off request resumes in the
# decode engine (tests/distributed/test_handoff.py), speculation resumes after a preemption (spec/test_engine.py)
def test_decode_workers_speculate_after_the_handoff(tiny_gqa):
    requests = workload()
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), prefill_workers=1, decode_workers=1,
                              max_num_batched_tokens=8, speculative_config=SPEC, **BASE))
    try:
        got = served(llm, requests)
        assert llm.client.num_handoffs == len(requests)
        settled(llm)
        prefill, decode = llm.client.prefill[0].snapshot, llm.client.decode[0].snapshot
    finally:
        llm.shutdown()
    assert_same(got, plain_outputs(tiny_gqa, requests))
    assert prefill.spec_num_drafts == 0 and decode.spec_num_drafts > 0  # rounds run where tokens are decoded
    assert decode.spec_num_draft_tokens == 2 * decode.spec_num_drafts


@pytest.mark.slow  # two engine processes (~7 s on 2 cores). Default run: replicas are whole engines
# (tests/distributed/test_dp.py), each speculating as one engine does (tests/spec/test_engine.py)
def test_each_data_parallel_replica_speculates(tiny_gqa):
    requests = workload()
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), data_parallel_size=2, speculative_config=SPEC, **BASE))
    try:
        got = served(llm, requests)
        snaps = settled(llm)
        total = llm.snapshot  # what /metrics reads: the replicas' counters added up
    finally:
        llm.shutdown()
    assert_same(got, plain_outputs(tiny_gqa, requests))
    assert len(snaps) == 2 and all(s.spec_num_drafts > 0 for s in snaps)  # 4 requests on 2 idle replicas: 2 each
    assert total.spec_num_drafts == sum(s.spec_num_drafts for s in snaps)
    assert sum(total.spec_accepted_per_pos) == total.spec_num_accepted_tokens
