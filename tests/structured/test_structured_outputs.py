"""Structured outputs (xgrammar): every output of a constrained request matches its constraint.

On the bundled demo model (a 5.5M-parameter model trained on Python code: left alone it never writes
JSON), for each kind -- JSON schema, JSON object, regex, choice, EBNF grammar -- greedy and seeded
sampling, n=2, batched with unconstrained requests (which stay exactly as when run alone), with the
overlapped and the synchronous engine, adaptive exits (the model's default threshold), preemption,
abort, and refused constraints (``InvalidRequestError`` naming the field, the engine unharmed).
"""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from loopline import LLM, SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError
from loopline.structured import StructuredOutputsParams
from loopline.structured.backend import backend_for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
REGEX = r"[a-z]{2,6}-\d{1,3}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "def " name "(" name? ")" ":"\nname ::= [a-z_] [a-z_0-9]{0,7}'
GRAMMAR_RE = r"def [a-z_][a-z_0-9]{0,7}\(([a-z_][a-z_0-9]{0,7})?\):"


def _check_schema(text: str) -> None:
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "ok"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8, text
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120, text
    assert isinstance(obj["ok"], bool), text


def _check_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


KINDS = {  # kind -> (constraint, check of one output's text)
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _check_schema),
    "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), _check_object),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    "grammar": (StructuredOutputsParams(grammar=GRAMMAR), lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(t)),
}
PROMPTS = ["import os\n", "def main(", "x = "]
FREE = SamplingParams(max_tokens=12, temperature=0.8, seed=5)  # an unconstrained neighbour


def make_engine(**kw) -> LLMEngine:
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 256)
    return LLMEngine(EngineArgs(**kw))


@pytest.fixture(scope="module")
def engines():
    return {mode: make_engine(async_scheduling=mode) for mode in (True, False)}


def drain(engine, requests, *, max_steps=5000, on_step=None):
    """Adds ``requests`` (id -> (prompt, params)), steps to the end; the finished outputs by id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if on_step is not None:
            on_step(engine, steps)
        assert steps < max_steps, "no progress"
    assert not engine.structured.matchers  # every matcher dropped with its request
    return done


def result(out):
    return [(c.token_ids, c.exit_depths) for c in out.outputs]


def constrained(kind, **kw):
    spec, check = KINDS[kind]
    kw.setdefault("max_tokens", 40)
    return SamplingParams(structured_outputs=spec, **kw), check


def assert_matches(outs, check, spec=None, engine=None):
    """Every output finished by its grammar and matches. ``spec``/``engine``: an unbounded constraint (any
    JSON object), whose output may run to max_tokens: then its tokens must be a prefix the grammar accepts."""
    stopped = 0
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "length" and spec is not None:
                backend = backend_for(engine.tokenizer, engine.model_config.vocab_size)
                matcher = backend.matcher(backend.compile(spec))
                assert all(matcher.accept_token(t) for t in c.token_ids), c.text
                continue
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(c.text)
            stopped += 1
    assert stopped > 0


# default run: each kind once, under one engine order or the other; the other five pairings (~2-5 s each) are slow
_DEFAULT_ORDER = {"json": False, "json_object": True, "regex": False, "choice": True, "grammar": False}


@pytest.mark.parametrize("kind, overlap", [
    pytest.param(kind, overlap, id=f"{'async' if overlap else 'sync'}-{kind}",
                 marks=[] if _DEFAULT_ORDER[kind] == overlap else [pytest.mark.slow])
    for kind in KINDS for overlap in (True, False)])
def test_every_output_matches_batched_with_free_requests(engines, kind, overlap):
    check_kind_batched_with_a_free_request(engines[overlap], kind)


def check_kind_batched_with_a_free_request(engine, kind):
    """Greedy and sampled requests of ``kind`` (n=2) beside an unconstrained one: every output matches,
    greedy children agree, and the unconstrained neighbour is exactly as alone."""
    greedy, check = constrained(kind, temperature=0.0, n=2)
    sampled, _ = constrained(kind, temperature=1.0, seed=3, n=2)
    reqs = {f"g{i}": (p, greedy) for i, p in enumerate(PROMPTS[:2])}
    reqs |= {f"s{i}": (p, sampled) for i, p in enumerate(PROMPTS)}
    reqs |= {"free": ("def f(x):\n", FREE)}
    out = drain(engine, reqs)
    unbounded = (KINDS[kind][0], engine) if kind == "json_object" else ()
    assert_matches([o for rid, o in out.items() if rid != "free"], check, *unbounded)
    assert all(len({tuple(c.token_ids) for c in out[f"g{i}"].outputs}) == 1 for i in range(2))
    alone = drain(engine, {"free": ("def f(x):\n", FREE)})
    assert result(out["free"]) == result(alone["free"])


def test_only_steps_with_constrained_rows_give_up_the_overlap(engines):
    engine = engines[True]
    kept = []
    watch = lambda eng, _: kept.append((eng._pending is not None, bool(eng.structured.matchers)))  # noqa: E731
    drain(engine, {"free": ("def f(x):\n", FREE)}, on_step=watch)
    assert any(pending for pending, _ in kept)  # unconstrained: steps overlap
    kept.clear()
    params, check = constrained("choice", temperature=0.0)
    out = drain(engine, {"c": ("import os\n", params)}, on_step=watch)
    assert_matches(out.values(), check)
    assert not any(pending for pending, live in kept if live)  # read at once while a constrained request runs


# ~4-5 s each on 2 cores: slow. Default run: the overlap rule in
# test_only_steps_with_constrained_rows_give_up_the_overlap
@pytest.mark.slow
@pytest.mark.parametrize("exit_fields", [{"exit_threshold": 1.0}, {"min_loops": 2}], ids=["fixed-depth", "min_loops-2"])
def test_requests_that_cannot_exit_at_their_first_loop_keep_the_overlap(engines, exit_fields):
    """A token that cannot exit at its first loop is never sampled in the step launched before the previous
    token is read: those steps overlap, and the outputs equal the synchronous engine's."""
    kept = []
    watch = lambda eng, _: kept.append((eng._pending is not None, bool(eng.structured.matchers)))  # noqa: E731
    outs = {}
    for overlap in (True, False):
        reqs = {}
        for kind in ("regex", "grammar", "json"):
            params, check = constrained(kind, temperature=1.0, seed=7, n=2)
            reqs[kind] = ("import os\n", params.clone(**exit_fields))
        outs[overlap] = drain(engines[overlap], reqs, on_step=watch if overlap else None)
        for kind, out in outs[overlap].items():
            assert_matches([out], KINDS[kind][1])
    assert sum(pending for pending, live in kept if live) > len(kept) // 2  # mostly overlapped
    assert {k: result(v) for k, v in outs[True].items()} == {k: result(v) for k, v in outs[False].items()}


