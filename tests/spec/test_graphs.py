"""CUDA graphs of speculative steps (#41): draft and verify rows, alone and beside plain decode rows,
replay a captured forward at bucketed shapes. On the CPU the graph input path is checked with a capturer
whose "replay" re-runs the captured forward eagerly on the graph's padded views (as
tests/worker/test_cuda_graphs_logic.py does); the GPU test captures real CUDA graphs.

What must hold: tokens, exit depths and logprobs with graphs equal those without and those of plain
decoding (greedy and seeded sampling, adaptive exits), with speculating requests padded into larger
buckets (3 in a 4-bucket) and batched with plain requests; every step of speculative rows without a
prefill chunk replays a graph; speculation off captures exactly the graphs it did before."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_testing import run_arrivals
from graph_testing import EagerCapturer

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.worker.cuda_graphs import spec_buckets
from loopline.worker.step_inputs import KindRows, StepPlan


def ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def spec(k: int, d: int) -> dict:
    return {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": k, "draft_loops": d,
            "adaptive": False, "disable_by_batch_size": None}


def make(tiny, speculative: dict | None, graphs: bool, **kw) -> LLMEngine:
    kw = dict(model=str(tiny.path), dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=4,
              max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96, speculative_config=speculative, **kw)
    eng = LLMEngine(EngineArgs(**kw))
    if graphs:
        eng.runner.capture_graphs(96, 24, max_prefill_rows=3, capturer=EagerCapturer())
    return eng


def watch(eng: LLMEngine) -> list:
    """Records, per step, (speculative rows, prefill rows, decode rows, the graph's (family, speculative
    bucket) or None)."""
    seen = []
    graphs = eng.runner.graphs
    find = graphs.find

    def recording(plan):
        graph = find(plan)
        where = None if graph is None else (graph.family, graph.shape.counts[1][0])
        seen.append((plan.kinds[1].num_rows, plan.kinds[-1].num_rows, plan.kinds[0].num_rows, where))
        return graph

    graphs.find = recording
    return seen


def drain(eng: LLMEngine, requests: dict, arrivals: dict) -> dict:
    done = {}
    for rid, out in run_arrivals(eng, requests, arrivals, max_steps=5_000).items():
        c = out.outputs[0]
        lps = [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs]
        done[rid] = (c.token_ids, c.exit_depths, lps, c.finish_reason)
    return done


def assert_same(got: dict, want: dict, atol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for rid, (tokens, depths, lps, reason) in got.items():
        w_tokens, w_depths, w_lps, w_reason = want[rid]
        assert (tokens, depths, reason) == (w_tokens, w_depths, w_reason), rid
        for a, b in zip(lps, w_lps):
            assert [t for t, _ in a] == [t for t, _ in b], rid
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=atol), rid


GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2, exit_threshold=0.6)
SAMPLED = SamplingParams(max_tokens=14, temperature=0.9, top_k=50, seed=5, ignore_eos=True, logprobs=1,
                         exit_threshold=0.6)


def requests(params: SamplingParams) -> tuple[dict, dict]:
    """Three speculating requests (a 4-bucket; one with penalties, which reads the drafts or lanes ahead as history)
    and two plain ones (speculate=False, with penalties), staggered."""
    reqs = {f"s{i}": (ids(n, seed=n), params.clone(seed=params.seed + i if params.seed is not None else None))
            for i, n in enumerate((5, 13, 8))}
    reqs["s1"] = (reqs["s1"][0], reqs["s1"][1].clone(repetition_penalty=1.3, presence_penalty=0.4))
    reqs["p0"] = (ids(7, seed=70), params.clone(repetition_penalty=1.2, speculate=False))
    reqs["p1"] = (ids(4, seed=40), params.clone(frequency_penalty=0.5, max_tokens=30, speculate=False))
    return reqs, {"s1": 3, "p1": 6, "s2": 9}


# default run: (3, 1) greedy and (2, 2) sampled; the other two pairings (~3.5 s each) are slow
@pytest.mark.parametrize("k, d, params", [
    pytest.param(3, 1, GREEDY, id="3-1-greedy"), pytest.param(3, 1, SAMPLED, id="3-1-sampled", marks=pytest.mark.slow),
    pytest.param(2, 2, GREEDY, id="2-2-greedy", marks=pytest.mark.slow), pytest.param(2, 2, SAMPLED, id="2-2-sampled")])
def test_speculative_steps_replay_graphs_and_equal_eager_and_plain(tiny_gqa, params, k, d):
    reqs, arrivals = requests(params)
    eng = make(tiny_gqa, spec(k, d), graphs=True)
    seen = watch(eng)
    graphed = drain(eng, reqs, arrivals)
    eager = drain(make(tiny_gqa, spec(k, d), graphs=False), reqs, arrivals)
    plain = drain(make(tiny_gqa, None, graphs=False), reqs, arrivals)
    assert_same(graphed, eager)
    assert_same(graphed, plain)
    spec_steps = [s for s in seen if s[0] and not s[1]]
    assert len(spec_steps) > 20
    # steps whose speculating rows all draft (one query a row) take the draft-sized family, the others
    # (verify rows, or a mix) the verify-sized one
    assert all(where in (("spec", _bucket(rows)), ("spec_draft", _bucket(rows))) for rows, _, _, where in spec_steps)
    assert {where[0] for *_, where in spec_steps} == {"spec", "spec_draft"}
    assert any(rows == 3 and where[1] == 4 for rows, _, _, where in spec_steps)  # 3 speculating rows padded to 4
    assert any(decode for _, _, decode, _ in spec_steps)  # beside plain requests' decode rows
    assert spec_replays(eng) == len(spec_steps)


def spec_replays(eng: LLMEngine) -> int:
    """Replays of speculative steps' graphs (the draft-sized and the verify-sized family)."""
    return eng.runner.graphs.replays["spec"] + eng.runner.graphs.replays["spec_draft"]


