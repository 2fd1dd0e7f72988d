"""Resource limits and fairness: large inputs do not stall other requests, a client that leaves takes
all of its requests with it at once (also while a multi-prompt request is still being added)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from loopline.entrypoints.openai.api_server import build_app

MODEL = "tiny-limits"


@pytest.fixture(scope="module")
def srv(async_llm, serve_app):
    return serve_app(build_app(async_llm, MODEL, shutdown_engine=False, enable_rl_api=True,
                               max_prompts_per_request=5000))


def _latencies_while(srv, busy: threading.Thread, path: str = "/health") -> list[float]:
    out = []
    while busy.is_alive():
        t0 = time.monotonic()
        assert httpx.get(srv.base_url + path, timeout=30).status_code == 200
        out.append(time.monotonic() - t0)
        time.sleep(0.02)
    return out


def test_a_large_tokenize_does_not_block_health(srv):
    text = "the river town woke slowly and " * 70_000  # ~2 MB
    result = {}

    def tokenize():
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/tokenize", json={"prompt": text}, timeout=120)
        result.update(status=r.status_code, count=r.json().get("count"), took=time.monotonic() - t0)

    busy = threading.Thread(target=tokenize)
    busy.start()
    latencies = _latencies_while(srv, busy)
    busy.join()
    assert result["status"] == 200 and result["count"] > 100_000
    # tokenizing 2 MB takes ~3 s: on the event loop, /health would wait that long
    assert latencies and max(latencies) < 1.5, (max(latencies), result["took"])


def test_a_large_prompt_does_not_delay_a_small_request(srv):
    """A 3 MB prompt (too long for the context: 400) is tokenized off the engine thread and the
    event loop, so an unrelated 2-token request meanwhile is not held up behind it."""
    text = "the river town woke slowly and " * 100_000
    result = {}

    def big():
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=120)
        result.update(status=r.status_code, param=r.json()["error"]["param"])

    busy = threading.Thread(target=big)
    busy.start()
    small = []
    while busy.is_alive():
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        small.append(time.monotonic() - t0)
    busy.join()
    assert result == {"status": 400, "param": "prompt"}  # longer than max_model_len
    assert small and max(small) < 2.0, small  # tokenizing 3 MB takes ~5 s: on the engine thread, they would wait


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_all_its_prompts_at_once(srv, async_llm, stream):
    body = {"prompt": [[5, 6, 7, 8]] * 3000, "max_tokens": 100, "ignore_eos": True, "stream": stream}
    left = {}

    def client():
        try:
            with httpx.Client(timeout=httpx.Timeout(60, read=0.5)) as http:
                with http.stream("POST", srv.base_url + "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        break  # one event, then leave
        except httpx.ReadTimeout:
            pass
        left["at"] = time.monotonic()

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 60
    while async_llm.snapshot.num_unfinished == 0 and t.is_alive():  # the prompts reached the engine
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t.join(60)
    while async_llm.snapshot.num_unfinished or async_llm.snapshot.kv_used_blocks:
        assert time.monotonic() - left["at"] < 5, (async_llm.snapshot, "requests outlived the client")
        time.sleep(0.01)
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
