"""Speculative rejection sampling gives exactly the target's distribution: chi-square tests of many seeded
runs against the exact non-speculative distribution (enumerated with the independent oracle), each shown
to fail when the correction is broken (rejected drafts resampled from the target instead of max(p - q, 0))."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from reference import (  # tests/ is on pythonpath (pyproject.toml)
    exit_depth,
    reference_forward,
)

import loopline.spec.reference as spec_reference
from loopline.models.ouro import OuroConfig, OuroForCausalLM
from loopline.models.tiny import random_state_dict
from loopline.spec import SpeculativeConfig
from loopline.spec.reference import rejection_step, speculative_generate

ALPHA = 1e-3  # a correct sampler fails one run in a thousand; the broken ones fail far below it


def broken_rejection_step(p, q, draft, generator):
    """The classic bug: a rejected draft is replaced by a sample of the target itself."""
    u = torch.rand((), generator=generator)
    if bool(u * q[draft] <= p[draft]):
        return True, draft
    return False, int(torch.multinomial(p, 1, generator=generator))


def chi_square_pvalue(counts: Counter, probs: dict, n: int) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled into one."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e = n * p
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + e
            continue
        stat, dof = stat + (counts.get(cell, 0) - e) ** 2 / e, dof + 1
    if pooled_exp > 0:
        stat, dof = stat + (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9), dof + 1
    assert sum(counts.values()) == n and not set(counts) - set(probs)
    # The chi-square survival function: the regularized upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


# --- one draft token: rejection_step alone ---------------------------------------------------------------


def _step_counts(step, p, q, n: int) -> Counter:
    g = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=g))
        counts[step(p, q, draft, g)[1]] += 1
    return counts


def test_rejection_step_samples_the_target():
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    q = torch.tensor([0.1, 0.1, 0.6, 0.1, 0.1])
    n = 4000
    probs = dict(enumerate(p.tolist()))
    assert chi_square_pvalue(_step_counts(rejection_step, p, q, n), probs, n) > ALPHA
    assert chi_square_pvalue(_step_counts(broken_rejection_step, p, q, n), probs, n) < ALPHA


# --- whole generations on a tiny model ----------------------------------------------------------------------

PROMPT = [1, 2, 3]
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def small_vocab():
    return small_vocab_model()


def small_vocab_model():
    """Four tokens, one layer; a scaled head makes each loop's distribution distinct and far from uniform.
    Returns ``(model, state dict, oracle cfg)``."""
    config = OuroConfig(vocab_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, total_ut_steps=4,
                        torch_dtype="float32", max_position_embeddings=64, early_exit_threshold=1.0)
    state = random_state_dict(config, seed=3)
    state["lm_head.weight"] = state["lm_head.weight"] * 20
    model = OuroForCausalLM(config)
    model.load_state_dict(state)
    cfg = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                           "rms_norm_eps", "total_ut_steps")}
    return model.eval(), state, cfg


def target_distribution(state, cfg, n_tokens: int, threshold: float) -> dict[tuple[int, ...], float]:
    """Exact probability of every ``n_tokens``-token continuation of PROMPT under plain sampling, each token
    from its position's exit depth (the oracle's exit rule and last_exited K/V)."""
    loops, vocab = cfg["total_ut_steps"], cfg["vocab_size"]
    out = {}
    for seq in itertools.product(range(vocab), repeat=n_tokens):
        prob, depths = 1.0, []
        for i in range(n_tokens):
            ids = PROMPT + list(seq[:i])
            kv_depths = ([loops] * len(PROMPT) + depths[1:] + [loops])[:len(ids)]
            run = reference_forward(state, cfg, torch.tensor(ids), loops, kv_depths)
            e = exit_depth(run["gate_logits"][:, -1], min_loops=1, max_loops=loops, exit_threshold=threshold)
            depths.append(e)
            prob *= float(torch.softmax(run["logits"][e - 1, -1] / TEMPERATURE, -1)[seq[i]])
        out[seq] = prob
    assert math.isclose(sum(out.values()), 1.0, rel_tol=1e-5)
    return out


def _generation_counts(model, runs: int, n_tokens: int, spec: SpeculativeConfig, threshold: float) -> Counter:
    return Counter(tuple(speculative_generate(model, PROMPT, n_tokens, spec, temperature=TEMPERATURE, seed=s,
                                              exit_threshold=threshold).tokens) for s in range(runs))


def _check(small_vocab, monkeypatch, runs: int, n_tokens: int, spec: SpeculativeConfig, threshold: float) -> None:
    model, state, cfg = small_vocab
    probs = target_distribution(state, cfg, n_tokens, threshold)
    assert chi_square_pvalue(_generation_counts(model, runs, n_tokens, spec, threshold), probs, runs) > ALPHA
    monkeypatch.setattr(spec_reference, "rejection_step", broken_rejection_step)
    assert chi_square_pvalue(_generation_counts(model, runs, n_tokens, spec, threshold), probs, runs) < ALPHA


def test_seeded_runs_are_reproducible(small_vocab):
    model = small_vocab[0]
    spec = SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=3, draft_loops=1)
    a, b = (speculative_generate(model, PROMPT, 8, spec, temperature=1.0, seed=7) for _ in range(2))
    assert (a.tokens, a.exit_loops, a.accepted) == (b.tokens, b.exit_loops, b.accepted)
    assert sum(a.accepted) < sum(a.drafts)  # the draft is rejected sometimes: the correction path runs


@pytest.mark.slow  # ~16 s on 2 cores. Default run: test_rejection_step_samples_the_target checks the step's
# distribution, test_seeded_runs_are_reproducible runs the correction in whole generations, and
# spec/test_engine_sampling.py::test_output_distribution_is_the_target checks the engine's output distribution
def test_two_token_distribution_is_the_target(small_vocab, monkeypatch):
    _check(small_vocab, monkeypatch, 300, 2, SpeculativeConfig(scheme="draft_verify",
                                                               num_speculative_tokens=1, draft_loops=1), 1.0)


@pytest.mark.slow
# threshold 0.7: tokens exit inside the round and ~0.8 drafts a run are rejected (at 0.5 every position exits at
# loop 1, where draft and target are the same distribution: nothing is ever rejected, the correction never runs)
@pytest.mark.parametrize("k, d, threshold", [(2, 1, 1.0), (2, 2, 1.0), (3, 1, 0.7)])
def test_three_token_distribution_is_the_target(small_vocab, monkeypatch, k, d, threshold):
    _check(small_vocab, monkeypatch, 3000, 3, SpeculativeConfig(scheme="draft_verify",
                                                                num_speculative_tokens=k, draft_loops=d), threshold)
