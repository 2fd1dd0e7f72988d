"""SpeculativeConfig: vLLM's speculative_config dict, refused with the field and the allowed range."""
from __future__ import annotations

import pytest

from loopline.errors import InvalidRequestError
from loopline.spec import SpeculativeConfig


def test_parses_the_vllm_dict():
    spec = SpeculativeConfig.from_dict({"method": "loop", "num_speculative_tokens": 3, "draft_loops": 2,
                                        "scheme": "pipeline"})
    assert (spec.num_speculative_tokens, spec.draft_loops, spec.scheme) == (3, 2, "pipeline")
    assert SpeculativeConfig.from_dict({"method": "loop"}) == SpeculativeConfig()


@pytest.mark.parametrize("spec, param, words", [
    ({"method": "eagle"}, "speculative_config.method", "'loop'"),
    ({"num_speculative_tokens": 2}, "speculative_config.method", "required"),
    ({"method": "loop", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "1..16"),
    ({"method": "loop", "num_speculative_tokens": 2.5}, "speculative_config.num_speculative_tokens", "1..16"),
    ({"method": "loop", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens", "1..16"),
    ({"method": "loop", "draft_loops": 0}, "speculative_config.draft_loops", "integer"),
    ({"method": "loop", "scheme": "tree"}, "speculative_config.scheme", "'draft_verify', 'pipeline'"),
    ({"method": "loop", "draft_model": "x"}, "speculative_config.draft_model", "unknown field(s) 'draft_model'"),
])
def test_bad_values_name_the_field_and_range(spec, param, words):
    with pytest.raises(InvalidRequestError) as err:
        SpeculativeConfig.from_dict(spec)
    assert err.value.param == param and words in str(err.value)


def test_draft_loops_must_be_shallower_than_the_model():
    assert SpeculativeConfig(draft_loops=3).check_model(4).draft_loops == 3
    with pytest.raises(InvalidRequestError, match=r"speculative_config.draft_loops=4; allowed: an integer in 1..3"):
        SpeculativeConfig(draft_loops=4).check_model(4)


def test_not_a_dict():
    with pytest.raises(InvalidRequestError, match="must be a JSON object"):
        SpeculativeConfig.from_dict('{"method": "loop"}')
