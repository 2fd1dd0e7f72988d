"""Draft-then-verify (loopline.spec.reference) is exact: greedy output, exit depths and logprobs equal plain
decoding's and the independent oracle's, for several K and d, at fixed depth and with adaptive exits; EOS
and max_tokens inside an accepted run cut it where plain decoding stops."""
from __future__ import annotations

import pytest
import torch
from reference import reference_generate  # tests/ is on pythonpath (pyproject.toml)

from loopline.models.loader import load_model
from loopline.models.plain import plain_generate
from loopline.models.tiny import default_checkpoint
from loopline.spec import SpeculativeConfig
from loopline.spec.reference import speculative_generate

PROMPT = [5, 17, 33, 2, 9, 101, 44]


@pytest.fixture(scope="module")
def demo():
    return load_model(default_checkpoint(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tiny_gqa):
    return load_model(tiny_gqa.path, dtype=torch.float32).eval()


def _demo_prompt(demo) -> list[int]:
    # Text the demo model has seen the like of, so its drafts are accepted often (and not always).
    from loopline.models.loader import load_tokenizer

    return load_tokenizer(default_checkpoint()).encode("import os\nimport sys\n\n\ndef main(argv):\n    ")


@pytest.mark.parametrize("k, d, threshold", [(3, 1, 1.0), (2, 2, 1.0), (1, 1, 0.5), (4, 3, 0.5)])
def test_greedy_equals_plain_decoding_on_the_demo_model(demo, k, d, threshold):
    prompt = _demo_prompt(demo)
    plain = plain_generate(demo, prompt, 24, exit_threshold=threshold)
    spec = speculative_generate(demo, prompt, 24, SpeculativeConfig(scheme="draft_verify",
                                                                    num_speculative_tokens=k, draft_loops=d),
                                exit_threshold=threshold)
    assert spec.tokens == plain.tokens
    assert spec.exit_loops == plain.exit_loops
    assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert sum(spec.accepted) > 0
    if threshold == 1.0:
        assert sum(spec.accepted) < sum(spec.drafts)  # rejections too (adaptive d=3 drafts exit on their own)
    else:
        assert len(set(plain.exit_loops)) > 1  # exits at several depths, some before and some after d


@pytest.mark.parametrize("threshold, min_loops", [(1.0, 1), (0.5, 1), (0.3, 2)])
@pytest.mark.parametrize("k, d", [(2, 1), (3, 2)])
def test_greedy_equals_the_independent_oracle(tiny, tiny_gqa, k, d, threshold, min_loops):
    tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, PROMPT, 10, min_loops=min_loops,
                                                  exit_threshold=threshold)
    spec = speculative_generate(tiny, PROMPT, 10, SpeculativeConfig(scheme="draft_verify",
                                                                    num_speculative_tokens=k, draft_loops=d),
                                exit_threshold=threshold, min_loops=min_loops)
    assert (spec.tokens, spec.exit_loops) == (tokens, depths)
    assert spec.logprobs == pytest.approx(logprobs, abs=1e-4)


def _cut_inside_a_run(spec, kept: int) -> bool:
    """Whether the last round committed more tokens than the output kept (the stop fell inside its run)."""
    before = 1 + sum(a + 1 for a in spec.accepted[:-1])
    return before + spec.accepted[-1] + 1 > kept


def test_eos_inside_an_accepted_run(demo):
    prompt = _demo_prompt(demo)
    spec_config = SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=4, draft_loops=3)
    full = plain_generate(demo, prompt, 12)
    inside = 0
    for j in range(2, 12):
        if full.tokens[j] in full.tokens[:j]:
            continue  # an earlier copy would stop first
        eos = [full.tokens[j]]
        spec = speculative_generate(demo, prompt, 12, spec_config, eos_ids=eos)
        assert (spec.tokens, spec.exit_loops) == (full.tokens[:j + 1], full.exit_loops[:j + 1])
        inside += _cut_inside_a_run(spec, j + 1)
    assert inside >= 2


def test_max_tokens_inside_an_accepted_run(demo):
    prompt = _demo_prompt(demo)
    spec_config = SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=4, draft_loops=3)
    full = plain_generate(demo, prompt, 8)
    inside = 0
    for n in range(1, 9):
        spec = speculative_generate(demo, prompt, n, spec_config)
        assert (spec.tokens, spec.exit_loops) == (full.tokens[:n], full.exit_loops[:n])
        inside += n > 1 and _cut_inside_a_run(spec, n)
    assert inside >= 2


def test_bad_requests_name_the_field(tiny):
    with pytest.raises(ValueError, match="draft_loops=4; allowed: an integer in 1..3"):
        speculative_generate(tiny, PROMPT, 4, SpeculativeConfig(scheme="draft_verify", draft_loops=4))
    with pytest.raises(ValueError, match="temperature=-1"):
        speculative_generate(tiny, PROMPT, 4, SpeculativeConfig(scheme="draft_verify"), temperature=-1)
    with pytest.raises(ValueError, match="max_tokens=0"):
        speculative_generate(tiny, PROMPT, 0, SpeculativeConfig(scheme="draft_verify"))
    with pytest.raises(ValueError, match="draft_loops=4; allowed: an integer in 1..3"):
        speculative_generate(tiny, PROMPT, 4, SpeculativeConfig(scheme="pipeline", draft_loops=4))
