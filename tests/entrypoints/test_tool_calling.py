"""Tool calling on ``/v1/chat/completions`` (vLLM's shapes): tools, tool_choice, parallel_tool_calls,
tool / assistant-with-tool_calls messages, the hermes parser, streamed tool-call deltas."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loopline import AsyncLLM
from loopline.engine import LLMEngine
from loopline.entrypoints.chat_utils import ChatEncoder, tools_fallback
from loopline.entrypoints.openai.tool_parsers import TOOL_PARSERS, HermesToolParser, get_tool_parser
from loopline.entrypoints.serve_cli import TOOL_CALL_PARSERS

MODEL = "m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "The river town"}]


@pytest.fixture(scope="module")
def llm(make_engine_args):
    llm = AsyncLLM(engine=LLMEngine(make_engine_args(max_model_len=1024, max_num_batched_tokens=1024)))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def apps(llm):
    from loopline.entrypoints.openai.api_server import build_app

    return {"plain": build_app(llm, MODEL, shutdown_engine=False),
            "auto": build_app(llm, MODEL, shutdown_engine=False, enable_auto_tool_choice=True,
                              tool_call_parser="hermes")}


def post(app, body: dict) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await c.post("/v1/chat/completions", json={"model": MODEL, **body})

    return asyncio.run(main())


def stream_chunks(app, body: dict) -> list[dict]:
    r = post(app, {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def check_call(call: dict, tools=TOOLS) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    args = json.loads(call["function"]["arguments"])
    name = call["function"]["name"]
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Oslo", "Lima") and 1 <= args["days"] <= 7
    else:
        assert name == "get_time" and isinstance(args["utc"], bool)
    return args


# --- the hermes parser ------------------------------------------------------------------------------------
def test_registry_and_cli_choices_agree():
    assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS) and isinstance(get_tool_parser("hermes"), HermesToolParser)


CASES = [
    ("no calls here", "no calls here", []),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.", [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": "{\\"b\\": [2]}"}'
     '</tool_call>', None, [("f", {}), ("g", {"b": [2]})]),
    ('a <tool_call>{"name": broken}</tool_call> b', 'a <tool_call>{"name": broken}</tool_call> b', []),
    ('x <tool_call>{"name": "f", "arguments": {}}', 'x <tool_call>{"name": "f", "arguments": {}}', []),
    ('<tool_call>{"nope": 1}</tool_call> <tool_call>{"name": "h", "arguments": {"z": "<"}}</tool_call>',
     '<tool_call>{"nope": 1}</tool_call>', [("h", {"z": "<"})]),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes_extract(text, content, calls):
    got_content, got = HermesToolParser().extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("text,content,calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_stream_reassembles(text, content, calls, step):
    p = HermesToolParser()
    pieces = [p.feed(text[i:i + step]) for i in range(0, len(text), step)] + [p.finish()]
    streamed = "".join(x.content for x in pieces)
    deltas = [d for x in pieces for d in x.tool_calls]
    assembled = _assemble(deltas)
    if text.rfind("<tool_call>") > text.rfind("</tool_call>"):  # cut off inside an announced call: the stream keeps the partial call (documented)
        assert streamed.strip() == "x" and [c["name"] for c in assembled.values()] == ["f"]
        return
    assert sorted(assembled) == list(range(len(calls)))
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(assembled.items())] == calls
    # the same argument strings as the whole extraction
    assert [c["arguments"] for _, c in sorted(assembled.items())] == [c.arguments for c in HermesToolParser().extract(text)[1]]
    # the streamed content is the text outside the calls (not stripped)
    assert streamed.strip() == (content or "")


def _assemble(deltas: list[dict]) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.get("id"):
            assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"].get("arguments", "")}
        else:
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return calls


def test_hermes_streams_arguments_in_pieces():
    p = HermesToolParser()
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": {"b": 1}, "c": "long text here"}}</tool_call>'
    pieces = [p.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [p.finish()]
    deltas = [d for x in pieces for d in x.tool_calls]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""} and len(deltas) > 3
    assert json.loads(_assemble(deltas)[0]["arguments"]) == {"a": {"b": 1}, "c": "long text here"}


# --- rendering ---------------------------------------------------------------------------------------------
def test_template_without_tools_gets_the_hermes_fallback(llm):
    enc = ChatEncoder(llm.tokenizer, None)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo", "days": 1}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    text = enc.render(conv, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions.") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert tools_fallback(MESSAGES, [])[0] == MESSAGES[0]


def test_template_with_tools_gets_them():
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.name }}{{ m.tool_calls[0].function.arguments.utc }}{% endif %};"
                "{% endfor %}")

    class Tok:
        chat_template = template

        def apply_chat_template(self, conv, tokenize, add_generation_prompt, chat_template, **kw):
            import jinja2
            return jinja2.Environment().from_string(chat_template or template).render(messages=conv, **kw)

    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"utc": 1}'}}]}]
    assert ChatEncoder(Tok(), None).render(conv, tools=TOOLS) == "[get_weather][get_time]user:q;assistant:get_time1;"


# --- over HTTP ----------------------------------------------------------------------------------------------
# (the default temperature with a seed, like the second: slow)
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                      pytest.param({"seed": 11}, marks=pytest.mark.slow)])
def test_required_yields_valid_calls(apps, sampling):
    r = post(apps["plain"], {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
                             "n": 2, "parallel_tool_calls": False, **sampling})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] is None and msg["tool_calls"], choice
        for call in msg["tool_calls"]:
            check_call(call)


def test_required_with_parallel_calls(apps):
    """Parallel calls (the default): an array of one or more calls; a choice cut off by max_tokens keeps
    its text as content (the tiny model may go on adding calls)."""
    r = post(apps["plain"], {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
                             "temperature": 1.0, "seed": 3, "n": 2})  # (n=4 took twice as long)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        if c["finish_reason"] == "length":
            assert c["message"]["content"].startswith('[{"name":') and c["message"]["tool_calls"] == []
        else:
            assert c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"]
            for call in c["message"]["tool_calls"]:
                check_call(call)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_named_function_yields_its_arguments(apps, sampling):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = post(apps["plain"], {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120,
                             **sampling})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1
    assert c["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    check_call(c["message"]["tool_calls"][0])


def test_none_gives_plain_content(apps):
    for app in apps.values():
        r = post(app, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert isinstance(c["message"]["content"], str) and c["message"]["tool_calls"] == []
        assert c["finish_reason"] in ("stop", "length")


def test_auto_parses_calls_from_the_text(apps, monkeypatch):
    """The tiny model never writes <tool_call> itself: the completion's text is replaced with one that does."""
    from loopline.entrypoints.openai import serving_chat

    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    real = serving_chat._Tools.extract
    monkeypatch.setattr(serving_chat._Tools, "extract", lambda self, _t: real(self, text))
    r = post(apps["auto"], {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "ignore_eos": True,
                            "stop": ["zzzz"]})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "Let me check." and msg["tool_calls"][0]["function"]["name"] == "get_time"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"utc": True}
    # auto without the parser's text: plain content
    monkeypatch.setattr(serving_chat._Tools, "extract", real)
    r = post(apps["auto"], {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 6})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


