"""Scheme "auto" (#41): both speculation schemes in one engine, each request in the one the load picked
when it was added (the pipeline below ``auto_pipeline_below`` requests running or waiting, draft then
verify at or above). What must hold: outputs, exit depths and logprobs equal plain decoding's token for
token while requests of both schemes share steps (eagerly) and while each runs alone (its own graph family
replayed), greedy and seeded; the config refuses what the pipeline cannot run."""
from __future__ import annotations

import pytest
from graph_testing import EagerCapturer
from spec.test_engine import DEMO_PROMPTS, GREEDY, assert_same, drain, engine

from loopline.config import EngineArgs
from loopline.errors import InvalidRequestError
from loopline.spec import SpeculativeConfig

AUTO = {"method": "loop", "scheme": "auto", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False,
        "disable_by_batch_size": None, "auto_pipeline_below": 2}


@pytest.fixture(scope="module")
def demo_prompts():
    from loopline.models.loader import load_tokenizer
    from loopline.models.tiny import default_checkpoint

    tok = load_tokenizer(default_checkpoint())
    return [tok.encode(p) for p in DEMO_PROMPTS]


def schemes_of(eng) -> dict:
    """Records each added request's (speculates, scheme)."""
    seen, add = {}, eng.scheduler.add_request

    def recording(req):
        add(req)
        seen[req.request_id.split("#")[0]] = (req.speculative, req.spec_scheme)

    eng.scheduler.add_request = recording
    return seen


@pytest.mark.parametrize("arrivals, graphs", [({"r1": 3, "r2": 3, "r3": 10}, False),
                                              ({"r1": 40, "r2": 40, "r3": 40}, True)])
def test_both_schemes_in_one_engine_equal_plain_decoding(demo_prompts, arrivals, graphs):
    """r0 pipelines (alone); r1 joins it and pipelines; r2 and r3 arrive to two requests and draft then
    verify, their rows in the same steps as the lanes (eagerly). In the second case r0 runs alone in the
    pipeline's graphs first, and the rounds run alone in theirs once the pipelining requests are done."""
    kw = {"max_num_batched_tokens": 64, "max_model_len": 128, "max_num_seqs": 8}
    reqs = {f"r{i}": (p, GREEDY.clone(logprobs=2)) for i, p in enumerate(demo_prompts)}
    eng = engine(speculative=AUTO, **kw)
    if graphs:
        eng.runner.capture_graphs(128, 64, max_prefill_rows=3, capturer=EagerCapturer())
    seen = schemes_of(eng)
    out = drain(eng, reqs, arrivals)
    assert seen == {"r0": (True, "pipeline"), "r1": (True, "pipeline"), "r2": (True, "draft_verify"),
                    "r3": (True, "draft_verify")}
    assert_same(out, drain(engine(**kw), reqs, arrivals))
    assert eng.stats.spec_num_accepted_tokens > 0
    if graphs:
        replays = eng.runner.graphs.replays
        assert replays["pipe"] > 10 and replays["spec_draft"] > 5 and replays["spec"] > 3


def test_seeded_sampling_equals_plain_decoding(demo_prompts):
    sampled = GREEDY.clone(temperature=0.8, top_p=0.9, logprobs=1)
    reqs = {f"r{i}": (p, sampled.clone(seed=20 + i)) for i, p in enumerate(demo_prompts)}
    arrivals = {"r2": 5, "r3": 5}
    eng = engine(speculative=AUTO)
    seen = schemes_of(eng)
    out = drain(eng, reqs, arrivals)
    assert {s for _, s in seen.values()} == {"pipeline", "draft_verify"}
    assert_same(out, drain(engine(), reqs, arrivals))


def test_penalties_and_bad_words_in_both_schemes_in_one_step(demo_prompts):
    """r0 (penalties) pipelines alone, r1 (seeded) joins it and pipelines, r2 (penalties and a bad word of two
    tokens) arrives to two and drafts then verifies. Their rows share steps; the rounds' targets read the
    committed tokens and their drafts as history, the lanes' the committed tokens and the lanes ahead (rows
    after the rounds' in the step's sampling batch), and all three equal plain decoding."""
    free = drain(engine(), {"free": (demo_prompts[2], GREEDY)})["free"].token_ids
    pair = engine().tokenizer.decode(free[3:5])
    reqs = {"r0": (demo_prompts[0], GREEDY.clone(repetition_penalty=1.3, frequency_penalty=0.4)),
            "r1": (demo_prompts[1], GREEDY.clone(temperature=0.8, seed=7)),
            "r2": (demo_prompts[2], GREEDY.clone(presence_penalty=0.6, bad_words=[pair]))}
    eng = engine(speculative=AUTO)
    seen = schemes_of(eng)
    out = drain(eng, reqs, {"r1": 2, "r2": 3})
    assert seen == {"r0": (True, "pipeline"), "r1": (True, "pipeline"), "r2": (True, "draft_verify")}
    assert_same(out, drain(engine(), reqs, {"r1": 2, "r2": 3}))
    assert eng.stats.spec_num_accepted_tokens > 0


def test_config():
    auto = SpeculativeConfig.from_dict({"method": "loop", "scheme": "auto"})
    assert auto.auto_pipeline_below == 32 and auto.pipelines
    assert auto.kv_lookahead(4) == max(2 * auto.lanes(4), 2 * auto.num_speculative_tokens)
    with pytest.raises(InvalidRequestError, match="auto_pipeline_below"):
        SpeculativeConfig.from_dict({"method": "loop", "scheme": "auto", "auto_pipeline_below": 0})
    with pytest.raises(InvalidRequestError, match="scheme='auto' needs kv_layout='last_exited'"):
        engine(speculative=AUTO, kv_layout="shared")


def test_shared_layout_gets_draft_verify_when_no_scheme_is_named():
    """The shared plane cannot pipeline: without a named scheme its user gets draft then verify; naming one
    that pipelines is refused (test_config)."""
    args = EngineArgs(speculative_config={"method": "loop", "num_speculative_tokens": 3}, kv_layout="shared")
    spec = args.speculative()
    assert spec.scheme == "draft_verify" and spec.num_speculative_tokens == 3
    assert EngineArgs(speculative_config={"method": "loop"}).speculative().scheme == SpeculativeConfig().scheme


def test_an_unused_num_speculative_tokens_is_logged(caplog):
    """vLLM's habit names ``num_speculative_tokens``; under the default (pipeline) scheme the engine says it is
    unused and how to get K-draft rounds, once, at start."""
    with caplog.at_level("INFO", logger="loopline"):
        engine(speculative={"method": "loop", "num_speculative_tokens": 3})
    said = [r.getMessage() for r in caplog.records if "num_speculative_tokens" in r.getMessage()]
    assert len(said) == 1 and "does not use num_speculative_tokens=3" in said[0] and "draft_verify" in said[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="loopline"):
        engine(speculative={"method": "loop"})
        engine(speculative={"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 3})
    assert not any("num_speculative_tokens" in r.getMessage() for r in caplog.records)
