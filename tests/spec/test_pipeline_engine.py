"""The depth pipeline in the engine (#41, scheme 2; loopline.worker.pipe_rows, loopline.core.speculation):
every committed token, exit depth and logprob is what the non-speculative engine gives, for d = 1, 2, 3, at
fixed depth and with adaptive exits (before, at and after d), single and batched requests mixed with
plain ones and with chunked prefill, with max_tokens / stop tokens / stop strings / EOS inside a committed
run, abort, preemption and resume (lanes in flight dropped), prefix caching, seeded sampling, and the
switches that return a request to plain decoding; the greedy tokens also equal the independent oracle's
(tests/reference.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import reference_generate
from spec.test_engine import DEMO_PROMPTS, GREEDY, assert_same, drain, engine, ids

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.errors import InvalidRequestError


def pipe(d: int, **kw) -> dict:
    """The pipeline pinned on (no adaptive stop, no batch bound) unless ``kw`` says otherwise."""
    return {"method": "loop", "scheme": "pipeline", "draft_loops": d, "adaptive": False,
            "disable_by_batch_size": None, **kw}


@pytest.fixture(scope="module")
def demo_prompts():
    from loopline.models.loader import load_tokenizer
    from loopline.models.tiny import default_checkpoint

    tok = load_tokenizer(default_checkpoint())
    return [tok.encode(p) for p in DEMO_PROMPTS]


@pytest.fixture(scope="module")
def plain_fixed(demo_prompts):
    """Plain decoding of the four demo prompts at fixed depth, two arriving late."""
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(demo_prompts)}
    return reqs, drain(engine(), reqs, arrivals={"r2": 5, "r3": 9})


# --- greedy, fixed depth ----------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, pytest.param(2, marks=pytest.mark.slow), 3])  # (d = 2: the seeded test)
def test_greedy_fixed_depth_equals_plain_engine(plain_fixed, d):
    reqs, plain = plain_fixed
    eng = engine(speculative=pipe(d))
    assert_same(drain(eng, reqs, arrivals={"r2": 5, "r3": 9}), plain)


@pytest.mark.parametrize("async_scheduling", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_one_request_commits_more_than_a_token_per_plain_token_time(demo_prompts, async_scheduling):
    reqs = {"r": (demo_prompts[0], GREEDY)}
    plain_eng = engine(async_scheduling=async_scheduling)
    plain = drain(plain_eng, reqs)
    eng = engine(speculative=pipe(1), async_scheduling=async_scheduling)
    assert_same(drain(eng, reqs), plain)
    # fixed depth: plain decoding takes 4 steps a token; the demo model's d=1 drafts are mostly right
    assert eng.stats.steps < 0.6 * plain_eng.stats.steps


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_equals_the_independent_oracle_on_a_tiny_model(tiny_gqa, async_scheduling):
    prompts = [ids(5, 1), ids(11, 2), ids(3, 3)]
    reqs = {f"r{i}": (p, GREEDY.clone(max_tokens=10, logprobs=0)) for i, p in enumerate(prompts)}
    out = drain(engine(str(tiny_gqa.path), pipe(1), block_size=4, async_scheduling=async_scheduling), reqs)
    for i, p in enumerate(prompts):
        tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 10)
        got = out[f"r{i}"]
        assert got.token_ids == tokens and got.exit_depths == depths
        assert [next(iter(e.values())).logprob for e in got.logprobs] == pytest.approx(logprobs, abs=1e-4)


# --- adaptive exits ---------------------------------------------------------------------------------
# default run: d = 1 (exits before, at and after it; d = 2 with adaptive exits: the seeded test); the others ~3-6 s
@pytest.mark.parametrize("d, exit_kw", [
    (1, {"exit_threshold": 0.5}),
    pytest.param(2, {"exit_threshold": 0.5}, marks=pytest.mark.slow),
    pytest.param(3, {"exit_threshold": 0.7}, marks=pytest.mark.slow),
    pytest.param(1, {"exit_threshold": 0.5, "min_loops": 2}, marks=pytest.mark.slow),
    pytest.param(2, {"exit_threshold": 0.3, "max_loops": 3}, marks=pytest.mark.slow),
])
def test_adaptive_exit_depths_equal_plain_decoding(demo_prompts, d, exit_kw):
    """Each lane runs its token's own exit rule: exits before, at and after the draft depth give plain
    decoding's depths, tokens and logprobs (a lane exiting at e <= d hands its target token to the next)."""
    params = GREEDY.clone(**exit_kw)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(demo_prompts)}
    plain = drain(engine(), reqs, arrivals={"r1": 4})
    assert_same(drain(engine(speculative=pipe(d)), reqs, arrivals={"r1": 4}), plain)
    depths = {e for o in plain.values() for e in o.exit_depths}
    assert len(depths) > 1, "the thresholds must make tokens exit at different depths"
    if d < 3 and exit_kw.keys() == {"exit_threshold"}:
        assert min(depths) <= d < max(depths), "exits at or before and after the draft depth"


