"""The depth pipeline (scheme 2, loopline.spec.reference with scheme="pipeline") is exact: greedy output, exit
depths and logprobs equal plain decoding's and the independent oracle's for every draft depth, at fixed depth and
with adaptive exits; EOS and max_tokens with rows in flight behind them cut where plain decoding stops; sampling
gives exactly the target's distribution (chi-square, failing with a broken correction); its steps are the cost
model's (loopline.spec.cost.pipeline) for the same draft matches."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from reference import reference_generate  # tests/ is on pythonpath (pyproject.toml)
from spec.test_sampling import (
    ALPHA,
    PROMPT,
    TEMPERATURE,
    broken_rejection_step,
    chi_square_pvalue,
    small_vocab_model,
    target_distribution,
)

import loopline.spec.reference as spec_reference
from loopline.models.loader import load_model, load_tokenizer
from loopline.models.plain import plain_generate
from loopline.models.tiny import default_checkpoint
from loopline.spec import SpeculativeConfig, cost
from loopline.spec.reference import PipelineOutput, speculative_generate

ORACLE_PROMPT = [5, 17, 33, 2, 9, 101, 44]


def pipeline(d: int, redraft: bool = True) -> SpeculativeConfig:
    return SpeculativeConfig(scheme="pipeline", draft_loops=d, redraft=redraft)


@pytest.fixture(scope="module")
def demo():
    return load_model(default_checkpoint(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo_prompt():
    # Text the demo model has seen the like of: its drafts are accepted often, and not always.
    return load_tokenizer(default_checkpoint()).encode("import os\nimport sys\n\n\ndef main(argv):\n    ")


@pytest.mark.parametrize("d", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_fixed_depth_greedy_equals_plain_decoding_and_the_cost_model(demo, demo_prompt, d):
    plain = plain_generate(demo, demo_prompt, 24, exit_threshold=1.0)
    # (the cost model replays drafts judged at their exit only: no re-drafting)
    out = speculative_generate(demo, demo_prompt, 24, pipeline(d, redraft=False), exit_threshold=1.0)
    assert isinstance(out, PipelineOutput)
    assert (out.tokens, out.exit_loops) == (plain.tokens, plain.exit_loops)
    assert out.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert all(out.drafted[1:-1]) and not out.drafted[0] and not out.drafted[-1]  # the last row drafts nothing
    assert 0 < out.dropped and 0 < sum(out.matches[1:]) < 23  # drafts accepted and rejected
    # at fixed depth a draft depends on loops 1..d only, so the matches replay every step exactly
    replay = cost.pipeline(out.matches, d, 4)
    assert (out.steps, out.rows) == (replay.steps, replay.rows)
    assert out.steps < 23 * 4  # plain decoding: 4 steps for each of the 23 tokens after the first


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_redrafting_takes_fewer_steps_and_changes_no_token(demo, demo_prompt, threshold):
    """Re-drafting (the default): a row looping past the draft loop whose head disagrees with the draft its
    successor started from restarts the successor at once. The same tokens, depths and logprobs as plain
    decoding; fewer drafts fail at their exit, and fewer steps (on this prompt, at both thresholds)."""
    plain = plain_generate(demo, demo_prompt, 32, exit_threshold=threshold)
    on = speculative_generate(demo, demo_prompt, 32, pipeline(1), exit_threshold=threshold)
    off = speculative_generate(demo, demo_prompt, 32, pipeline(1, redraft=False), exit_threshold=threshold)
    for out in (on, off):
        assert (out.tokens, out.exit_loops) == (plain.tokens, plain.exit_loops)
        assert out.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert sum(not m for m in on.matches) < sum(not m for m in off.matches)
    assert on.steps < off.steps


def test_default_and_auto_schemes_pipeline_one_request(demo, demo_prompt):
    """The reference has one request: the default scheme and ``auto`` (below its bound) pipeline it."""
    want = speculative_generate(demo, demo_prompt, 12, pipeline(1), exit_threshold=1.0)
    for spec in (SpeculativeConfig(), SpeculativeConfig(scheme="auto")):
        out = speculative_generate(demo, demo_prompt, 12, spec, exit_threshold=1.0)
        assert isinstance(out, PipelineOutput)
        assert (out.tokens, out.exit_loops, out.steps) == (want.tokens, want.exit_loops, want.steps)


@pytest.mark.parametrize("d", [1, pytest.param(2, marks=pytest.mark.slow), 3])  # (d = 2: ~3 s, slow)
def test_adaptive_exits_greedy_equals_plain_decoding(demo, demo_prompt, d):
    # threshold 0.5: the demo model's tokens exit at loops 1..4, before, at and after each draft depth
    plain = plain_generate(demo, demo_prompt, 24, exit_threshold=0.5)
    out = speculative_generate(demo, demo_prompt, 24, pipeline(d), exit_threshold=0.5)
    assert (out.tokens, out.exit_loops) == (plain.tokens, plain.exit_loops)
    assert out.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    depths = set(plain.exit_loops)  # (2, 3 and 4)
    assert len(depths) > 1 and max(depths) > d and any(out.drafted)
    if min(depths) <= d:
        assert not all(out.drafted[1:-1])  # a token whose predecessor exits by loop d is never drafted


@pytest.mark.parametrize("threshold, min_loops, max_loops", [(1.0, 1, 4), (0.5, 1, 4), (0.3, 2, 4), (0.6, 1, 3)])
@pytest.mark.parametrize("d", [1, 2])
def test_greedy_equals_the_independent_oracle(tiny_gqa, d, threshold, min_loops, max_loops):
    tiny = load_model(tiny_gqa.path, dtype=torch.float32).eval()
    tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, ORACLE_PROMPT, 12,
                                                  min_loops=min_loops, max_loops=max_loops, exit_threshold=threshold)
    out = speculative_generate(tiny, ORACLE_PROMPT, 12, pipeline(d), exit_threshold=threshold, min_loops=min_loops,
                               max_loops=max_loops)
    assert (out.tokens, out.exit_loops) == (tokens, depths)
    assert out.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_eos_and_max_tokens_with_rows_in_flight(demo, demo_prompt):
    # max_tokens 1, 2 and 3 (the first token, the first drafted one, one after a verdict), then later ones;
    # EOS at the first 4 tokens that have no earlier copy (every length and every EOS took ~13 s on 2 cores)
    full = plain_generate(demo, demo_prompt, 14, exit_threshold=1.0)
    for n in (1, 2, 3, 5, 8, 14):
        out = speculative_generate(demo, demo_prompt, n, pipeline(1), exit_threshold=1.0)
        assert (out.tokens, out.exit_loops) == (full.tokens[:n], full.exit_loops[:n])
    stopped = 0
    for j in range(1, 14):
        if full.tokens[j] in full.tokens[:j]:
            continue  # an earlier copy would stop first
        out = speculative_generate(demo, demo_prompt, 14, pipeline(1), exit_threshold=1.0, eos_ids=[full.tokens[j]])
        assert (out.tokens, out.exit_loops) == (full.tokens[:j + 1], full.exit_loops[:j + 1])
        stopped += 1
        if stopped == 4:
            break
    assert stopped == 4


def test_a_pipeline_without_the_verdict_is_caught(demo, demo_prompt, monkeypatch):
    # every draft accepted: the greedy test above must see the difference
    monkeypatch.setattr(spec_reference, "_judge", lambda p, q, draft, t, g: (True, draft))
    out = speculative_generate(demo, demo_prompt, 24, pipeline(1), exit_threshold=1.0)
    assert out.tokens != plain_generate(demo, demo_prompt, 24, exit_threshold=1.0).tokens


# --- sampling ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab():
    return small_vocab_model()


def _counts(model, runs: int, n_tokens: int, d: int, threshold: float) -> Counter:
    """Counts of the first ``n_tokens - 1`` tokens of ``n_tokens``-token runs: the last row drafts nothing (no row
    runs past max_tokens), so the tokens before it are the ones whose drafts were judged."""
    return Counter(tuple(speculative_generate(model, PROMPT, n_tokens, pipeline(d), temperature=TEMPERATURE, seed=s,
                                              exit_threshold=threshold).tokens[:-1]) for s in range(runs))


def _check(small_vocab, monkeypatch, runs: int, n_tokens: int, d: int, threshold: float) -> None:
    model, state, cfg = small_vocab
    probs = target_distribution(state, cfg, n_tokens - 1, threshold)
    assert chi_square_pvalue(_counts(model, runs, n_tokens, d, threshold), probs, runs) > ALPHA
    monkeypatch.setattr(spec_reference, "rejection_step", broken_rejection_step)
    assert chi_square_pvalue(_counts(model, runs, n_tokens, d, threshold), probs, runs) < ALPHA


def test_seeded_runs_are_reproducible(small_vocab):
    model = small_vocab[0]
    a, b = (speculative_generate(model, PROMPT, 10, pipeline(1), temperature=1.0, seed=7) for _ in range(2))
    assert (a.tokens, a.exit_loops, a.matches, a.steps) == (b.tokens, b.exit_loops, b.matches, b.steps)
    assert not all(a.matches) and a.dropped > 0  # the correction path runs


@pytest.mark.slow  # ~30 s on 2 cores. Default run: test_seeded_runs_are_reproducible runs the pipeline's correction,
# spec/test_sampling.py::test_rejection_step_samples_the_target checks the step's distribution, and
# spec/test_engine_sampling.py::test_output_distribution_is_the_target the engine's
def test_two_token_distribution_is_the_target(small_vocab, monkeypatch):
    # 3-token runs: the first token comes from the prompt, the second is drafted and judged
    # (p = 0.054 here against 3e-7 with the broken correction)
    _check(small_vocab, monkeypatch, 400, 3, 1, 1.0)


@pytest.mark.slow
# threshold 0.7: tokens exit at several depths, some inside the draft (no verdict), some after it
@pytest.mark.parametrize("d, threshold", [(2, 1.0), (1, 0.7), (3, 1.0)])
def test_three_token_distribution_is_the_target(small_vocab, monkeypatch, d, threshold):
    # (1500 runs at d=1, threshold 0.7: p = 0.65 against 1e-23 with the broken correction)
    _check(small_vocab, monkeypatch, 1500, 4, d, threshold)
