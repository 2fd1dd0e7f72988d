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


# --- cache_salt: pages are shared only between requests of equal salts --------------------------------------
def test_offline_cache_salt_separates_prefix_cache(tiny_gqa):
    llm = _llm(tiny_gqa, True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def cached(tail: list[int], salt: str | None) -> int:
        prompt = {"prompt_token_ids": PREFIX + tail, **({"cache_salt": salt} if salt else {})}
        return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens

    assert cached([20], "tenant-a") == 0
    assert cached([21], "tenant-b") == 0  # another salt finds nothing
    assert cached([22], None) == 0  # nor does an unsalted request
    assert cached([23], "tenant-a") == len(PREFIX)  # its own salt finds its pages
    assert cached([24], "tenant-b") == len(PREFIX)
    assert cached([25], None) == len(PREFIX)
    # text prompts carry it too
    text = "the same words every time, long enough for two pages"
    assert llm.generate([{"prompt": text, "cache_salt": "x"}], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([{"prompt": text, "cache_salt": "y"}], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([{"prompt": text, "cache_salt": "x"}], params, use_tqdm=False)[0].num_cached_tokens > 0


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_offline_bad_cache_salt_is_refused(tiny_gqa, salt):
    from loopline.errors import InvalidRequestError

    llm = _llm(tiny_gqa, True)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([{"prompt_token_ids": PREFIX, "cache_salt": salt}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert info.value.param == "cache_salt"


def test_http_cache_salt(cached_server):
    url = cached_server.base_url
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "ignore_eos": True}

    def cached(route: str, extra: dict) -> int:
        r = httpx.post(url + route, json={**body, **extra}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    salted_prefix = [50, 51, 52, 53, 54, 55, 56, 57]
    assert cached("/v1/completions", {"prompt": salted_prefix + [1], "cache_salt": "a"}) == 0
    assert cached("/v1/completions", {"prompt": salted_prefix + [2], "cache_salt": "b"}) == 0
    assert cached("/v1/completions", {"prompt": salted_prefix + [3]}) == 0
    assert cached("/v1/completions", {"prompt": salted_prefix + [4], "cache_salt": "a"}) == len(salted_prefix)
    msgs = [{"role": "user", "content": "a salted conversation about the prefix cache " * 2}]
    assert cached("/v1/chat/completions", {"messages": msgs, "cache_salt": "c"}) == 0
    assert cached("/v1/chat/completions", {"messages": msgs, "cache_salt": "d"}) == 0
    assert cached("/v1/chat/completions", {"messages": msgs, "cache_salt": "c"}) > 0
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": [1, 2], "cache_salt": ""}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
