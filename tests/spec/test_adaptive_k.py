"""Drafts per round adapt to each request's acceptance (#41, docs/speculation.md "How many drafts"):
``num_speculative_tokens`` is the most; once warm, a request's rounds draft as many as its measured
acceptance makes pay best at the current load. What must hold: a round of fewer drafts than K commits
exactly what plain decoding gives (greedy and seeded, eager and through the speculative graphs, with
rounds of different sizes in one step), the counters count the drafts each round proposed, and the
choice follows the cost model (short rounds at low acceptance, long ones at high)."""
from __future__ import annotations

import itertools

import pytest
from graph_testing import EagerCapturer
from spec.test_engine import DEMO_PROMPTS, GREEDY, assert_same, drain, engine, spec

from loopline.core.contracts import SampledToken
from loopline.core.request import Request
from loopline.core.speculation import (
    WARMUP_ROUNDS,
    LoopSpeculation,
    best_k,
    round_cost,
    round_yield,
)
from loopline.sampling_params import SamplingParams
from loopline.spec import SpeculativeConfig


@pytest.fixture(scope="module")
def demo_prompts():
    from loopline.models.loader import load_tokenizer
    from loopline.models.tiny import default_checkpoint

    tok = load_tokenizer(default_checkpoint())
    return [tok.encode(p) for p in DEMO_PROMPTS]


def test_round_yield_and_the_best_k_follow_the_cost_model():
    assert round_yield(0.0, 3) == 1.0 and round_yield(1.0, 3) == 4.0
    assert round_yield(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # the most saved per cost: every k compared by hand
    for accept, running in itertools.product((0.3, 0.6, 0.8, 0.95), (1, 8, 32)):
        ratios = [round_yield(accept, k) / round_cost(k, 1, 4, running) for k in range(1, 9)]
        assert best_k(accept, 8, 1, 4, running) == 1 + ratios.index(max(ratios))
    assert best_k(0.3, 8, 1, 4, 1) == 1  # a rejected draft wastes the positions after it
    assert best_k(0.95, 8, 1, 4, 1) >= 6  # the verify's fixed cost spread over many tokens
    assert best_k(0.95, 3, 1, 4, 1) == 3  # never more than num_speculative_tokens


def _warm(s: LoopSpeculation, accepted: int, drafts: int, rounds: int = WARMUP_ROUNDS) -> Request:
    req = Request("a", [1, 2], SamplingParams(max_loops=4), 0, 8, frozenset(), 0)
    for _ in range(rounds):
        s.observe(req, [SampledToken(token_id=1, exit_depth=4)] * (accepted + 1), 1, drafts)
    return req


def test_a_warm_request_drafts_as_many_as_its_acceptance_pays():
    s = LoopSpeculation(SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=6, draft_loops=1), 4)
    every = _warm(s, 6, 6)  # every draft accepted: acceptance 1, the longest rounds
    assert every.spec_hits / every.spec_tries == pytest.approx(1.0)
    s.plan_round(every, 4, 1)
    assert every.spec_k == 6
    half = _warm(s, 1, 6)  # one draft accepted, the second rejected, every round: acceptance 1/2
    assert half.spec_hits / half.spec_tries == pytest.approx(0.5)
    s.plan_round(half, 4, 1)
    assert half.spec_k == best_k(0.5, 6, 1, 4, 1) < 6
    cold = _warm(s, 1, 6, rounds=WARMUP_ROUNDS - 1)  # not warm yet: K
    s.plan_round(cold, 4, 1)
    assert cold.spec_k == 6
    fixed = LoopSpeculation(SpeculativeConfig(scheme="draft_verify",
                                              num_speculative_tokens=6, draft_loops=1, adaptive=False), 4)
    req = _warm(fixed, 1, 6)
    fixed.plan_round(req, 4, 1)
    assert req.spec_k == 6  # adaptive off: always K


def cycling(monkeypatch, sizes: list[int]) -> list[int]:
    """Rounds draft ``sizes`` in turn (whatever the acceptance): rounds of every size, mixed in steps.
    Returns the sizes planned, in order."""
    planned, turn = [], itertools.cycle(sizes)

    def plan_round(self, req, max_loops, running):
        if req.spec_k == 0 or req.spec_step == 0:
            req.spec_k = next(turn)
            planned.append(req.spec_k)

    monkeypatch.setattr(LoopSpeculation, "plan_round", plan_round)
    return planned


@pytest.mark.parametrize("params, graphs, scheme", [
    (GREEDY, False, "draft_verify"), (GREEDY.clone(temperature=0.8, seed=7, top_k=20), True, "draft_verify"),
    (GREEDY, False, "auto")])
def test_rounds_of_fewer_drafts_equal_plain_decoding(demo_prompts, monkeypatch, params, graphs, scheme):
    """Rounds of 1, 3 and 2 drafts (K = 3) in turn, four requests, two arriving later: tokens, exit
    depths and logprobs equal the plain engine's; every step of speculative rows in the graph case
    replays one of the speculative families. Under ``auto`` the first request pipelines beside the
    others' rounds."""
    reqs = {f"r{i}": (p, params.clone(max_tokens=20)) for i, p in enumerate(demo_prompts)}
    arrivals = {"r2": 4, "r3": 7}
    kw = {"max_num_batched_tokens": 64, "max_model_len": 128, "max_num_seqs": 8}
    plain = drain(engine(**kw), reqs, arrivals)
    planned = cycling(monkeypatch, [1, 3, 2])
    eng = engine(speculative=spec(3, 1) | {"scheme": scheme, "auto_pipeline_below": 1 + (scheme == "auto")}, **kw)
    if graphs:
        eng.runner.capture_graphs(128, 64, max_prefill_rows=3, capturer=EagerCapturer())
    assert_same(drain(eng, reqs, arrivals), plain)
    assert {1, 2, 3} <= set(planned)
    stats = eng.stats
    # each round proposed its own drafts: between 1 and 3 a round, not K each
    assert stats.spec_num_drafts <= stats.spec_num_draft_tokens < 3 * stats.spec_num_drafts
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    if graphs:
        replays = eng.runner.graphs.replays
        assert replays["spec"] > 5 and replays["spec_draft"] > 5


def test_the_engine_adapts_drafts_on_the_demo_model(demo_prompts):
    """With adaptive on (the default), K = 6 and one request at a time: cold rounds draft K, warm ones what
    the request's measured acceptance makes pay (:func:`best_k`), and the output stays plain decoding's."""
    reqs = {"r0": (demo_prompts[0], GREEDY.clone(max_tokens=64))}
    eng = engine(speculative={"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 6, "draft_loops": 1,
                              "disable_by_batch_size": None, "throughput_guard": False})
    seen = []
    plan = eng.scheduler.speculation.plan_round

    def recording(req, max_loops, running):
        plan(req, max_loops, running)
        accept = req.spec_hits / req.spec_tries if req.spec_tries else None
        seen.append((req.spec_rounds, accept, max_loops, running, req.spec_k))

    eng.scheduler.speculation.plan_round = recording
    assert_same(drain(eng, reqs), drain(engine(), reqs))
    warm = [s for s in seen if s[0] >= WARMUP_ROUNDS]
    assert warm and all(k == 6 for rounds, *_, k in seen if rounds < WARMUP_ROUNDS)
    for _, accept, max_loops, running, k in warm:
        assert k == best_k(accept, 6, 1, max_loops, running)
