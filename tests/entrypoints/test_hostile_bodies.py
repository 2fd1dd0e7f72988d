"""Bodies that are JSON only to a lenient parser, and fields that make no sense together: a 400 whose
``param`` names the field (issue #43)."""
from __future__ import annotations

import httpx
import pytest

API_KEY = "test-key"
MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Hi!"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def _post_raw(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.base_url + path, content=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "hi", "logit_bias": {"5": -Infinity}}', "logit_bias.5"),
    ("/v1/chat/completions", b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], '
                             b'"presence_penalty": -Infinity}', "presence_penalty"),
    ("/v1/chat/completions", b'{"model": "tiny-test", "messages": [{"role": "user", "content": "NaN"}], '
                             b'"tools": [{"type": "function", "function": {"name": "f", "parameters": '
                             b'{"type": "object", "properties": {"x": {"maximum": NaN}}}}}]}',
     "tools[0].function.parameters.properties.x.maximum"),
    ("/tokenize", b'{"model": "tiny-test", "prompt": "hi", "extra": [1, NaN]}', "extra[1]"),
    ("/v1/completions", b'NaN', "body"),
])
def test_nan_and_infinity_name_their_field(server, path, body, param):
    r = _post_raw(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_json" and param in err["message"], err
    assert "finite" in err["message"]


def test_nan_inside_a_string_is_just_text(server):
    r = _post_raw(server, "/v1/completions", b'{"model": "tiny-test", "prompt": "NaN Infinity", "max_tokens": 1}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("tools", [None, []])
@pytest.mark.parametrize("choice", ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_without_tools_is_refused(server, tools, choice):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "tool_choice": choice}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "needs tools" in err["message"], err


def test_tool_choice_with_tools_is_accepted(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
