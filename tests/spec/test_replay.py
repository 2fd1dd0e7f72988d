"""Replayed acceptance (loopline/spec/replay.py), the cost-measurement hook of ``tools/spec_speed.py``: on random
weights (which accept no draft) the engine's counters follow the replayed probabilities for both schemes, the
engine runs fewer steps the more it accepts, and the draws are deterministic per (slot, completion index)."""
from __future__ import annotations

import pytest
import torch
from spec.test_engine import engine

from loopline import SamplingParams
from loopline.spec.replay import AcceptanceReplay

PROMPTS = {f"r{i}": [3 + (i * 37 + j * 11) % 250 for j in range(6 + 2 * i)] for i in range(2)}
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def run(tiny, scheme: str, probs: list[float] | None, loop_changes: list[float] | None = None, redraft: bool = True):
    spec = {"method": "loop", "num_speculative_tokens": 3, "draft_loops": 1, "scheme": scheme, "adaptive": False,
            "disable_by_batch_size": None, "redraft": redraft}
    eng = engine(str(tiny.path), speculative=spec)
    if probs is not None:
        eng.runner.spec.replay = AcceptanceReplay(probs, seed=1, loop_changes=loop_changes)
    outs = {}
    for rid, p in PROMPTS.items():
        eng.add_request(rid, {"prompt_token_ids": p}, PARAMS)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs.values())
    return eng.stats


# ~4.5-5.5 s each, slow. Default run: the counters against the reference's in
# spec/test_pipeline_engine.py::test_engine_steps_and_counters_as_the_reference, and the replayed acceptance
# in test_a_short_first_request_does_not_decide_for_the_engine below
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["draft_verify", "pipeline"])
def test_counters_follow_the_replayed_acceptance(tiny_gqa, scheme):
    # (the pipeline without re-drafting: re-drafted lanes are judged on their last draft, taken from a deeper
    # loop, which agrees with the target even on random weights)
    real = run(tiny_gqa, scheme, None, redraft=False)
    everything, nothing, half = (run(tiny_gqa, scheme, p) for p in ([1.0], [0.0], [0.5]))
    assert real.spec_num_accepted_tokens < 0.2 * real.spec_num_draft_tokens  # random weights: (nearly) none
    assert everything.spec_num_accepted_tokens == everything.spec_num_draft_tokens > 0
    assert nothing.spec_num_accepted_tokens == 0 < nothing.spec_num_draft_tokens
    # draft then verify counts a round's accepted prefix: (0.5 + 0.25 + 0.125) / 3 of its drafts; the pipeline
    # judges each lane's draft alone
    rate = half.spec_num_accepted_tokens / half.spec_num_draft_tokens
    assert rate == pytest.approx(0.875 / 3 if scheme == "draft_verify" else 0.5, abs=0.12), rate
    assert everything.steps < half.steps < nothing.steps


def test_per_position_probabilities_and_determinism():
    r = AcceptanceReplay([0.9, 0.5, 0.1], seed=3)
    slots = torch.arange(64).repeat_interleave(64)
    first = torch.arange(64).repeat(64) * 5
    a = r.accepted(slots, first, 4)
    assert torch.equal(a, r.accepted(slots, first, 4))  # the same draw for the same (slot, index)
    rates = a.double().mean(0)
    assert torch.allclose(rates, torch.tensor([0.9, 0.5, 0.1, 0.1], dtype=torch.float64), atol=0.03), rates
    # the draw of completion index i does not depend on the round it falls in
    assert torch.equal(r.accepted(slots, first + 1, 3)[:, :2].double().mean(0) > 0,
                       torch.tensor([True, True]))
    u = r.uniform(torch.zeros(10_000, dtype=torch.long), torch.arange(10_000))
    assert 0.48 < float(u.mean()) < 0.52 and float(u.min()) >= 0 and float(u.max()) < 1
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AcceptanceReplay([1.5])


@pytest.mark.parametrize("scheme", ["draft_verify", "pipeline"])
def test_a_short_first_request_does_not_decide_for_the_engine(tiny_gqa, scheme):
    """Speculation's defaults at one request with the demo model's replayed acceptance (which pays for both
    schemes at C = 1): a short first request (a warm-up, a health check) gives the engine a handful of rounds,
    too few to turn speculation off for the requests after it."""
    # (the cost model's payoff alone: with the throughput guard a first request decodes plainly, measuring plain
    # steps, test_step_clock.py)
    spec = {"method": "loop", "num_speculative_tokens": 3, "draft_loops": 1, "scheme": scheme, "throughput_guard": False}
    eng = engine(str(tiny_gqa.path), speculative=spec, max_num_seqs=1)
    eng.runner.spec.replay = AcceptanceReplay([0.89, 0.71, 0.68], seed=1)
    for rid, (p, n) in {"warm": (PROMPTS["r0"], 8), "a": (PROMPTS["r1"], 32), "b": (PROMPTS["r0"][::-1], 32)}.items():
        eng.add_request(rid, {"prompt_token_ids": p}, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        drafts = eng.stats.spec_num_drafts
        while eng.has_unfinished_requests():
            eng.step()
        if rid != "warm":
            assert eng.stats.spec_num_drafts - drafts >= 8, rid  # it speculated


def test_replayed_redrafting(tiny_gqa):
    """The pipeline's re-drafting replayed (``loop_changes``; the tiny model's 4 loops, d = 1, fixed depth): a
    draft is rejected only by a change at its exit loop, so with none there every draft commits accepted
    whatever the loops before it do, and changes at loops 2-3 cost steps (the lanes behind are dropped and
    re-enter); a change at the exit rejects drafts at its rate. Without re-drafting the replay judges at the
    exit only (its first probability), as before."""
    steady = run(tiny_gqa, "pipeline", [0.0], loop_changes=[0.0])
    churn = run(tiny_gqa, "pipeline", [0.0], loop_changes=[0.5, 0.5, 0.0])
    for stats in (steady, churn):
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert steady.steps < churn.steps
    rejecting = run(tiny_gqa, "pipeline", [1.0], loop_changes=[0.0, 0.0, 0.4])
    rate = rejecting.spec_num_accepted_tokens / rejecting.spec_num_draft_tokens
    assert rate == pytest.approx(0.6, abs=0.12), rate
    # re-drafting off: the changes are not drawn, every draft is judged by the first probability
    off = run(tiny_gqa, "pipeline", [0.0], loop_changes=[0.0], redraft=False)
    assert off.spec_num_accepted_tokens == 0 < off.spec_num_draft_tokens