def _bucket(rows: int) -> int:
    return min(s for s in (1, 2, 4, 6) if s >= rows)


def test_async_scheduling_and_last_step_exits(tiny_gqa):
    """Overlapped engine order; min_loops/max_loops so positions exit inside the draft and inside the
    verify loops (exit copies at the verify steps) while the graph replays."""
    params = GREEDY.clone(exit_threshold=0.4, max_loops=3)
    reqs, arrivals = requests(params)
    eng = make(tiny_gqa, spec(3, 2), graphs=True, async_scheduling=True)
    graphed = drain(eng, reqs, arrivals)
    assert spec_replays(eng) > 20
    assert_same(graphed, drain(make(tiny_gqa, None, graphs=False, async_scheduling=True), reqs, arrivals))


def test_speculation_off_captures_the_same_graphs(tiny_gqa):
    off = make(tiny_gqa, None, graphs=True).runner.graphs
    assert [f.name for f in off.families] == ["decode", "mixed"]
    assert [s.counts for s in off.families[0].shapes] == [((b, b), (0, 0)) for b in (1, 2, 4, 6)]
    assert {s.max_seq_len for f in off.families for s in f.shapes} == {96}
    on = make(tiny_gqa, spec(3, 1), graphs=True).runner.graphs
    assert [f.name for f in on.families] == ["decode", "mixed", "spec_draft", "spec", "spec_mixed"]
    assert [s.counts[:1] + s.counts[2:] for s in on.families[0].shapes] == [s.counts for s in off.families[0].shapes]
    draft, verify = on.families[2].shapes, on.families[3].shapes
    # the draft family: one query token a speculating row, decode attention (no work list); the verify
    # family: K + 1 = 4 tokens a row; both at the same bucket pairs
    assert [s.counts for s in draft] == [((d, d), (r, r), (0, 0)) for (d, _), (r, _), _ in (v.counts for v in verify)]
    assert {(s.max_query_len, s.work) for s in draft} == {(1, 0)}
    assert all(s.counts[1][1] == 4 * s.counts[1][0] and s.max_query_len == 4 for s in verify)
    # a prompt's chunk beside speculating rows (no decode rows): the mixed graphs' chunks, both on the work list
    mixed_work = {s.counts[-1]: s.work for s in on.families[1].shapes}
    for s in on.families[4].shapes:
        (decode, _), (rows, tokens), chunk = s.counts
        assert decode == 0 and tokens == 4 * rows and s.max_query_len == max(4, chunk[1])
        assert s.work == rows + mixed_work[chunk]  # a work-list tile per speculating row (K + 1 <= 64 queries)
    assert {s.counts[-1] for s in on.families[4].shapes} == set(mixed_work)


@pytest.mark.parametrize("params", [pytest.param(GREEDY, id="greedy"), pytest.param(SAMPLED, id="sampled")])
def test_a_prompt_arriving_beside_speculating_requests_replays_a_graph(tiny_gqa, params):
    """Requests arriving while others draft and verify (a closed loop's next request): the steps that carry their
    prompt chunks beside the rounds' rows replay ``spec_mixed`` graphs, and every request's tokens, depths and
    logprobs equal those without graphs and those of plain decoding."""
    reqs = {f"s{i}": (ids(n, seed=n), params.clone(seed=params.seed + i if params.seed is not None else None))
            for i, n in enumerate((5, 13, 8, 11))}
    arrivals = {"s1": 2, "s2": 9, "s3": 17}
    eng = make(tiny_gqa, spec(3, 1), graphs=True)
    seen = watch(eng)
    graphed = drain(eng, reqs, arrivals)
    assert_same(graphed, drain(make(tiny_gqa, spec(3, 1), graphs=False), reqs, arrivals))
    assert_same(graphed, drain(make(tiny_gqa, None, graphs=False), reqs, arrivals))
    beside = [where for rows, prefill, decode, where in seen if rows and prefill and not decode]
    assert len(beside) >= 3 and all(where is not None and where[0] == "spec_mixed" for where in beside)
    assert eng.runner.graphs.replays["spec_mixed"] == len(beside)


