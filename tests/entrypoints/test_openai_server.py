"""The OpenAI-compatible server over real loopback sockets, driven by the official ``openai`` client."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

API_KEY = "test-key"  # as the `server` fixture (conftest.py) is built
MODEL = "tiny-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The river town woke slowly."


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metric(server, name: str, **labels) -> float:
    """The value of one sample on /metrics (0 when absent)."""
    text = httpx.get(server.base_url + "/metrics").text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def tokenize(server, **body) -> dict:
    return httpx.post(server.base_url + "/tokenize", json=body, headers=AUTH).json()


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def stream_text(stream) -> tuple[str, str | None, list]:
    text, finish, chunks = [], None, []
    for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            text.append(c.text)
            finish = c.finish_reason or finish
    return "".join(text), finish, chunks


# --- completions ---------------------------------------------------------------------------------
def test_completion_basic_and_usage(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=1, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert choice.exit_depths == [4] * 6  # fixed depth (threshold 1.0): every token runs all 4 loops
    n_prompt = tokenize(server, prompt=PROMPT)["count"]
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 6 and r.usage.total_tokens == n_prompt + 6


def test_default_max_tokens_is_16_and_null_means_default(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, seed=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": None, "n": None, "stream": None, "temperature": None,
            "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "some_unknown_field": 1}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "some_unknown_field"  # refused, never ignored


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, seed=7, temperature=1.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    text, finish, chunks = stream_text(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert text == whole.choices[0].text and finish == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    depths = [d for ch in chunks for c in ch.choices for d in c.exit_depths]
    assert depths == whole.choices[0].exit_depths


def test_seeded_reproducibility(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=123, **kw).choices[0].text
    b = client.completions.create(seed=123, **kw).choices[0].text
    assert a == b


def test_n_greater_than_one(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    texts = {i: "" for i in range(3)}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, seed=5, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in r.choices}


def test_stop_strings_streamed_and_not(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, seed=11, temperature=1.0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # a stop string that first occurs after the start of the text, made of complete characters
    idx = next(i for i in range(1, len(full) - 1) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stop = full[idx:idx + 2]
    r = client.completions.create(stop=[stop], **kw).choices[0]
    assert r.text == full[:idx] and r.finish_reason == "stop" and r.stop_reason == stop
    text, finish, _ = stream_text(client.completions.create(stop=stop, stream=True, **kw))
    assert text == r.text and finish == "stop"


def test_token_id_prompts(server, client):
    ids = tokenize(server, prompt=PROMPT)["tokens"]
    kw = dict(model=MODEL, max_tokens=5, seed=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0]
    by_ids = client.completions.create(prompt=ids, **kw).choices[0]
    assert by_ids.text == by_text.text and by_ids.prompt_token_ids == ids and len(by_ids.token_ids) == 5
    multi = client.completions.create(prompt=[ids, ids[:3]], **kw)
    assert [c.index for c in multi.choices] == [0, 1]
    assert multi.choices[0].text == by_text.text and multi.choices[1].prompt_token_ids == ids[:3]
    assert multi.usage.prompt_tokens == len(ids) + 3
    strs = client.completions.create(prompt=[PROMPT, "Hello"], **kw)
    assert len(strs.choices) == 2 and strs.choices[0].text == by_text.text


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, seed=9,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    e = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=1, seed=9, echo=True,
                                  extra_body={"ignore_eos": True})
    ch = e.choices[0]
    n_prompt = e.usage.prompt_tokens
    assert ch.text == PROMPT + r.choices[0].text
    assert len(ch.logprobs.tokens) == n_prompt + 4 and ch.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in ch.logprobs.token_logprobs[1:])
    assert ch.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    # eval harnesses score a prompt with echo + max_tokens=0
    z = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert z.choices[0].text == PROMPT and len(z.choices[0].logprobs.tokens) == n_prompt
    assert z.usage.completion_tokens == 0


def test_extra_loop_fields_and_exit_depths(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=4,
                                  extra_body={"ignore_eos": True, "exit_threshold": 0.5, "min_loops": 1, "max_loops": 3,
                                              "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "priority": 0})
    depths = r.choices[0].exit_depths
    assert len(depths) == 8 and all(1 <= d <= 3 for d in depths)
    fixed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=4,
                                      extra_body={"ignore_eos": True, "min_loops": 2, "max_loops": 2})
    assert fixed.choices[0].exit_depths == [2] * 4


def test_stop_token_ids(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=21,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    stop_id = full.token_ids[2]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=21,
                                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "stop_token_ids": [stop_id]}).choices[0]
    first = full.token_ids.index(stop_id)
    assert cut.token_ids == full.token_ids[:first + 1] and cut.finish_reason == "stop" and cut.stop_reason == stop_id


# --- chat ----------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


def test_chat_streamed_and_not(server, client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, seed=2, temperature=1.0)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(r.choices[0].exit_depths) <= 6
    text, roles, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"] and text == r.choices[0].message.content and finish == r.choices[0].finish_reason
    assert r.usage.prompt_tokens == tokenize(server, messages=MESSAGES)["count"]


def test_chat_logprobs_n_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4, n=2, seed=8,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


# --- batching, disconnects, limits ---------------------------------------------------------------
def test_concurrent_requests_are_batched(server, client):
    rows_le_1 = metric(server, "loopline:rows_per_step_bucket", le="1.0")
    steps = metric(server, "loopline:rows_per_step_count")
    results, barrier = [None] * 4, threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, seed=i,
                                               extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.usage.completion_tokens == 8 for r in results)
    new_steps = metric(server, "loopline:rows_per_step_count") - steps
    new_single = metric(server, "loopline:rows_per_step_bucket", le="1.0") - rows_le_1
    assert new_steps > 0 and new_single < new_steps  # some steps ran several requests' rows together


def test_disconnect_aborts_and_frees_kv(server, async_llm):
    aborted = metric(server, "loopline:requests_total", status="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            assert async_llm.snapshot.kv_used_blocks > 0
    wait_for(lambda: metric(server, "loopline:requests_total", status="abort") > aborted)
    wait_for(lambda: async_llm.snapshot.kv_used_blocks == 0)
    assert metric(server, "loopline:kv_cache_used_blocks") == 0


def test_disconnect_while_waiting_for_a_whole_response_aborts(server, async_llm):
    aborted = metric(server, "loopline:requests_total", status="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=0.3))
    wait_for(lambda: metric(server, "loopline:requests_total", status="abort") > aborted)
    wait_for(lambda: async_llm.snapshot.kv_used_blocks == 0)


def test_too_many_requests_get_429(async_llm, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    small = serve_app(build_app(async_llm, MODEL, max_concurrent_requests=1, shutdown_engine=False))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", small.base_url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()  # NOTE: keep it referenced: a collected iterator closes the connection
            assert next(lines).startswith("data: ")
            busy = http.post(small.base_url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT})
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "rate_limit_exceeded"
        wait_for(lambda: http.post(small.base_url + "/v1/completions",
                                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200)


# --- bad input -----------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt_token_ids"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "max_loops": 9}, 400, "max_loops"),
    ({"model": MODEL, "prompt": "x", "exit_threshold": 2.0}, 400, "exit_threshold"),
    ({"model": MODEL, "prompt": "x", "exit_mode": "lookahead"}, 400, "exit_mode"),  # no head beside the weights
    ({"model": MODEL, "prompt": "x", "exit_mode": "sometimes"}, 400, "exit_mode"),
    ({"model": MODEL, "prompt": "x", "lookahead_threshold": 1.5}, 400, "lookahead_threshold"),
    ({"model": MODEL, "prompt": "word " * 400}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests_get_4xx(server, body, status, param):
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_bad_chat_and_other_bad_input_then_success(server, client):
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": "hi"},
                 {"model": MODEL, "messages": [{"content": "no role"}]},
                 {"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}):
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.base_url + "/v1/completions", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-3)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    # the server keeps serving, unaffected
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
    assert httpx.get(server.base_url + "/health").status_code == 200


# --- other routes --------------------------------------------------------------------------------
def test_models_health_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200
    tok = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, headers=AUTH).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 256
    detok = httpx.post(server.base_url + "/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()
    assert detok["prompt"] == PROMPT
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [-1]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics_content(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("loopline:requests_total", "loopline:prompt_tokens_total", "loopline:generation_tokens_total",
                 "loopline:time_to_first_token_seconds_bucket", "loopline:inter_token_latency_seconds_bucket",
                 "loopline:e2e_request_latency_seconds_bucket", "loopline:num_requests_running",
                 "loopline:num_requests_waiting", "loopline:kv_cache_used_blocks", "loopline:exit_depth_bucket",
                 "loopline:engine_steps_total", "loopline:rows_per_step_bucket"):
        assert re.search(rf"^{re.escape(name)}[{{ ]", text, re.M), name
    for status in ("stop", "length", "abort", "error", "rejected"):
        assert f'status="{status}"' in text
    assert metric(server, "loopline:requests_total", status="length") >= 1
    assert metric(server, "loopline:requests_total", status="error") >= 1
    assert metric(server, "loopline:generation_tokens_total") >= 2
    assert metric(server, "loopline:exit_depth_bucket", le="4.0") == metric(server, "loopline:exit_depth_count")


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # an engine process of its own (~5 s on 2 cores); default run: the prefix cache's counts
# (tests/core/test_kv_features.py), cached tokens over HTTP (tests/engine/test_cached_tokens.py), the series
# (test_metrics_content)
def test_prefix_cache_hits_in_metrics(make_engine_args, serve_app):
    from loopline import AsyncLLM
    from loopline.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(make_engine_args(enable_prefix_caching=True, block_size=4))
    try:
        srv = serve_app(build_app(llm, MODEL, api_key=None, max_concurrent_requests=4, shutdown_engine=False))
        prompt = list(range(10, 40))  # 30 tokens: 7 full pages before the last token
        for _ in range(2):
            r = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200
        assert metric(srv, "loopline:prefix_cache_queries_total") == 60
        assert metric(srv, "loopline:prefix_cache_hits_total") == 28
        assert metric(srv, "loopline:num_preemptions_total") == 0
    finally:
        llm.shutdown()
