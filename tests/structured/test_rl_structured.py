"""Structured outputs on the RL paths (issue #42): ``POST /generate`` (SGLang's ``json_schema``, ``regex``,
``ebnf`` and vLLM's ``structured_outputs``) and the trainer-facing rollout server's sampling dict. On the
bundled demo model (it has a tokenizer): every output matches its constraint; bad or conflicting constraints
are a 400 naming the field the client sent, and the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from loopline import AsyncLLM, EngineArgs
from loopline.errors import InvalidRequestError
from tests.structured.test_structured_outputs import GRAMMAR, GRAMMAR_RE, REGEX, SCHEMA, _check_schema

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(EngineArgs(device="cpu", max_model_len=256, max_num_seqs=4))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def srv(llm):
    from loopline.entrypoints.openai.api_server import build_app
    from tests.entrypoints.conftest import RunningServer

    server = RunningServer(build_app(llm, "demo", api_key=KEY, shutdown_engine=False, enable_rl_api=True))
    yield server
    server.stop()


def _generate(srv, sampling: dict, prompts=("import os\n", "x = ")) -> httpx.Response:
    body = {"text": list(prompts), "sampling_params": {"max_new_tokens": 96, "temperature": 0.7, "n": 2, **sampling}}
    return httpx.post(srv.base_url + "/generate", json=body, headers=AUTH, timeout=120)


@pytest.mark.parametrize("sampling,check", [
    # (greedy after a dict's opening: JSON with any whitespace allowed lets this code model spend its
    # whole budget on whitespace after other prompts)
    ({"json_schema": json.dumps(SCHEMA), "temperature": 0, "n": 1}, _check_schema),
    ({"json_schema": SCHEMA, "temperature": 0, "n": 1}, _check_schema),
    ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    ({"ebnf": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no") or pytest.fail(t)),
], ids=["json_schema-text", "json_schema-object", "regex", "ebnf", "structured_outputs"])
def test_generate_outputs_match_their_constraint(srv, sampling, check):
    prompts = ("config = {",) if "json_schema" in sampling else ("import os\n", "x = ")
    r = _generate(srv, sampling, prompts)
    assert r.status_code == 200, r.text
    items = r.json()
    items = items if isinstance(items, list) else [items]
    assert len(items) == len(prompts) * sampling.get("n", 2)
    for item in items:
        assert item["meta_info"]["finish_reason"]["type"] == "stop", item  # the grammar ended it
        check(item["text"])


@pytest.mark.parametrize("sampling,param", [
    ({"regex": "a("}, "sampling_params.regex"),
    ({"json_schema": "{not json"}, "sampling_params.json_schema"),
    ({"ebnf": "root ::= undefined_rule"}, "sampling_params.ebnf"),
    ({"regex": "a+", "ebnf": GRAMMAR}, "sampling_params.ebnf"),
    ({"regex": "a+", "structured_outputs": {"regex": "b+"}}, "sampling_params.structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "sampling_params.structured_outputs.choice"),
    ({"structural_tag": {"type": "x"}}, "sampling_params.structural_tag"),
    ({"min_new_tokens": 2, "min_tokens": 3}, "sampling_params.min_tokens"),
])
def test_generate_bad_constraints_are_400_naming_the_field(srv, sampling, param):
    r = _generate(srv, sampling, prompts=["x = "])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert _generate(srv, {"regex": REGEX}, prompts=["x = "]).status_code == 200  # still serving


def test_generate_min_new_tokens_and_logit_bias(srv):
    r = httpx.post(srv.base_url + "/generate", headers=AUTH, timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "min_new_tokens": 6,
                                                    "logit_bias": {"9": 100.0}}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == [9] * 6  # the bias wins every step; min_new_tokens keeps EOS away


@pytest.mark.slow  # an engine process (~7 s on 2 cores); default run: the rollout server's sampling dicts
# (tests/rl/test_rollout_server.py) and structured outputs through generate (the tests above)
def test_rollout_sampling_dict_takes_structured_outputs():
    from loopline.entrypoints.rollout_server import RolloutLimits, RolloutServer

    server = RolloutServer(AsyncLLM(EngineArgs(device="cpu", max_model_len=256, max_num_seqs=2)),
                           RolloutLimits(64, 48, 256))
    try:
        tok = server.llm.tokenizer
        prompt = tok.encode("x = ", add_special_tokens=False)

        async def run():
            return await asyncio.gather(*(server.generate(prompt, {"temperature": 0.8, "seed": i, "structured_outputs":
                                                                   {"regex": REGEX}}, f"r{i}") for i in range(3)))

        for res in asyncio.run(run()):
            assert res.finish_reason == "stop" and re.fullmatch(REGEX, tok.decode(res.token_ids, skip_special_tokens=True))
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(server.generate(prompt, {"structured_outputs": {"regex": "a("}}, "bad"))
        assert e.value.param == "structured_outputs.regex"
    finally:
        server.llm.shutdown()
