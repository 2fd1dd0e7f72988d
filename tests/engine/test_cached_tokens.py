"""``RequestOutput.num_cached_tokens`` and the usage's ``prompt_tokens_details.cached_tokens`` (issue #42):
the prefix cache's hits of a request's prompt reach its outputs, offline and over HTTP (streamed too);
without prefix caching they are 0."""
from __future__ import annotations

import json

import httpx
import pytest

from loopline import LLM, SamplingParams

BLOCK = 4
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two full pages
MODEL, AUTH = "tiny-test", {"Authorization": "Bearer k"}


def _llm(tiny, caching: bool) -> LLM:
    return LLM(model=str(tiny.path), dtype="float32", device="cpu", block_size=BLOCK, max_model_len=128,
               enable_prefix_caching=caching, disable_log_stats=True)


@pytest.mark.parametrize("caching", [True, False])
def test_offline_num_cached_tokens(tiny_gqa, caching):
    llm = _llm(tiny_gqa, caching)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PREFIX + [20, 21]}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": PREFIX + [30, 31, 32]}], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # with caching: the two shared full pages
    assert second.num_cached_tokens == (len(PREFIX) if caching else 0)


@pytest.fixture(scope="module")
def cached_server(tiny_gqa):
    from loopline import AsyncLLM, EngineArgs
    from loopline.entrypoints.openai.api_server import build_app
    from tests.entrypoints.conftest import RunningServer

    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", block_size=BLOCK,
                              max_model_len=128, max_num_seqs=4, enable_prefix_caching=True))
    srv = RunningServer(build_app(llm, MODEL, api_key="k", shutdown_engine=False))
    yield srv
    srv.stop()
    llm.shutdown()


def test_http_usage_reports_cached_tokens(cached_server):
    url = cached_server.base_url
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": PREFIX + [40]}, headers=AUTH, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": PREFIX + [41]}, headers=AUTH, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
    # streamed, with include_usage: the last chunk carries it
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "prompt": PREFIX + [42], "stream": True,
                            "stream_options": {"include_usage": True}}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
    # chat: the same messages twice share their templated prompt's full pages
    msgs = [{"role": "user", "content": "tell me about the shared prefix cache " * 2}]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0}
    first = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()["usage"]
    again = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] <= first["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] % BLOCK == 0  # whole pages