def test_adaptive_exits_and_llm_entrypoint():
    """``LLM()`` on the bundled model (its default exit threshold: tokens exit at several depths)."""
    llm = LLM(device="cpu", max_model_len=256)
    assert llm.llm_engine.model_config.early_exit_threshold < 1.0
    params, check = constrained("json", temperature=1.0, seed=1, n=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_matches(outs, check)
    depths = {d for o in outs for c in o.outputs for d in c.exit_depths}
    assert len(depths) > 1, depths  # adaptive exits were taken


def test_preempted_requests_match_and_equal_a_roomy_run(engines):
    params, check = constrained("json", temperature=1.0, seed=9, max_tokens=36)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS + ["class A:\n"])}
    roomy = drain(engines[True], reqs)
    tight = make_engine(block_size=4, kv_allocation="incremental", enable_preemption=True,
                        num_kv_blocks=4 * 16, enable_prefix_caching=True)
    out = drain(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert_matches(out.values(), check)
    assert {k: result(v) for k, v in out.items()} == {k: result(v) for k, v in roomy.items()}


@pytest.mark.parametrize("overlap", [True, False], ids=["async", "sync"])
def test_abort_mid_request_drops_its_matcher(engines, overlap):
    engine = engines[overlap]
    params, check = constrained("json", temperature=1.0, seed=2, n=2, max_tokens=40)
    engine.add_request("a", "import os\n", params)
    engine.add_request("b", "x = ", FREE)
    for _ in range(12):
        engine.step()
    assert set(engine.structured.matchers) == {"a#0", "a#1"}
    engine.abort_request("a")
    assert not engine.structured.matchers
    done = drain(engine, {})
    assert all(c.finish_reason == "abort" for c in done["a"].outputs)
    # the engine goes on: a new constrained request matches
    params, check = constrained("choice", temperature=0.0)
    assert_matches(drain(engine, {"c": ("import os\n", params)}).values(), check)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(["), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
    (StructuredOutputsParams(json=False), "structured_outputs.json"),
    (StructuredOutputsParams(choice=["a"], whitespace_pattern=r"\s*"), "structured_outputs.whitespace_pattern"),
    (StructuredOutputsParams(json=SCHEMA, whitespace_pattern="[ "), "structured_outputs.whitespace_pattern"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_changes_nothing(engines, spec, field):
    engine = engines[True]
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", "import os\n", SamplingParams(structured_outputs=spec, max_tokens=8))
    assert err.value.param == field and field in str(err.value)
    assert not engine.has_unfinished_requests() and not engine.outputs.has("bad") and not engine.structured.matchers
    params, check = constrained("regex", temperature=0.0)
    assert_matches(drain(engine, {"bad": ("import os\n", params)}).values(), check)  # the id is free, all works


def test_no_tokenizer_is_refused_clearly(tiny_gqa):
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), device="cpu", dtype="float32", skip_tokenizer_init=True))
    with pytest.raises(InvalidRequestError, match="tokenizer") as err:
        engine.add_request("r", [5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])))
    assert err.value.param == "structured_outputs" and not engine.has_unfinished_requests()