def test_adaptive_exits_equal_the_independent_oracle(tiny_gqa):
    prompts = [ids(7, 4), ids(4, 5)]
    reqs = {f"r{i}": (p, GREEDY.clone(max_tokens=12, exit_threshold=0.6, logprobs=0)) for i, p in enumerate(prompts)}
    out = drain(engine(str(tiny_gqa.path), pipe(2), block_size=4), reqs)
    for i, p in enumerate(prompts):
        tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 12, exit_threshold=0.6)
        assert out[f"r{i}"].token_ids == tokens and out[f"r{i}"].exit_depths == depths
        assert [next(iter(e.values())).logprob for e in out[f"r{i}"].logprobs] == pytest.approx(logprobs, abs=1e-4)


# --- batches ----------------------------------------------------------------------------------------
@pytest.mark.slow  # ~5-10 s on 2 cores. Default run: plain rows beside speculating ones in
# spec/test_engine.py::test_speculating_requests_batch_with_plain_ones, and the batches (with arrivals) of
# test_greedy_fixed_depth_equals_plain_engine
def test_pipelining_requests_batch_with_plain_ones_and_chunked_prefill(demo_prompts):
    """A request with a too shallow max_loops or speculate=False decodes plainly beside pipelining ones (one of
    them with a penalty), while a long prompt arrives in chunks (a small token budget) next to their lanes."""
    long_prompt = (demo_prompts[0] + demo_prompts[1]) * 3
    reqs = {"p0": (demo_prompts[0], GREEDY), "pen": (demo_prompts[1], GREEDY.clone(repetition_penalty=1.3)),
            "p1": (demo_prompts[2], GREEDY.clone(max_tokens=17)),
            "shallow": (demo_prompts[3], GREEDY.clone(max_loops=1)),
            "off": (demo_prompts[3], GREEDY.clone(speculate=False)),
            "long": (long_prompt, GREEDY.clone(max_tokens=8))}
    arrivals = {"p1": 3, "long": 6}
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 8}
    out = drain(engine(speculative=pipe(1), **kw), reqs, arrivals=arrivals)
    assert_same(out, drain(engine(**kw), reqs, arrivals=arrivals))


def test_prefix_caching(demo_prompts):
    shared = demo_prompts[0] * 4
    reqs = {"a": (shared + demo_prompts[1], GREEDY.clone(max_tokens=12)),
            "b": (shared + demo_prompts[2], GREEDY.clone(max_tokens=12))}
    eng = engine(speculative=pipe(2), enable_prefix_caching=True, block_size=8)
    out = drain(eng, reqs, arrivals={"b": 30})
    assert eng.kv.prefix_cache.stats.hits >= len(shared) - 8  # b's prompt starts from a's pages
    assert_same(out, drain(engine(), reqs, arrivals={"b": 30}))


# --- stops inside a committed run (stop ids, EOS, stop strings: tests/spec/test_engine.py, both schemes) ----
@pytest.mark.parametrize("max_tokens", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow),
                                        pytest.param(5, marks=pytest.mark.slow), 7])
def test_max_tokens_inside_a_committed_run(demo_prompts, max_tokens):
    reqs = {"r": (demo_prompts[0], GREEDY.clone(max_tokens=max_tokens, exit_threshold=0.5))}
    out = drain(engine(speculative=pipe(1)), reqs)
    assert len(out["r"].token_ids) == max_tokens and out["r"].finish_reason == "length"
    assert_same(out, drain(engine(), reqs))