def test_spec_buckets_hold_every_step_once():
    pairs = spec_buckets(6, 6)
    assert (0, 1) in pairs and (4, 2) in pairs and (0, 6) in pairs and (1, 4) in pairs and (6, 1) in pairs
    assert (4, 4) in pairs  # 3 + 3 rows
    assert (6, 6) not in pairs and (4, 6) not in pairs  # no step has 3+ decode rows beside 5+ speculating ones
    for d in range(7):  # every step of at most 6 rows fits one pair
        for s in range(1, 7 - d):
            assert any(pd >= d and ps >= s for pd, ps in pairs), (d, s)
    assert len(spec_buckets(256, 256)) == 54  # bounded: capture time and graph memory grow with it


def test_a_speculative_bucket_holds_rows_not_only_tokens(tiny_gqa):
    """3 one-query draft rows fit the verify family's 1-row bucket's K+1 tokens, but need its 4-row bucket
    (and take the draft family's 4-row bucket first)."""
    graphs = make(tiny_gqa, spec(3, 1), graphs=True).runner.graphs

    def plan(spec_rows: int, tokens: int, max_query_len: int) -> StepPlan:
        empty = KindRows([], 0, 0, None, 0, 0)
        part = KindRows([], spec_rows, tokens, np.ones(spec_rows, dtype=np.int64), max_query_len, 50)
        return StepPlan((empty, part, empty), max_query_len, 50)

    draft = graphs.find(plan(3, 3, 1))
    assert (draft.family, draft.shape.counts[1]) == ("spec_draft", (4, 4))
    verify = next(f for f in graphs.families if f.name == "spec")
    assert verify.find(plan(3, 3, 1)).shape.counts[1] == (4, 16)
    assert graphs.find(plan(1, 4, 4)).shape.counts[1] == (1, 4)
    assert graphs.find(plan(2, 5, 4)).shape.counts[1] == (2, 8)
    assert graphs.find(plan(1, 5, 5)) is None  # a longer query than the graph's: eager


PIPE = {"method": "loop", "scheme": "pipeline", "draft_loops": 1, "adaptive": False, "disable_by_batch_size": None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculative, families", [(spec(3, 1), ("spec", "spec_draft")), (PIPE, ("pipe",))],
                         ids=["draft_verify", "pipeline"])
def test_real_cuda_graphs_equal_eager(tiny_gqa, params, speculative, families):
    """Both schemes' graph families (the pipeline's: tests/spec/test_pipeline_graphs.py)."""
    kw = {"model": str(tiny_gqa.path), "dtype": "float32", "device": "cuda", "skip_tokenizer_init": True,
          "block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128,
          "attention_backend": "triton", "num_kv_blocks": 512, "speculative_config": speculative}
    reqs, arrivals = requests(params)
    eng = LLMEngine(EngineArgs(**kw))
    assert eng.runner.graphs is not None
    graphed = drain(eng, reqs, arrivals)
    assert sum(eng.runner.graphs.replays[f] for f in families) > 20
    assert_same(graphed, drain(LLMEngine(EngineArgs(**kw, enforce_eager=True)), reqs, arrivals))
    plain = {k: v for k, v in kw.items() if k != "speculative_config"}
    assert_same(graphed, drain(LLMEngine(EngineArgs(**plain, enforce_eager=True)), reqs, arrivals))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative, family", [(spec(3, 1), "spec_mixed"), (PIPE, "pipe_mixed")],
                         ids=["draft_verify", "pipeline"])
def test_real_cuda_graphs_of_prompts_beside_speculating_rows_equal_eager(tiny_gqa, speculative, family):
    """The families of a prompt's chunk beside speculating rows as real CUDA graphs: requests arriving while
    others speculate, against the same engine eager and plain decoding."""
    kw = {"model": str(tiny_gqa.path), "dtype": "float32", "device": "cuda", "skip_tokenizer_init": True,
          "block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128,
          "attention_backend": "triton", "num_kv_blocks": 512}
    reqs = {f"s{i}": (ids(n, seed=n), GREEDY) for i, n in enumerate((5, 13, 8, 11))}
    arrivals = {"s1": 2, "s2": 9, "s3": 17}
    eng = LLMEngine(EngineArgs(**kw, speculative_config=speculative))
    graphed = drain(eng, reqs, arrivals)
    assert eng.runner.graphs.replays[family] >= 3
    assert_same(graphed, drain(LLMEngine(EngineArgs(**kw, speculative_config=speculative, enforce_eager=True)), reqs,
                               arrivals))
    assert_same(graphed, drain(LLMEngine(EngineArgs(**kw, enforce_eager=True)), reqs, arrivals))
