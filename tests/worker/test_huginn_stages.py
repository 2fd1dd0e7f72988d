"""Huginn's prelude and coda only where a row needs them (loopline/worker/loop_stack.py, fixed_loops.py):
at fixed iterations the host counts each decode row's loops, so a step runs the coda only for rows that exit
in it and the prelude only for rows that start a token (compacted in eager decode-only steps, skipped in
steps and graph variants where no row needs them). Everything here is held to the plain path (its own
forward, every stage every loop) token for token, exit depth for exit depth, logprobs at fp32 tolerance,
and to the same engine with the host's knowledge switched off (every row a candidate: the pre-skip path)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_testing import run_arrivals

from loopline.config import EngineArgs
from loopline.engine.llm_engine import LLMEngine
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.models.loader import load_looped_model
from loopline.models.plain import plain_generate
from loopline.sampling_params import SamplingParams
from loopline.worker.fixed_loops import FixedLoops

PROMPTS = {"a": [5, 9, 100, 3], "b": list(range(7, 26)), "c": [300, 2, 41, 41, 8, 90, 17], "d": [11] * 12,
           "e": [64, 3, 3, 9, 200, 1]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn_stages"), seed=0)
    return path, load_looped_model(path)


def engine(path, **kw) -> LLMEngine:
    kw = {"skip_tokenizer_init": True, "device": "cpu", "max_num_seqs": 4, "block_size": 4, "max_num_loops": 8, **kw}
    return LLMEngine(EngineArgs(model=str(path), **kw))


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True, **kw)


# fixed iterations at three depths (every row at its own phase), prompts of several lengths, latent seeds
FIXED = {"a": (PROMPTS["a"], params(7, max_loops=8)), "b": (PROMPTS["b"], params(5, max_loops=3, latent_seed=4)),
         "c": (PROMPTS["c"], params(6, max_loops=5)), "d": (PROMPTS["d"], params(4, max_loops=8, latent_seed=9)),
         "e": (PROMPTS["e"], params(5, max_loops=2))}
ARRIVALS = {"c": 3, "d": 10, "e": 17}


def assert_equal_plain(model, outputs: dict, requests: dict) -> None:
    for rid, (prompt, p) in requests.items():
        c = outputs[rid].outputs[0]
        ref = plain_generate(model, prompt, p.max_tokens, max_loops=p.max_loops, min_loops=p.min_loops,
                             exit_threshold=p.exit_threshold, seed=p.latent_seed)
        assert (c.token_ids, c.exit_depths) == (ref.tokens, ref.exit_loops), rid
        assert torch.tensor(c.token_logprobs) == pytest.approx(torch.tensor(ref.logprobs), abs=1e-4), rid


def top_logprobs(outputs: dict) -> dict:
    """Each request's top-3 logprobs of every token (log_softmax of the logits), in token order."""
    return {rid: [sorted(step.items()) for step in o.outputs[0].logprobs] for rid, o in outputs.items()}


def assert_same_logits(got: dict, want: dict) -> None:
    for rid, steps in want.items():
        for g, w in zip(got[rid], steps, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w], rid
            assert [lp.logprob for _, lp in g] == pytest.approx([lp.logprob for _, lp in w], abs=1e-5), rid


def knows_nothing(eng: LLMEngine) -> LLMEngine:
    """The engine with every decode row a candidate for both stages (the host counts nothing): each step runs
    the prelude and the coda for all its decode rows, as before the skip."""
    eng.runner.stack.fixed.depths = lambda rid: None  # (as for a request whose depths are not known)
    return eng


def counts_match_the_device(eng: LLMEngine) -> None:
    """The host's loop and token counts of every request it knows equal its slot's on the device."""
    runner, ds = eng.runner, eng.runner.decode_state
    for rid, (done, token) in runner.stack.fixed.done.items():
        st = runner.requests.get(rid)
        if st is not None:  # (a preempted request has no slot now)
            assert (int(ds.loop[st.slot]), int(ds.token_index[st.slot])) == (done, token), rid


# default run: overlapped no_refill; the other three (~4-7 s each) are slow (refill at fixed iterations:
# test_huginn_engine.py::test_chunked_prefill_refill_depths_and_seeds)
@pytest.mark.parametrize("overlap, mode", [
    pytest.param(False, "refill", id="sync-refill", marks=pytest.mark.slow),
    pytest.param(False, "no_refill", id="sync-no_refill", marks=pytest.mark.slow),
    pytest.param(True, "refill", id="overlapped-refill", marks=pytest.mark.slow),
    pytest.param(True, "no_refill", id="overlapped-no_refill")])
