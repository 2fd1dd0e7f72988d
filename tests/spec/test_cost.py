"""The concurrency-1 cost model of both schemes, on match sequences whose rounds are worked out by hand."""
from __future__ import annotations

import pytest

from loopline.spec import cost


def test_draft_verify_all_accepted_commits_k_plus_one_per_round():
    r = cost.draft_verify([True] * 13, k=3, d=1, loops=4)  # 12 tokens after the first: 3 rounds of 4
    assert (r.rounds, r.tokens, r.accepted) == (3, 12, 9)
    assert r.rows == {1: 3 * 4 * 1, 4: 3 * 3}  # per round: (k+1)*d one-row steps, loops-d steps of k+1 rows
    assert r.passes_per_token == pytest.approx((4 + 3) / 4)


def test_draft_verify_all_rejected_commits_the_correction():
    r = cost.draft_verify([True] + [False] * 5, k=2, d=2, loops=4)
    assert (r.rounds, r.tokens, r.accepted) == (5, 5, 0)
    assert r.passes_per_token == pytest.approx(3 * 2 + 2)


def test_draft_verify_mixed_rounds():
    # round 1 accepts drafts 1 and 2 and commits the bonus 3 (whose draft would have missed: a bonus is never
    # drafted); round 2 accepts 4 and 5 and commits the bonus 6.
    m = [True, True, True, False, True, True, True]
    r = cost.draft_verify(m, k=2, d=1, loops=4)
    assert (r.rounds, r.tokens, r.accepted) == (2, 6, 4)


def test_pipeline_accepting_everything_costs_d_steps_per_token():
    r = cost.pipeline([True] * 101, d=1, loops=4)
    assert r.tokens == 100 and r.steps == 99 + 4
    assert r.rows[4] == 100 - 3  # steady state: four tokens in flight at loops 1..4


def test_pipeline_rejecting_everything_costs_the_full_depth_plus_wasted_rows():
    r = cost.pipeline([True] + [False] * 5, d=1, loops=4)
    # each token: 4 steps; behind row i the wrong draft and its own drafts (rows i+1, i+2, i+3) enter at its
    # steps 2, 3, 4 and are dropped; no row past the last one (row 4) starts
    assert r.tokens == 5 and r.steps == 20
    # rows 0, 1: 1, 2, 3, 4 rows a step; row 2: 1, 2, 3, 3; row 3: 1, 2, 2, 2; row 4 alone
    assert r.rows == {1: 8, 2: 6, 3: 4, 4: 2}


def test_step_costs_weight_the_rows():
    r = cost.draft_verify([True] * 5, k=1, d=1, loops=2)
    assert r.time({1: 1.0, 2: 3.0}) == pytest.approx(r.rows[1] + 3.0 * r.rows[2])
    assert r.time({1: 1.0}) is None


@pytest.mark.parametrize("fn", [lambda: cost.draft_verify([True], 2, 4, 4), lambda: cost.pipeline([True], 0, 4)])
def test_draft_depth_must_be_shallower(fn):
    with pytest.raises(ValueError, match="d="):
        fn()
