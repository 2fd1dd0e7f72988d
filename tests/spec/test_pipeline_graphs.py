"""CUDA graphs of pipelining steps (#41 scheme 2): ``s`` pipelining requests' ``s * L`` one-query lane rows,
beside decode rows, replay the ``pipe`` family. On the CPU the graph input path is checked with a capturer
whose "replay" re-runs the captured forward eagerly on the graph's padded views (padding lanes run on the
scratch slot, frozen); the GPU test captures real CUDA graphs.

What must hold: tokens, exit depths and logprobs with graphs equal those without and those of plain
decoding (greedy and seeded sampling, adaptive exits, one request with penalties), with pipelining requests padded into larger buckets
and batched with plain requests; every step of lane rows without a prefill chunk replays a graph. The real CUDA
graphs' GPU test is tests/spec/test_graphs.py's, run for both schemes."""
from __future__ import annotations

import pytest
from spec.test_graphs import GREEDY, SAMPLED, assert_same, drain, ids, make, requests, watch


def pipe(d: int) -> dict:
    return {"method": "loop", "scheme": "pipeline", "draft_loops": d, "adaptive": False,
            "disable_by_batch_size": None}


# default run: d = 1 greedy (synchronous) and d = 2 sampled (overlapped); the other two (~3 s each) are slow
@pytest.mark.parametrize("d, params", [
    pytest.param(1, GREEDY, id="1-greedy"), pytest.param(1, SAMPLED, id="1-sampled", marks=pytest.mark.slow),
    pytest.param(2, GREEDY, id="2-greedy", marks=pytest.mark.slow), pytest.param(2, SAMPLED, id="2-sampled")])
def test_pipelining_steps_replay_graphs_and_equal_eager_and_plain(tiny_gqa, params, d):
    reqs, arrivals = requests(params)
    eng = make(tiny_gqa, pipe(d), graphs=True, async_scheduling=d == 2)
    seen = watch(eng)
    graphed = drain(eng, reqs, arrivals)
    assert_same(graphed, drain(make(tiny_gqa, pipe(d), graphs=False), reqs, arrivals))
    assert_same(graphed, drain(make(tiny_gqa, None, graphs=False), reqs, arrivals))
    lanes = -(-4 // d)  # the tiny model's 4 loops
    pipe_steps = [s for s in seen if s[0] and not s[1]]
    assert len(pipe_steps) > 20 and all(rows % lanes == 0 for rows, *_ in pipe_steps)
    assert all(where is not None and where[0] == "pipe" for *_, where in pipe_steps)
    assert any(rows == 3 * lanes and where[1] == 4 * lanes for rows, _, _, where in pipe_steps)  # 3 padded to 4
    assert any(decode for _, _, decode, _ in pipe_steps)  # beside plain requests' decode rows
    assert eng.runner.graphs.replays["pipe"] == len(pipe_steps)


@pytest.mark.parametrize("params", [pytest.param(GREEDY, id="greedy"), pytest.param(SAMPLED, id="sampled")])
def test_a_prompt_arriving_beside_pipelining_requests_replays_a_graph(tiny_gqa, params):
    """Requests arriving while others pipeline (a closed loop's next request): the steps that carry their prompt
    chunks beside the lanes replay ``pipe_mixed`` graphs, and every request's tokens, depths and logprobs equal
    those without graphs and those of plain decoding."""
    reqs = {f"s{i}": (ids(n, seed=n), params.clone(seed=params.seed + i if params.seed is not None else None))
            for i, n in enumerate((5, 13, 8, 11))}
    arrivals = {"s1": 2, "s2": 9, "s3": 17}
    eng = make(tiny_gqa, pipe(1), graphs=True)
    seen = watch(eng)
    graphed = drain(eng, reqs, arrivals)
    assert_same(graphed, drain(make(tiny_gqa, pipe(1), graphs=False), reqs, arrivals))
    assert_same(graphed, drain(make(tiny_gqa, None, graphs=False), reqs, arrivals))
    beside = [where for lanes, prefill, decode, where in seen if lanes and prefill and not decode]
    assert len(beside) >= 3 and all(where is not None and where[0] == "pipe_mixed" for where in beside)
    assert eng.runner.graphs.replays["pipe_mixed"] == len(beside)


def test_pipeline_captures_its_family_only(tiny_gqa):
    """The pipeline's families: lanes beside decode rows (``pipe``), and lanes beside a prompt's chunk
    (``pipe_mixed``: the next request arriving while others pipeline, eager before; no decode rows, the lanes
    attended off the work list, which holds the chunk's tiles as a mixed step's does)."""
    on = make(tiny_gqa, pipe(1), graphs=True).runner.graphs
    assert [f.name for f in on.families] == ["decode", "mixed", "pipe", "pipe_mixed"]
    assert {(s.max_query_len, s.work) for s in on.families[2].shapes} == {(1, 0)}
    assert all(s.counts[1][0] % 4 == 0 for s in on.families[2].shapes)
    mixed_work = {s.counts[-1]: s.work for s in on.families[1].shapes}
    for s in on.families[3].shapes:
        (decode, _), (lanes, _), chunk = s.counts
        assert decode == 0 and lanes % 4 == 0 and chunk[1] > 1 and s.max_query_len == chunk[1]
        assert s.work == mixed_work[chunk]
    assert {s.counts[-1] for s in on.families[3].shapes} == set(mixed_work)
