"""The overlapped engine (step n+1 launched before step n is read) equals reading every step at once.

Both run the one execution path (decode state on the device); only when the host reads
results differs. Exits are decided on the device, so overlap changes no token and no depth.
"""
from __future__ import annotations

import random

import pytest

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from reference import reference_generate


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(tiny, requests, arrivals=None, **kw):
    kw = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True, "block_size": 4,
          "max_num_batched_tokens": 16, "max_num_seqs": 4, "async_scheduling": False, **kw}
    engine = LLMEngine(EngineArgs(model=str(tiny.path), **kw))
    arrivals = arrivals or {}
    pending, done, step = dict(requests), {}, 0
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            prompt, params = pending.pop(rid)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.exit_depths, c.token_logprobs, c.finish_reason, c.text)
                                        for c in out.outputs]
        step += 1
        assert step < 5000
    assert engine.kv.num_used_blocks == 0
    run.steps = engine.stats.steps
    return done


def same(a: dict, b: dict) -> None:
    """Tokens, depths, finish reasons and text identical; logprobs to fp32 tolerance (batches differ)."""
    assert a.keys() == b.keys()
    for rid in a:
        for (ta, da, la, fa, xa), (tb, db, lb, fb, xb) in zip(a[rid], b[rid]):
            assert (ta, da, fa, xa) == (tb, db, fb, xb), rid
            assert (la is None) == (lb is None) and (la is None or max(abs(x - y) for x, y in zip(la, lb)) < 1e-5)


ADAPTIVE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.7, logprobs=2)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, exit_threshold=0.6,
                         logprobs=0)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_overlap_equals_reading_every_step(tiny_gqa, layout, mode):
    reqs = {f"r{i}": (ids(n, seed=n), ADAPTIVE if i % 2 else SAMPLED) for i, n in enumerate((3, 11, 19, 6, 8))}
    arrivals = {"r3": 5, "r4": 9}
    at_once = run(tiny_gqa, reqs, arrivals, kv_layout=layout, scheduling_mode=mode)
    at_once_steps = run.steps
    overlapped = run(tiny_gqa, reqs, arrivals, kv_layout=layout, scheduling_mode=mode, async_scheduling=True)
    same(overlapped, at_once)
    # Same schedule, plus the lag of reading one step behind.
    assert at_once_steps <= run.steps <= at_once_steps + 2
    assert len({d for outs in at_once.values() for _, depths, *_ in outs for d in depths}) > 1


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_matches_the_reference_oracle(tiny_gqa, overlap):
    prompt = ids(13, seed=2)
    out = run(tiny_gqa, {"a": (prompt, ADAPTIVE)}, async_scheduling=overlap)["a"][0]
    tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, prompt, 10, exit_threshold=0.7)
    assert (out[0], out[1]) == (tokens, depths)
    assert max(abs(a - b) for a, b in zip(out[2], logprobs)) < 1e-4


def test_overlap_stops_n_and_prefix_caching(tiny_gqa):
    base = run(tiny_gqa, {"a": (ids(9, seed=1), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))})
    stop_id = base["a"][0][0][4]
    reqs = {
        "stop": (ids(9, seed=1), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])),
        "n": (ids(7, seed=3), SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)),
        "shared1": (ids(16, seed=4) + [7, 8], ADAPTIVE),
        "shared2": (ids(16, seed=4) + [9], ADAPTIVE),
    }
    arrivals = {"shared2": 12}
    at_once = run(tiny_gqa, reqs, arrivals, enable_prefix_caching=True)
    overlapped = run(tiny_gqa, reqs, arrivals, enable_prefix_caching=True, async_scheduling=True)
    same(overlapped, at_once)
    assert overlapped["stop"][0][3] == "stop" and overlapped["stop"][0][0][-1] == stop_id


def test_overlap_abort_frees_kv(tiny_gqa):
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  async_scheduling=True))
    engine.add_request("a", ids(6), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):
        engine.step()
    engine.abort_request("a")
    assert engine.kv.num_used_blocks == 0
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert any(o.request_id == "a" and o.outputs[0].finish_reason == "abort" for o in outs)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_trace_exits_equal_under_overlap(tiny_gqa, layout, mode):
    """Per-token recorded depths (exit_mode="trace", the bench's --depth-dist) are read on the device."""
    rng = random.Random(7)
    reqs = {f"t{i}": (ids(n, seed=n), SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True,
                                                       exit_depths=[rng.randint(1, 4) for _ in range(k)]))
            for i, (n, k) in enumerate(((5, 11), (12, 3), (7, 1), (9, 11)))}
    arrivals = {"t3": 6}
    kw = dict(kv_layout=layout, scheduling_mode=mode, exit_mode="trace")
    at_once = run(tiny_gqa, reqs, arrivals, **kw)
    overlapped = run(tiny_gqa, reqs, arrivals, async_scheduling=True, **kw)
    same(overlapped, at_once)
    for rid, (prompt, params) in reqs.items():  # the trace was followed, its last depth repeating
        trace = params.exit_depths
        assert overlapped[rid][0][1] == [trace[min(k, len(trace) - 1)] for k in range(11)]


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_penalties_equal_under_overlap(tiny_gqa, mode):
    """Penalties read per-slot token counts kept on the device."""
    pen = dict(max_tokens=12, ignore_eos=True, exit_threshold=0.7)
    reqs = {
        "freq": (ids(5, seed=1), SamplingParams(temperature=0.0, frequency_penalty=1.5, **pen)),
        "rep": (ids(9, seed=2), SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.8, **pen)),
        "plain": (ids(7, seed=3), SamplingParams(temperature=0.0, **pen)),
        "late": (ids(4, seed=5), SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=-0.5, **pen)),
        "reuse": (ids(6, seed=6), SamplingParams(temperature=0.0, presence_penalty=1.0, **pen)),
    }
    arrivals = {"late": 7, "reuse": 30}  # "reuse" takes a slot freed by an earlier request
    at_once = run(tiny_gqa, reqs, arrivals, scheduling_mode=mode)
    same(run(tiny_gqa, reqs, arrivals, scheduling_mode=mode, async_scheduling=True), at_once)
    plain = run(tiny_gqa, {"freq": (reqs["freq"][0], SamplingParams(temperature=0.0, **pen))})
    assert plain["freq"][0][0] != at_once["freq"][0][0]  # the penalty changed the greedy tokens