# --- preemption (abort mid-flight: tests/spec/test_engine.py, both schemes) ---------------------------------
# default run: the overlapped engine (test_engine_steps_and_counters_as_the_reference runs the synchronous one)
@pytest.mark.parametrize("async_scheduling", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_preemption_drops_lanes_and_resumes_exactly(tiny_gqa, async_scheduling):
    reqs = {f"r{i}": (ids(6 + 2 * i, seed=20 + i), GREEDY.clone(max_tokens=14, exit_threshold=0.7, logprobs=0))
            for i in range(4)}
    roomy = drain(engine(str(tiny_gqa.path), block_size=4), reqs)
    eng = engine(str(tiny_gqa.path), pipe(1), block_size=4, kv_allocation="incremental",
                 enable_preemption=True, num_kv_blocks=4 * 16, async_scheduling=async_scheduling)
    tight = drain(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    assert_same(tight, roomy)
    assert not eng.runner.pages.snapshots


# --- sampling ---------------------------------------------------------------------------------------
# default run: d = 2 with top-p and adaptive exits; d = 1 with top-k (~6-7 s) is slow
@pytest.mark.parametrize("d, kw", [pytest.param(1, {"top_k": 20}, marks=pytest.mark.slow),
                                   (2, {"top_p": 0.9, "exit_threshold": 0.5})])
def test_seeded_sampling_equals_plain_seeded_sampling(demo_prompts, d, kw):
    """Drafts use the (seed, token index) noise of the token they stand for, so committed tokens are plain
    seeded sampling's, token for token, with the target's logprobs."""
    params = SamplingParams(**{"max_tokens": 20, "temperature": 0.8, "ignore_eos": True, "logprobs": 2,
                               "exit_threshold": 1.0, **kw})
    reqs = {f"r{i}": (p, params.clone(seed=11 + i)) for i, p in enumerate(demo_prompts[:3])}
    assert_same(drain(engine(speculative=pipe(d)), reqs), drain(engine(), reqs))


# --- configuration ----------------------------------------------------------------------------------
def test_shared_layout_is_refused_naming_the_field():
    with pytest.raises(InvalidRequestError, match="kv_layout='last_exited'") as e:
        EngineArgs(speculative_config=pipe(1), kv_layout="shared").validate()
    assert e.value.param == "kv_layout"


# --- switching off, metrics -------------------------------------------------------------------------
def test_disable_by_batch_size_drops_lanes_mid_flight_exactly(demo_prompts):
    """Pipelining stops (lanes in flight dropped) once two requests run; outputs stay plain decoding's."""
    reqs = {f"r{i}": (p, GREEDY.clone(exit_threshold=0.5)) for i, p in enumerate(demo_prompts[:3])}
    arrivals = {"r1": 12, "r2": 13}
    eng = engine(speculative=pipe(1, disable_by_batch_size=2))
    out = drain(eng, reqs, arrivals=arrivals)
    assert_same(out, drain(engine(), reqs, arrivals=arrivals))
    assert eng.stats.spec_num_draft_tokens > 0  # r0 pipelined while alone
    assert all(not r.speculative for r in eng.scheduler.running)


def test_adaptive_stop_returns_to_plain_decoding_exactly(tiny_gqa):
    """Random weights: d=1 drafts are rarely right, so the adaptive stop turns the pipeline off mid-flight."""
    reqs = {f"r{i}": (ids(5 + i, seed=40 + i), GREEDY.clone(max_tokens=24, logprobs=0)) for i in range(2)}
    pinned = engine(str(tiny_gqa.path), pipe(1), block_size=4)
    drain(pinned, reqs)
    eng = engine(str(tiny_gqa.path), pipe(1, adaptive=True, throughput_guard=False), block_size=4)
    out = drain(eng, reqs)
    assert_same(out, drain(engine(str(tiny_gqa.path), block_size=4), reqs))
    assert 0 < eng.stats.spec_num_draft_tokens < pinned.stats.spec_num_draft_tokens


def test_spec_decode_counters_count_judged_drafts(demo_prompts):
    """Each judged draft is a round of one draft (vLLM's counters): at fixed depth with d=1 every committed
    token but the prompt's first and the last is input to a lane that entered with a draft (no lane enters
    for a token past max_tokens), judged when the lane before it exits."""
    eng = engine(speculative=pipe(1))
    drain(eng, {"r": (demo_prompts[0], GREEDY)})
    st = eng.stats
    assert st.spec_num_drafts == st.spec_num_draft_tokens == GREEDY.max_tokens - 2
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.spec_accepted_per_pos == [st.spec_num_accepted_tokens]
    assert st.spec_mean_acceptance_length == pytest.approx(1 + st.spec_num_accepted_tokens / st.spec_num_drafts)


def test_drafts_and_targets_share_one_head_pass_a_step(demo_prompts, monkeypatch):
    """Without a draft adapter a drafting lane's head output is its target row's: a step runs the head once
    over every lane (one read of the output projection, not two), and the tokens are plain decoding's."""
    from loopline.worker.draft_head import DraftHead
    from loopline.worker.pipe_rows import PipeRounds

    calls = {"lanes": 0, "verify": 0, "draft_head": 0}
    lanes_head, verify_part = PipeRounds._lanes_head, PipeRounds.verify_part

    def counted_lanes(self, slots):
        calls["lanes"] += 1
        return lanes_head(self, slots)

    def counted_verify(self, rows, row0):
        part = verify_part(self, rows, row0)
        calls["verify"] += part is not None
        return part

    def draft_head(self, hidden, live):
        calls["draft_head"] += 1
        raise AssertionError("no adapter: the drafts take the lanes' head pass")

    monkeypatch.setattr(PipeRounds, "_lanes_head", counted_lanes)
    monkeypatch.setattr(PipeRounds, "verify_part", counted_verify)
    monkeypatch.setattr(DraftHead, "__call__", draft_head)
    reqs = {"r": (demo_prompts[0], GREEDY)}
    plain = drain(engine(), reqs)
    assert_same(drain(engine(speculative=pipe(1)), reqs), plain)
    assert calls["verify"] > 10 and calls["lanes"] == calls["verify"] and calls["draft_head"] == 0


def test_rounds_launch_few_ops_after_the_forward(demo_prompts, monkeypatch):
    """What a pipelining step runs outside its CUDA graph, per step at one request, counted as torch ops
    (each a launch on a GPU) with the slot ops as one launch each (one kernel each in TritonSlotOps): the
    drafts (lanes, one head pass over every lane, sampling, store) and the lanes' targets stay within the
    budget docs/speculation.md gives (~16 and ~6), so a change that adds launches to every step shows here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from loopline.worker.decode_state import SlotOps
    from loopline.worker.pipe_rows import PipeRounds

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = {"draft": [], "verify_part": []}
    for name in counts:
        method = getattr(PipeRounds, name)

        def counted(self, *args, _method=method, _name=name):
            before = Count.n
            with Count():
                out = _method(self, *args)
            counts[_name].append(Count.n - before)
            return out

        monkeypatch.setattr(PipeRounds, name, counted)
    for name in ("pipe_draft_lanes", "pipe_store_draft"):  # one launch each, as their kernels are
        op = getattr(SlotOps, name)

        def one_launch(self, *args, _op=op):
            with torch.utils._python_dispatch._disable_current_modes():
                out = _op(self, *args)
            Count.n += 1
            return out

        monkeypatch.setattr(SlotOps, name, one_launch)
    drain(engine(speculative=pipe(1)), {"r": (demo_prompts[0], GREEDY)})
    assert len(counts["draft"]) > 10 and len(counts["verify_part"]) == len(counts["draft"])
    # (the first step also builds the drafts' sampling parameters once)
    assert max(counts["draft"][1:]) <= 18 and max(counts["verify_part"]) <= 8, counts


# --- through LLM and AsyncLLM -----------------------------------------------------------------------
@pytest.mark.slow  # an engine process (~8-15 s on 2 cores). Default run: spec/test_engine.py::
# test_async_llm_streams_accepted_runs streams speculation through AsyncLLM, docs/speculation.md's pipeline
# block runs LLM.generate with it
def test_llm_generate_and_async_llm_stream_equal_plain_decoding(demo_prompts):
    """``LLM.generate`` and AsyncLLM's DELTA stream (the serving path) with the pipeline: the committed runs
    arrive in order and the completions equal plain decoding's."""
    import asyncio

    from loopline import LLM, AsyncLLM
    from loopline.sampling_params import RequestOutputKind

    params = GREEDY.clone(max_tokens=20, exit_threshold=0.5)
    plain = drain(engine(), {"r": (demo_prompts[0], params)})["r"]
    llm = LLM(device="cpu", dtype="float32", speculative_config=pipe(1))
    (out,) = llm.generate([{"prompt_token_ids": demo_prompts[0]}], params, use_tqdm=False)
    assert_same({"r": out.outputs[0]}, {"r": plain})

    async def stream(alm) -> list[int]:
        delta = params.clone(output_kind=RequestOutputKind.DELTA, logprobs=None)
        return [t async for o in alm.generate({"prompt_token_ids": demo_prompts[0]}, delta, "r")
                for t in o.outputs[0].token_ids]

    alm = AsyncLLM(EngineArgs(device="cpu", dtype="float32", max_num_seqs=2, speculative_config=pipe(1)))
    try:
        assert asyncio.run(stream(alm)) == plain.token_ids
    finally:
        alm.shutdown()


# --- across engines -----------------------------------------------------------------------------------
# worker processes (~15-18 s each on 2 cores). Default run: spec/test_distributed.py's decode worker resumes a
# handed-off request and speculates; the pipeline's resume after a preemption (lanes dropped) is tested above
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pd", "dp"])
def test_pd_decode_workers_and_dp_replicas_pipeline(tiny_gqa, layout):
    """A PD decode worker resumes a handed-off request with an empty lane ring and pipelines it; each DP
    replica pipelines its own requests; outputs equal one plain engine's (tests/spec/test_distributed.py's
    workload: greedy and seeded, adaptive exits)."""
    from spec.test_distributed import BASE, plain_outputs, served, settled, workload
    from spec.test_distributed import assert_same as assert_same_outputs

    from loopline import AsyncLLM

    requests = workload()
    scale = {"prefill_workers": 1, "decode_workers": 1, "max_num_batched_tokens": 8} if layout == "pd" \
        else {"data_parallel_size": 2}
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), speculative_config=pipe(1), **scale, **BASE))
    try:
        got = served(llm, requests)
        snaps = settled(llm)
    finally:
        llm.shutdown()
    assert_same_outputs(got, plain_outputs(tiny_gqa, requests))
    if layout == "pd":  # (replicas: the prefill worker, then the decode worker)
        assert len(snaps) == 2 and snaps[0].spec_num_draft_tokens == 0
        snaps = snaps[1:]
    assert all(s.spec_num_draft_tokens > 0 for s in snaps)