def test_fixed_iterations_skip_equals_plain_path(tiny, mode, overlap):
    """Concurrent requests at different depths and phases, chunked prefill, arrivals while others decode:
    tokens, depths and logprobs equal the plain path; top logprobs equal the engine without the skip; the
    host's counts equal the device's loops after every step; the coda and the prelude ran for a fraction
    of the rows."""
    path, model = tiny
    kw = {"scheduling_mode": mode, "async_scheduling": overlap, "max_num_batched_tokens": 6}
    eng = engine(path, **kw)
    outputs = run_arrivals(eng, FIXED, ARRIVALS, watch=counts_match_the_device)
    assert_equal_plain(model, outputs, FIXED)
    plain = run_arrivals(knows_nothing(engine(path, **kw)), FIXED, ARRIVALS)
    assert_same_logits(top_logprobs(outputs), top_logprobs(plain))
    rows = eng.runner.stack.stage_rows
    assert rows["coda"] < 0.6 * rows["tokens"] and rows["prelude"] < 0.6 * rows["tokens"], rows


def test_adaptive_rows_keep_the_coda_beside_fixed_ones(tiny):
    """Convergence-exit requests (the KL reads p_r at every loop) in the same batch as fixed ones: all exact;
    the adaptive rows ran the coda at every loop, the fixed rows only at their exits."""
    path, model = tiny
    requests = {**FIXED, "k1": (PROMPTS["c"], params(7, max_loops=8, min_loops=2, exit_threshold=0.05)),
                "k2": (PROMPTS["a"], params(6, max_loops=6, exit_threshold=0.2, latent_seed=3))}
    eng = engine(path, max_num_seqs=5, max_num_batched_tokens=8)
    outputs = run_arrivals(eng, requests, {**ARRIVALS, "k2": 6}, watch=counts_match_the_device)
    assert_equal_plain(model, outputs, requests)
    depths = [d for rid in ("k1", "k2") for d in outputs[rid].outputs[0].exit_depths[1:]]
    assert min(depths) < 6  # the convergence exit fired early
    rows = eng.runner.stack.stage_rows
    assert rows["coda"] < 0.9 * rows["tokens"], rows


@pytest.mark.parametrize("mode", [pytest.param("refill", marks=pytest.mark.slow), "no_refill"])  # (refill: ~4 s, slow)
def test_preemption_at_fixed_iterations(tiny, mode):
    """Requests preempted under a tiny pool (their counts kept while they wait: the slot state comes back
    unchanged) equal the plain path."""
    path, model = tiny
    requests = {f"r{i}": (list(range(10 + i, 16 + 3 * i)), params(7, max_loops=3 + i, latent_seed=i)) for i in range(4)}
    eng = engine(path, scheduling_mode=mode, kv_allocation="incremental", enable_preemption=True,
                 num_kv_blocks=8 * 8, max_num_loops=6)
    outputs = run_arrivals(eng, requests, watch=counts_match_the_device)
    assert eng.scheduler.num_preemptions > 0
    assert_equal_plain(model, outputs, requests)


def test_prefix_cache_hits_at_fixed_iterations(tiny):
    """Prompts reusing a cached prefix (pages of every plane, the coda's written at the prompt's last loop
    only) equal the plain path."""
    path, model = tiny
    shared = list(range(100, 116))
    requests = {f"p{i}": (shared + [i + 1, 2 * i + 3], params(4, max_loops=5)) for i in range(3)}
    eng = engine(path, enable_prefix_caching=True)
    outputs = run_arrivals(eng, requests, {"p1": 12, "p2": 25})
    assert eng.kv.prefix_cache.stats.hits > 0
    assert_equal_plain(model, outputs, requests)


def test_graph_variants_skip_stages_and_equal_the_plain_path(tiny):
    """The CUDA-graph input path on the CPU (replay simulated): decode steps replay the variants without the
    prelude, the coda or both where no row needs them; outputs equal the plain path's."""
    from graph_testing import EagerCapturer

    path, model = tiny
    eng = engine(path, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=64)
    eng.runner.capture_graphs(48, 12, max_prefill_rows=2, capturer=EagerCapturer())
    requests = {rid: FIXED[rid] for rid in ("a", "b", "c", "d")}
    outputs = run_arrivals(eng, requests, {"c": 5, "d": 9})
    assert_equal_plain(model, outputs, requests)
    replays = eng.runner.graphs.replays
    assert replays["decode_core"] > 5 and replays["decode_prelude"] + replays["decode_coda"] > 2, replays


