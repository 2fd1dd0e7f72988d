"""Every numeric request field has an explicit range, checked at the entry point (Python API and HTTP).

A value outside its range is a clean error naming the field (``InvalidRequestError.param`` /
HTTP 400 ``param``) and never reaches the engine: after each bad request the engine still serves.
"""
from __future__ import annotations

import httpx
import pytest

from loopline import SamplingParams
from loopline.errors import InvalidRequestError

API_KEY = "test-key"
MODEL = "tiny-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG = 2**63

BAD_PARAMS = [
    ({"n": 0}, "n"), ({"n": 1025}, "n"), ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2**40}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": 1e39}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": BIG}, "top_k"), ({"top_k": True}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": BIG}, "seed"), ({"seed": -BIG - 1}, "seed"), ({"seed": BIG - 1, "n": 2}, "seed"), ({"seed": True}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["x"] * 65}, "stop"), ({"stop": ["x" * 1025]}, "stop"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [BIG]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    # (-1 is the whole vocabulary; the engine's max_logprobs caps the count: InputProcessor)
    ({"logprobs": -2}, "logprobs"), ({"logprobs": BIG}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"), ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": 1e39}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"priority": BIG}, "priority"), ({"priority": False}, "priority"),
    ({"min_loops": 0}, "min_loops"), ({"min_loops": BIG}, "min_loops"),
    ({"max_loops": 1, "min_loops": 2}, "max_loops"),
    ({"exit_threshold": 0.0}, "exit_threshold"), ({"exit_threshold": 1.5}, "exit_threshold"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"exit_depths": [0]}, "exit_depths"), ({"exit_depths": [BIG]}, "exit_depths"),
    ({"logprobs_mode": "fancy"}, "logprobs_mode"),
]


@pytest.mark.parametrize("kwargs,param", BAD_PARAMS)
def test_sampling_params_ranges(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)  # the message names the field too


def test_model_dependent_ranges_name_the_bound():
    p = SamplingParams(top_k=1000)
    with pytest.raises(InvalidRequestError, match=r"top_k .*\[1, 64\]") as info:
        p.validate_for_model(total_ut_steps=4, vocab_size=64)
    assert info.value.param == "top_k"
    SamplingParams(top_k=64).validate_for_model(4, 64)
    SamplingParams(seed=BIG - 2, n=2)  # the last child seed is 2**63 - 1: still int64


def test_top_k_beyond_vocab_is_refused_by_the_python_api(async_llm):
    import asyncio

    async def run():
        with pytest.raises(InvalidRequestError) as info:
            async for _ in async_llm.generate("hello", SamplingParams(top_k=BIG - 1, max_tokens=2), "topk-big"):
                pass
        assert info.value.param == "top_k"
        outs = [o async for o in async_llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), "after")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2

    asyncio.run(run())


# --- HTTP ------------------------------------------------------------------------------------------
HTTP_BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 5000}, "n"),
    ("/v1/completions", {"prompt": "x", "top_k": BIG}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 513}, "top_k"),  # above the tiny model's vocab (512)
    ("/v1/completions", {"prompt": "x", "seed": BIG}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "priority": BIG}, "priority"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [True, 1]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
]


@pytest.mark.parametrize("route,body,param", HTTP_BAD)
def test_http_fields_out_of_range_get_400_naming_the_field(server, route, body, param):
    r = httpx.post(server.base_url + route, json={"model": MODEL, **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


GENERATE_BAD = [
    ({"input_ids": [1, 2], "sampling_params": {"top_k": BIG}}, "sampling_params.top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": BIG}}, "sampling_params.sampling_seed"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"n": 0}]}, "sampling_params[1].n"),
    ({"input_ids": [1, 2], "top_logprobs_num": True}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "rid": "a\nb"}, "rid"),
    ({"input_ids": [1, 2], "rid": "x" * 300}, "rid"),
]


@pytest.mark.parametrize("body,param", GENERATE_BAD)
def test_generate_fields_out_of_range_get_400(server, body, param):
    r = httpx.post(server.base_url + "/generate", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_engine_serves_after_every_bad_request(server, async_llm):
    for route, body, _ in HTTP_BAD:
        httpx.post(server.base_url + route, json={"model": MODEL, **body}, headers=AUTH)
    assert async_llm.is_running and async_llm.snapshot.kv_used_blocks == 0
    r = httpx.post(server.base_url + "/v1/completions", headers=AUTH,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2, "top_k": 512, "seed": BIG - 1, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


CHAT_BAD = [
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], "messages[1].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "http://x"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": 1, "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([], "messages"),
]


@pytest.mark.parametrize("messages,param", CHAT_BAD)
def test_chat_messages_are_validated(server, messages, param):
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.base_url + route, json={"model": MODEL, "messages": messages}, headers=AUTH)
        if route == "/tokenize" and messages == []:
            continue  # /tokenize renders an empty conversation
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["param"] == param, (route, r.json())


def test_text_parts_are_accepted(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH).status_code == 200