def _streamed_calls(chunks: list[dict]) -> tuple[dict[int, dict], list[str]]:
    calls: dict[int, dict] = {}
    finish = []
    for ch in chunks:
        for c in ch["choices"]:
            for d in c["delta"].get("tool_calls") or []:
                slot = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
                if d.get("id"):
                    assert slot["id"] is None
                    slot["id"] = d["id"]
                    slot["name"] = d["function"]["name"]
                slot["arguments"] += d["function"].get("arguments", "")
            if c["finish_reason"]:
                finish.append(c["finish_reason"])
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_the_whole_response(apps, tool_choice):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 200, "seed": 2,
            "temperature": 1.0, "parallel_tool_calls": False}
    whole = post(apps["plain"], body).json()["choices"][0]["message"]["tool_calls"]
    calls, finish = _streamed_calls(stream_chunks(apps["plain"], body))
    assert len(calls) == len(whole)
    assert finish == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_and_assistant_tool_calls_messages_are_accepted(apps):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = post(apps["plain"], {"messages": messages, "tools": TOOLS, "max_tokens": 4, "return_prompt_text": True})
    assert r.status_code == 200, r.text
    assert "<tool_response>\nsunny\n</tool_response>" in r.json()["prompt_text"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 70000}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
])
def test_bad_tool_requests_are_400s_naming_the_field(apps, body, param):
    r = post(apps["plain"], {"messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param == "tool_choice" and body.get("tool_choice") == "auto":
        assert "--enable-auto-tool-choice" in err["message"]


def test_server_flags(llm):
    from loopline.entrypoints.cli import main
    from loopline.entrypoints.openai.api_server import build_app

    with pytest.raises(Exception):
        build_app(llm, MODEL, shutdown_engine=False, enable_auto_tool_choice=True)
    with pytest.raises(Exception):
        build_app(llm, MODEL, shutdown_engine=False, tool_call_parser="nope")
    assert main(["serve", "--enable-auto-tool-choice"]) != 0
    with pytest.raises(SystemExit):  # argparse: not a registered parser
        main(["serve", "--tool-call-parser", "nope"])


def test_offline_chat_takes_tools(tiny_gqa):
    from loopline import LLM, SamplingParams
    from loopline.structured.params import StructuredOutputsParams

    llm = LLM(str(tiny_gqa.path), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=1024,
              max_num_batched_tokens=1024)
    try:
        plain = llm.encode_chat(MESSAGES)
        with_tools = llm._chat.encode(MESSAGES, tools=TOOLS)
        assert len(with_tools) > len(plain)
        params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputsParams(
            json=WEATHER["function"]["parameters"], disable_any_whitespace=True))
        out = llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS)[0]
        assert out.prompt_token_ids == with_tools
        json.loads(out.outputs[0].text)
    finally:
        llm.shutdown() if hasattr(llm, "shutdown") else None


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_stream_deltas_equal_the_whole_extraction(parallel):
    """The streamed (auto, hermes) deltas of a text reassemble to what the whole response shows."""
    from loopline.entrypoints.openai.serving_chat import _Tools, _finish

    text = ('ok <tool_call>{"name": "get_time", "arguments": {"utc": false}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}</tool_call>')
    whole = _Tools("auto", None, "hermes", parallel).extract(text)
    tools = _Tools("auto", None, "hermes", parallel)
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    out = [tools.stream(0, p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(c for c, _, _ in out).strip() == whole[0] == "ok"
    calls = _assemble([d for _, ds, _ in out for d in ds])
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [(c.name, c.arguments) for c in whole[1]]
    assert len(calls) == (2 if parallel else 1) and out[-1][2] and _finish("stop", out[-1][2]) == "tool_calls"


def test_tools_without_tool_choice_mean_auto_on_an_auto_server(apps):
    from loopline.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)
    assert req.tool_mode(True) == ("auto", None) and req.tool_mode(False) == ("none", None)
    chunks = stream_chunks(apps["auto"], {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 6})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("stop", "length")