@pytest.mark.parametrize("stage", ["prelude", "coda"])
def test_a_rule_that_skips_a_needed_stage_breaks_exactness(tiny, monkeypatch, stage):
    """The tests above can fail: a host rule that leaves out a row starting a token (its prelude skipped), or
    one row that exits (its coda and sampling skipped), gives other results than the plain path."""
    path, model = tiny
    step = FixedLoops.step

    def wrong(self, decode, prefill, prefill_loops):
        starts, exits = step(self, decode, prefill, prefill_loops)
        if stage == "prelude":
            return np.zeros_like(starts), exits
        exits = exits.copy()
        exits[np.flatnonzero(exits)[:1]] = False
        return starts, exits

    monkeypatch.setattr(FixedLoops, "step", wrong)
    with pytest.raises(AssertionError):  # (a row exiting unsampled may also stall its request: bounded)
        assert_equal_plain(model, run_arrivals(engine(path), FIXED, ARRIVALS, max_steps=2000), FIXED)


# default run: overlapped; synchronous (~2 s) is slow
@pytest.mark.parametrize("overlap", [pytest.param(False, id="sync", marks=pytest.mark.slow),
                                     pytest.param(True, id="overlapped")])
def test_recorded_depths_skip_equals_every_stage(tiny, overlap):
    """``exit_mode="trace"`` (the bench's synthetic exit distributions): each token's exit loop is known from
    its request's depths, so the same skip applies; tokens, depths and top logprobs equal the engine with
    every row a candidate, and the depths are the recorded ones."""
    path, _ = tiny
    traces = {"a": [8, 2, 5, 3], "b": [3, 7, 1, 4, 6], "c": [5], "d": [2, 8, 8, 1]}
    requests = {rid: (PROMPTS[rid], params(6, exit_depths=t)) for rid, t in traces.items()}
    kw = {"exit_mode": "trace", "async_scheduling": overlap, "max_num_batched_tokens": 8}
    eng = engine(path, **kw)
    outputs = run_arrivals(eng, requests, {"c": 4, "d": 9}, watch=counts_match_the_device)
    plain = run_arrivals(knows_nothing(engine(path, **kw)), requests, {"c": 4, "d": 9})
    for rid, t in traces.items():
        got, want = outputs[rid].outputs[0], plain[rid].outputs[0]
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths), rid
        assert got.exit_depths[1:] == [t[min(k, len(t) - 1)] for k in range(1, 6)], rid
    assert_same_logits(top_logprobs(outputs), top_logprobs(plain))
    assert eng.runner.stack.stage_rows["coda"] < 0.8 * eng.runner.stack.stage_rows["tokens"]


def test_fixed_loops_counts_by_hand():
    """Refill: a row's loop runs 1..max_loops and starts again; no_refill: a fresh row waits for its cohort;
    a row of another policy is unknown (and makes its no_refill cohort unknown)."""
    from loopline.core.contracts import ExitParams, ScheduledRow

    def dec(rid, max_loops, threshold=1.0):
        return ScheduledRow(rid, False, 0, 0, 0, 0, None, exit=ExitParams(1, max_loops, threshold))

    def last_chunk(rid, loop):
        return ScheduledRow(rid, True, 0, 4, loop, 0, None, is_last_chunk=True)

    fl = FixedLoops(no_refill=False)
    fl.step([], [last_chunk("a", 3)], lambda rid: 3)
    seen = [tuple(x.tolist() for x in fl.step([dec("a", 3)], [], lambda rid: 3)) for _ in range(4)]
    assert seen == [([True], [False]), ([False], [False]), ([False], [True]), ([True], [False])]
    s, e = fl.step([dec("b", 3)], [], lambda rid: 3)  # never seen finishing its prompt: unknown
    assert (s.tolist(), e.tolist()) == ([True], [True])
    s, e = fl.step([dec("a", 3), dec("k", 5, 0.1)], [], lambda rid: 3)
    assert (s.tolist(), e.tolist()) == ([False, True], [False, True])

    cohort = FixedLoops(no_refill=True)
    cohort.step([], [last_chunk("a", 2)], lambda rid: 2)
    cohort.step([dec("a", 2)], [], lambda rid: 2)  # a runs loop 1
    cohort.step([], [last_chunk("b", 2)], lambda rid: 2)
    s, e = cohort.step([dec("a", 2), dec("b", 2)], [], lambda rid: 2)  # a runs loop 2 and exits; b waits
    assert (s.tolist(), e.tolist()) == ([False, False], [True, False])
    s, e = cohort.step([dec("a", 2), dec("b", 2)], [], lambda rid: 2)  # nothing in flight: both start
    assert (s.tolist(), e.tolist()) == ([True, True], [False, False])
    s, e = cohort.step([dec("a", 2), dec("k", 4, 0.1)], [], lambda rid: 2)
    assert (s.tolist(), e.tolist()) == ([True, True], [True, True]) and "a" not in cohort.done