# default run: threshold 0.7 (lanes judged accepted, then dropped); fixed depth, d = 2 and a stop token (~2-8 s) slow
# (a stop inside a committed run: spec/test_engine.py::test_stop_token_eos_and_stop_string_inside_an_accepted_run)
@pytest.mark.parametrize("d, threshold, prompt, stop, redraft", [
    pytest.param(1, 1.0, 0, False, True, marks=pytest.mark.slow), pytest.param(2, 0.5, 0, False, True, marks=pytest.mark.slow),
    (1, 0.7, 1, False, True), pytest.param(1, 0.7, 1, False, False, marks=pytest.mark.slow),
    pytest.param(1, 1.0, 0, False, False, marks=pytest.mark.slow), pytest.param(1, 0.5, 0, True, True, marks=pytest.mark.slow)])
def test_engine_steps_and_counters_as_the_reference(demo_prompts, d, threshold, prompt, stop, redraft):
    """The engine's pipeline takes the reference's decode steps to the step (a draft entering a step late,
    or a lane missing its draft, shows here even where outputs stay exact): tools/spec_pipeline_engine_steps.py.
    Its spec_decode counters are the reference's drafted and accepted committed tokens: a verdict counts when
    its lane commits (at threshold 0.5 lanes exit before their predecessors, whose later rejection drops
    lanes judged accepted; counting at the judgement gave 31 drafts for the reference's 30 at 0.7), and no lane
    enters behind a stop token (``stop``: one inside the output). Re-drafting (the default) and without it."""
    import torch

    from loopline.models.loader import load_model
    from loopline.models.tiny import default_checkpoint
    from loopline.spec import SpeculativeConfig
    from loopline.spec.reference import speculative_generate

    model = load_model(default_checkpoint(), dtype=torch.float32).eval()
    config = SpeculativeConfig(scheme="pipeline", draft_loops=d, redraft=redraft)
    stop_ids: list[int] = []
    with torch.no_grad():
        ref = speculative_generate(model, demo_prompts[prompt], 32, config, exit_threshold=threshold)
        if stop:  # a token first generated well inside the run ends it
            k = next(i for i in range(8, 32) if ref.tokens[i] not in ref.tokens[:i])
            stop_ids = [ref.tokens[k]]
            ref = speculative_generate(model, demo_prompts[prompt], 32, config, exit_threshold=threshold, eos_ids=stop_ids)
            assert len(ref.tokens) == k + 1
        if redraft and threshold > 0.5:  # the case re-drafts: its steps are not those without it (at 0.5 these
            # prompts' rows mostly exit by loop 2, and no re-draft changes the steps)
            assert ref.steps != speculative_generate(model, demo_prompts[prompt], 32, dataclasses.replace(
                config, redraft=False), exit_threshold=threshold, eos_ids=stop_ids).steps
    eng = engine(speculative=pipe(d) | {"redraft": redraft}, async_scheduling=False)
    out = drain(eng, {"r": (demo_prompts[prompt], GREEDY.clone(max_tokens=32, exit_threshold=threshold,
                                                          stop_token_ids=stop_ids))})
    assert out["r"].token_ids == list(ref.tokens)
    assert eng.stats.steps - eng.stats.prefill_steps == ref.steps
    assert eng.stats.spec_num_draft_tokens == sum(ref.drafted)
    assert eng.stats.spec_num_accepted_tokens == sum(a and m for a, m in zip(ref.drafted, ref.matches))
