"""No request field is silently ignored: each of vLLM's fields is honoured or refused with a 400 naming it.

Also the response shapes vLLM clients read: ``prompt_logprobs``, ``usage.prompt_tokens_details``,
``/tokenize``'s ``token_strs``, ``prompt_token_ids`` in the first chat chunk, one choice per
streamed chunk, ``GET /v1/models/{id}``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from loopline.entrypoints.openai.fields import FIELDS, FieldRefused, build_fields, check_fields, markdown_table
from loopline.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from loopline.errors import InvalidRequestError
from loopline.structured.params import StructuredOutputsParams

API_KEY = "test-key"
MODEL = "tiny-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "The river town"}]

# vLLM's request-schema field names, written out from vLLM's protocol (vllm-project/vllm, the 0.2x line,
# snapshot commit 002032ee2b18: vllm/entrypoints/openai/completion/protocol.py ``CompletionRequest`` and
# vllm/entrypoints/openai/chat_completion/protocol.py ``ChatCompletionRequest``; ``/tokenize``:
# ``TokenizeCompletionRequest`` + ``TokenizeChatRequest``), plus names earlier vLLM releases had that
# clients still send (``best_of``, the ``guided_*`` aliases, ``logits_processors``, the chat
# repetition-pattern fields).
VLLM_COMMON = [
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval", "echo",
    # earlier releases
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "logits_processors",
]
VLLM_COMPLETION = VLLM_COMMON + ["prompt", "suffix", "prompt_embeds", "best_of"]
VLLM_CHAT = VLLM_COMMON + [
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text",
    # earlier releases
    "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
]
VLLM_TOKENIZE = ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                 "continue_final_message", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "tools"]
VLLM = {"completions": VLLM_COMPLETION, "chat": VLLM_CHAT, "tokenize": VLLM_TOKENIZE}
ROUTE = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize"}

# A value of each field that asks for something (for refused fields: a non-neutral value). Some need
# companion fields (``stream_options`` needs ``stream``): those are dicts of several fields.
SAMPLE = {
    "model": MODEL, "max_tokens": 2, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
    "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1, "seed": 3, "stop": ["zzz"],
    "stop_token_ids": [3], "ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "prompt_logprobs": 1, "priority": 0, "stream": True, "user": "someone", "request_id": "field-test",
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "return_token_ids": True, "return_tokens_as_token_ids": True, "min_tokens": 1, "logit_bias": {"3": 1.5},
    "allowed_token_ids": [3, 4, 5, 6], "bad_words": ["zzz"], "truncate_prompt_tokens": 2,
    "structured_outputs": {"choice": ["yes", "no"]}, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "},
    "min_loops": 1, "max_loops": 2, "exit_threshold": 0.5, "logprobs_mode": "raw",
    "use_beam_search": True, "length_penalty": 0.5, "watermarking": True, "spaces_between_special_tokens": False,
    "truncation_side": "right", "cache_salt": "salt", "session_id": "s", "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"max_pattern_size": 2},
    "thinking_token_budget": 10, "stream_interval": 4, "routed_experts_prompt_start": 1,
    "return_token_offsets": True, "return_mm_kwargs": False, "logits_processors": ["x.y"],
    "prompt": "The river town", "suffix": "end", "prompt_embeds": "AAAA", "best_of": 2,
    "add_special_tokens": True, "messages": MESSAGES, "max_completion_tokens": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "reasoning_effort": "low",
    "include_reasoning": False, "parallel_tool_calls": False, "add_generation_prompt": False,
    "continue_final_message": {"add_generation_prompt": False, "continue_final_message": True,
                               "messages": MESSAGES + [{"role": "assistant", "content": "Once"}]},
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages[0]['content'] }}",
    "chat_template_kwargs": {"enable_thinking": False}, "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1}, "return_prompt_text": True, "max_repetition_pattern_size": 2,
    "min_repetition_pattern_size": 2, "repetition_min_count": 2, "return_token_strs": True,
}
SAMPLE_BY_ROUTE = {
    ("completions", "logprobs"): 1, ("chat", "logprobs"): True, ("chat", "top_logprobs"): {"logprobs": True,
                                                                                         "top_logprobs": 2},
    ("completions", "echo"): True, ("chat", "echo"): True,
    ("completions", "logprob_token_ids"): {"logprobs": 1, "logprob_token_ids": [3]},
    ("chat", "logprob_token_ids"): {"logprobs": True, "logprob_token_ids": [3]},
    ("completions", "best_of"): {"n": 2, "best_of": 2},
    ("tokenize", "continue_final_message"): SAMPLE["continue_final_message"],
    ("tokenize", "add_generation_prompt"): {"messages": MESSAGES, "add_generation_prompt": False},
    ("chat", "tool_choice"): {"tools": SAMPLE["tools"], "tool_choice": "none"},
}
# Honoured fields that a condition may still refuse (with a 400 naming them): template inputs the tiny
# model's chat template does not read, a request template on a server that does not trust them, and
# structured outputs while the engine refuses them.
CONDITIONAL = {"chat_template_kwargs", "documents", "reasoning_effort", "chat_template", "structured_outputs",
               "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_whitespace_pattern"}
BASE = {"completions": {"model": MODEL, "prompt": "The river town", "max_tokens": 2},
        "chat": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
        "tokenize": {"model": MODEL}}


def _body(route: str, name: str) -> dict:
    value = SAMPLE_BY_ROUTE.get((route, name), SAMPLE.get(name))
    extra = value if isinstance(value, dict) and name in value else {name: value}
    body = {**BASE[route], **extra}
    if route == "tokenize" and "messages" not in body and "prompt" not in body:
        body["prompt"] = "The river town"
    return body


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, headers=AUTH, timeout=60)


# --- the table ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", list(VLLM))
def test_every_vllm_field_is_decided(route):
    missing = [f for f in VLLM[route] if f not in FIELDS[route]]
    assert not missing, f"decide these vLLM fields of {ROUTE[route]} in fields.py: {missing}"
    for name in VLLM[route]:
        assert name in SAMPLE or (route, name) in SAMPLE_BY_ROUTE, f"add a sample value for {name}"


def test_request_models_declare_exactly_the_honoured_fields():
    """A field the model declares is one the table honours (engine-pending fields aside: the table
    refuses them before the model sees them)."""
    pending = {"min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
               "logprob_token_ids"}
    for route, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        honoured = {n for n, r in FIELDS[route].items() if r.honoured}
        assert set(model.model_fields) - pending == honoured - pending, route


def test_engine_fields_are_refused_on_an_engine_without_them():
    """The mapping is right in both states: without SamplingParams.min_tokens (etc.) the field is a 400
    "not supported" (its neutral value still passes), with it the field is honoured."""
    engine = ("min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
              "logprob_token_ids")
    old = build_fields(frozenset())
    new = build_fields(frozenset(engine))
    for name in engine:
        for route in ("completions", "chat"):
            assert not old[route][name].honoured and "not supported" in old[route][name].note
            assert new[route][name].honoured
    with pytest.raises(FieldRefused) as info:
        check_fields("completions", {"prompt": "x", "min_tokens": 2}, old)
    assert info.value.code == "unsupported_field" and info.value.param == "min_tokens"
    assert "not supported" in info.value.message
    assert check_fields("completions", {"prompt": "x", "min_tokens": 0, "bad_words": []}, old) == {"prompt": "x"}
    assert check_fields("completions", {"prompt": "x", "min_tokens": 2}, new) == {"prompt": "x", "min_tokens": 2}
    assert markdown_table("chat", old) == markdown_table("chat", new)  # the doc does not depend on the engine


def test_docs_list_exactly_the_table_fields():
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    for route in FIELDS:
        assert markdown_table(route) in text, f"regenerate the {route} table in docs/serving.md (fields.markdown_table)"


# --- every field over HTTP ----------------------------------------------------------------------------------
CASES = [(route, name) for route in VLLM for name in VLLM[route]]


@pytest.mark.parametrize("route,name", CASES, ids=[f"{r}-{n}" for r, n in CASES])
def test_each_vllm_field_is_honoured_or_refused(server, route, name):
    rule = FIELDS[route][name]
    r = _post(server, ROUTE[route], _body(route, name))
    if rule.honoured and name not in CONDITIONAL:
        assert r.status_code == 200, f"{name}: {r.text}"
    elif rule.honoured:
        assert r.status_code == 200 or (r.status_code == 400 and (r.json()["error"]["param"] or "").startswith(
            ("structured_outputs", "response_format", name))), f"{name}: {r.text}"
    else:
        assert r.status_code == 400, f"{name} refused but answered {r.status_code}"
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"] and err["code"] == "unsupported_field", err


@pytest.mark.parametrize("route", list(ROUTE))
def test_unknown_fields_are_refused_naming_them(server, route):
    body = {**_body(route, "model"), "frobnicate": 1}
    r = _post(server, ROUTE[route], body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "frobnicate" and r.json()["error"]["code"] == "unknown_field"


@pytest.mark.parametrize("route,body,param", [
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ("chat", {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]},
     "messages[0].content[0].cache"),
])
def test_unknown_nested_fields_are_refused(server, route, body, param):
    r = _post(server, ROUTE[route], {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_refused_fields_are_accepted(server):
    body = {**BASE["completions"], "use_beam_search": False, "length_penalty": 1.0, "suffix": None,
            "spaces_between_special_tokens": True, "stream_interval": 1, "vllm_xargs": {}}
    assert _post(server, "/v1/completions", body).status_code == 200
    body = {**BASE["chat"], "tools": [], "mm_processor_kwargs": {}, "include_reasoning": True, "tool_choice": None}
    assert _post(server, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "none"}, "tool_choice"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": SAMPLE["tools"], "tool_choice": "auto"}, "tool_choice"),  # the server has no --enable-auto-tool-choice
])
def test_tool_fields_are_refused(server, body, param):
    r = _post(server, "/v1/chat/completions", {**BASE["chat"], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "tool" in r.json()["error"]["message"]


# --- structured outputs mapping -------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,expected", [
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     StructuredOutputsParams(json={"type": "object"})),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": '{"type": "object"}'}, StructuredOutputsParams(json={"type": "object"})),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *", "guided_decoding_backend": "auto"},
     StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" *")),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " "},
     StructuredOutputsParams(json_object=True, whitespace_pattern=" ")),
    ({}, None),
])
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_structured_outputs_mapping(model, fields, expected):
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": MESSAGES}
    req = model.model_validate(model.check_fields({**base, **fields}))
    assert req.structured() == expected


@pytest.mark.parametrize("fields,param", [
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_structured_outputs_conflicts_and_bad_values(fields, param):
    req = CompletionRequest.model_validate(CompletionRequest.check_fields({"prompt": "x", **fields}))
    with pytest.raises(InvalidRequestError) as info:
        req.structured()
    assert info.value.param == param


def test_refusals_name_the_field_before_validation():
    with pytest.raises(APIError) as info:
        CompletionRequest.check_fields({"prompt": "x", "session_id": "s"})
    assert info.value.status == 400 and info.value.param == "session_id" and "per-session" in info.value.message


# --- chat template inputs --------------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if documents %}DOCS:{{ documents | length }}\n{% endif %}{% if greeting %}{{ greeting }}\n{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def trusted(async_llm, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    return serve_app(build_app(async_llm, MODEL, api_key=API_KEY, shutdown_engine=False,
                               trust_request_chat_template=True))


def test_request_chat_template_needs_trust(server, trusted):
    body = {**BASE["chat"], "chat_template": TEMPLATE, "return_prompt_text": True}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = _post(trusted, "/v1/chat/completions", {**body, "documents": [{"title": "a", "text": "b"}] * 2,
                                                "chat_template_kwargs": {"greeting": "HELLO"}})
    assert r.status_code == 200, r.text
    text = r.json()["prompt_text"]
    assert "DOCS:2\nHELLO\n<|im_start|>assistant\n" in text
    # a key the template does not read, or a reserved one, is refused naming it
    for kwargs, param in (({"nope": 1}, "chat_template_kwargs.nope"),
                          ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt")):
        r = _post(trusted, "/v1/chat/completions", {**body, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(trusted, "/tokenize", {"model": MODEL, "messages": MESSAGES, "chat_template": TEMPLATE,
                                     "chat_template_kwargs": {"greeting": "HELLO"}})
    assert r.status_code == 200, r.text
    text = _post(trusted, "/detokenize", {"model": MODEL, "tokens": r.json()["tokens"]}).json()["prompt"]
    assert "DOCS" not in text and "HELLO\n<|im_start|>assistant\n" in text


def test_continue_final_message_and_echo(server):
    msgs = MESSAGES + [{"role": "assistant", "content": "Once upon"}]
    body = {**BASE["chat"], "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "return_prompt_text": True, "echo": True, "max_tokens": 3, "ignore_eos": True, "seed": 1}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_text"].endswith("<|im_start|>assistant\nOnce upon")  # left open: no <|im_end|>
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith("Once upon")  # echo: the last message first
    r = _post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    # the same prompt from /tokenize
    r = _post(server, "/tokenize", {"model": MODEL, "messages": msgs, "add_generation_prompt": False,
                                    "continue_final_message": True})
    assert r.status_code == 200 and r.json()["count"] == out["usage"]["prompt_tokens"]


def test_tokenize_template_inputs_need_messages(server):
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "x", "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


# --- response shapes ---------------------------------------------------------------------------------------------
def test_completion_prompt_logprobs_key_and_shape(server):
    body = {**BASE["completions"], "ignore_eos": True}
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    assert "prompt_logprobs" in choice and choice["prompt_logprobs"] is None
    r = _post(server, "/v1/completions", {**body, "prompt_logprobs": 2, "return_token_ids": True})
    choice = r.json()["choices"][0]
    plp, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and 1 <= len(entry) <= 3  # the prompt token plus the top 2
        for v in entry.values():
            assert set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 and v["rank"] >= 1
    r = _post(server, "/v1/chat/completions", {**BASE["chat"], "prompt_logprobs": 1, "return_token_ids": True})
    out = r.json()
    assert len(out["prompt_logprobs"]) == len(out["prompt_token_ids"]) and out["prompt_logprobs"][0] is None
    assert _post(server, "/v1/chat/completions", BASE["chat"]).json()["prompt_logprobs"] is None


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_has_prompt_tokens_details(server, route):
    usage = _post(server, ROUTE[route], BASE[route]).json()["usage"]
    # NOTE: the engine does not report per-request prefix-cache hits yet, so cached_tokens is 0
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_tokenize_token_strs(server):
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "The river town", "return_token_strs": True})
    out = r.json()
    assert len(out["token_strs"]) == out["count"] == len(out["tokens"]) and all(isinstance(s, str)
                                                                                for s in out["token_strs"])
    assert "token_strs" not in _post(server, "/tokenize", {"model": MODEL, "prompt": "x"}).json()


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_first_chat_chunk_has_prompt_token_ids_and_one_choice_per_chunk(server):
    body = {**BASE["chat"], "stream": True, "n": 3, "return_token_ids": True, "max_tokens": 4, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _events(_post(server, "/v1/chat/completions", body))
    assert chunks[0]["prompt_token_ids"] and all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert sorted(c["choices"][0]["index"] for c in chunks[:3]) == [0, 1, 2]  # a role chunk per choice
    assert all(c["usage"] is not None for c in chunks)  # continuous_usage_stats
    tokens = {i: sum(len(c["choices"][0]["token_ids"] or []) for c in chunks[:-1] if c["choices"][0]["index"] == i)
              for i in range(3)}
    assert tokens == {0: 4, 1: 4, 2: 4}
    tok = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert chunks[0]["prompt_token_ids"] == tok["tokens"]


def test_completion_stream_one_choice_per_chunk(server):
    body = {**BASE["completions"], "stream": True, "n": 3, "max_tokens": 4, "ignore_eos": True,
            "prompt": ["The river", "The town"]}
    chunks = _events(_post(server, "/v1/completions", body))
    assert chunks and all(len(c["choices"]) == 1 for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks} == set(range(6))


def test_request_id_names_the_response(server):
    r = _post(server, "/v1/completions", {**BASE["completions"], "request_id": "my-req-1"})
    assert r.json()["id"] == "cmpl-my-req-1"
    r = _post(server, "/v1/chat/completions", {**BASE["chat"], "request_id": "bad\nid"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_get_model_by_id(server):
    r = httpx.get(server.base_url + f"/v1/models/{MODEL}", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    r = httpx.get(server.base_url + "/v1/models/no/such-model", headers=AUTH)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error" and "no/such-model" in err["message"]
    assert httpx.get(server.base_url + f"/v1/models/{MODEL}").status_code == 401


def test_docs_table_helper_is_markdown():
    table = markdown_table("chat")
    assert table.startswith("| field | decision |") and re.search(r"\| `include_reasoning` \| \*\*refused\*\*", table)


@pytest.mark.skipif(not FIELDS["chat"]["logprob_token_ids"].honoured, reason="the engine has no logprob_token_ids")
def test_logprob_token_ids_are_shown(server):
    body = {**BASE["completions"], "logprobs": 1, "logprob_token_ids": [3, 4], "return_tokens_as_token_ids": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    for top in r.json()["choices"][0]["logprobs"]["top_logprobs"]:
        assert {"token_id:3", "token_id:4"} <= set(top)
    body = {**BASE["chat"], "logprobs": True, "logprob_token_ids": [3, 4], "return_tokens_as_token_ids": True}
    content = _post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    for tok in content:
        assert {"token_id:3", "token_id:4"} <= {t["token"] for t in tok["top_logprobs"]}


def test_streamed_chat_echo_equals_the_whole_response(server):
    msgs = MESSAGES + [{"role": "assistant", "content": "Once upon"}]
    body = {**BASE["chat"], "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True, "max_tokens": 3, "ignore_eos": True, "seed": 1, "temperature": 0.0}
    whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    chunks = _events(_post(server, "/v1/chat/completions", {**body, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