def test_tokens_beyond_the_tokenizer_are_never_allowed(engines):
    from loopline.structured.backend import GrammarBackend, apply_token_bitmask

    tokenizer = engines[True].tokenizer
    vocab = len(tokenizer) + 40  # the model's logits are wider than the tokenizer
    backend = GrammarBackend(tokenizer, vocab)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex=".*")), [0])
    bitmask = backend.allocate_bitmask(2)
    matcher.fill_next_token_bitmask(bitmask, 1)
    logits = torch.zeros(3, vocab)
    apply_token_bitmask(logits, [2], bitmask[1:])
    assert torch.isinf(logits[2, len(tokenizer):]).all() and not torch.isinf(logits[:2]).any()
    assert torch.isfinite(logits[2, :len(tokenizer)]).sum() > 100  # ".*" allows most of the vocabulary


def test_async_llm_streams_a_constrained_request():
    from loopline.entrypoints.async_llm import AsyncLLM

    llm = AsyncLLM(engine=make_engine(async_scheduling=False))
    params, check = constrained("choice", temperature=1.0, seed=4)

    async def main():
        final = None
        async for out in llm.generate("def main(", params, "q"):
            final = out
        return final

    try:
        out = asyncio.run(main())
    finally:
        llm.shutdown()
    assert_matches([out], check)


def test_the_request_ends_when_its_grammar_terminates(engines):
    """``ignore_eos``: EOS does not stop the request, the grammar's end (EOS accepted) does; stop strings
    still apply inside a constraint."""
    engine = engines[False]
    params, check = constrained("choice", temperature=0.0, ignore_eos=True, max_tokens=20)
    out = drain(engine, {"e": ("import os\n", params)})["e"].outputs[0]
    check(out.text)
    assert out.finish_reason == "stop" and len(out.token_ids) < 20
    assert out.token_ids[-1] in engine.model_config.eos_token_ids
    digits = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\d+"), stop=["3"], max_tokens=30,
                            temperature=1.0, seed=0)
    out = drain(engine, {"d": ("x = ", digits)})["d"].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"\d*", out.text), out.text


def test_a_prefill_worker_refuses_constrained_requests():
    from loopline.structured import StructuredOutputs, compile_constraint

    engine = LLMEngine(EngineArgs(device="cpu", max_model_len=256), prefill_only=True)
    with pytest.raises(InvalidRequestError, match="prefill worker") as err:
        engine.add_request("p", "x = ", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])))
    assert err.value.param == "structured_outputs" and not engine.has_unfinished_requests()
    assert isinstance(engine.structured, StructuredOutputs) and not engine.structured.matchers
    # the API a caller that builds constraints validates with (cached: the same compiled grammar)
    spec = StructuredOutputsParams(json=SCHEMA)
    assert compile_constraint(engine.tokenizer, 4096, spec) is compile_constraint(engine.tokenizer, 4096, spec)


def test_whitespace_pattern_sets_the_whitespace_between_json_tokens(engines):
    spec = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    params = SamplingParams(structured_outputs=spec, max_tokens=40, temperature=1.0, seed=7, n=2)
    out = drain(engines[False], {"w": ("import os\n", params)})["w"]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        _check_schema(c.text)
        assert "  " not in c.text and "\n" not in c.text, c.text


def test_filters_that_leave_no_allowed_token_fail_that_request_alone(engines):
    engine = engines[True]
    digits = StructuredOutputsParams(regex=r"\d+")
    letters = [engine.tokenizer.convert_tokens_to_ids(t) for t in ("a", "b")]
    impossible = SamplingParams(structured_outputs=digits, allowed_token_ids=letters, max_tokens=8)
    out = drain(engine, {"x": ("x = ", impossible), "free": ("def f(x):\n", FREE)})
    assert out["x"].outputs[0].finish_reason == "abort" and out["x"].error_id
    assert out["free"].outputs[0].finish_reason in ("stop", "length")
