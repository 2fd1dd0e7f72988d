"""/metrics under vLLM's own names (``vllm:`` prefix, issue #42): every series vLLM's dashboards read is
served, beside loopline's, with values that add up to the requests and tokens sent."""
from __future__ import annotations

import re

import httpx
import pytest

MODEL, AUTH = "tiny-test", {"Authorization": "Bearer k"}
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]]
MAX_TOKENS = (3, 4, 2)


@pytest.fixture(scope="module")
def scraped(tiny_gqa):
    from loopline import AsyncLLM, EngineArgs
    from loopline.entrypoints.openai.api_server import build_app
    from tests.entrypoints.conftest import RunningServer

    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", block_size=4,
                              max_model_len=128, max_num_seqs=4, enable_prefix_caching=True))
    srv = RunningServer(build_app(llm, MODEL, api_key="k", shutdown_engine=False))
    try:
        for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
            r = httpx.post(srv.base_url + "/v1/completions", headers=AUTH, timeout=60,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200, r.text
        yield httpx.get(srv.base_url + "/metrics").text, llm
    finally:
        srv.stop()
        llm.shutdown()


def _value(text: str, name: str, **labels) -> float:
    total, found = 0.0, False
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total, found = total + float(m.group(2)), True
    assert found, f"{name} {labels} not exported"
    return total


def test_vllm_series_are_served(scraped):
    text, _ = scraped
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind in {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                       "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
                       "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
                       "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
                       "vllm:e2e_request_latency_seconds": "histogram", "vllm:iteration_tokens_total": "histogram",
                       "vllm:cache_config_info": "gauge", "vllm:request_params_n": "histogram",
                       "vllm:request_params_max_tokens": "histogram", "vllm:num_requests_waiting_by_reason": "gauge",
                       "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter",
                       "vllm:prefix_cache_hits": "counter", "loopline:prompt_tokens": "counter",
                       "loopline:iteration_tokens_total": "histogram"}.items():
        got = types.get(name) or types.get(name + "_total")  # counters: TYPE under the _total name
        assert got == kind, (name, got)


def test_vllm_series_values(scraped):
    text, _ = scraped
    prompt, generated = sum(map(len, PROMPTS)), sum(MAX_TOKENS)
    assert _value(text, "vllm:prompt_tokens_total") == prompt == _value(text, "loopline:prompt_tokens_total")
    assert _value(text, "vllm:generation_tokens_total") == generated
    assert _value(text, "vllm:request_success_total", finished_reason="length") == len(PROMPTS)
    assert _value(text, "vllm:request_success_total", finished_reason="stop") == 0
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_params_n",
              "request_params_max_tokens"):
        assert _value(text, f"vllm:{h}_count") == len(PROMPTS), h
    assert _value(text, "vllm:request_params_max_tokens_sum") == generated
    assert _value(text, "vllm:request_params_n_sum") == len(PROMPTS)
    assert _value(text, "vllm:inter_token_latency_seconds_count") == generated - len(PROMPTS)
    # per step: each generated token once, each prompt once (when its prefill finished)
    assert _value(text, "vllm:iteration_tokens_total_sum") == prompt + generated
    assert _value(text, "vllm:num_requests_running") == 0
    assert _value(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert _value(text, "vllm:num_preemptions_total") == 0
    assert _value(text, "vllm:request_num_preemptions_count") == len(PROMPTS)
    assert _value(text, "vllm:request_num_preemptions_sum") == 0
    assert _value(text, "vllm:prefix_cache_queries_total") >= 0


def test_cache_config_info_labels(scraped):
    text, llm = scraped
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", text, re.M)
    assert m, "vllm:cache_config_info not exported"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    assert labels["block_size"] == "4" and labels["enable_prefix_caching"] == "True"
    assert labels["cache_dtype"] == "auto" and labels["engine"] == "0" and labels["model_name"] == MODEL
    assert labels["num_gpu_blocks"] == str(llm.info.kv_pages) and int(labels["num_gpu_blocks"]) > 0


def test_spec_decode_series_only_with_speculation(scraped, tiny_gqa):
    """vLLM's spec_decode counters: absent without speculation; with it, the engine's own counts, the
    accepted drafts split by position."""
    from loopline import AsyncLLM, EngineArgs
    from loopline.entrypoints.openai.api_server import build_app
    from tests.entrypoints.conftest import RunningServer

    assert "vllm:spec_decode" not in scraped[0]
    spec = {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False}
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", block_size=4,
                              max_model_len=128, max_num_seqs=4, speculative_config=spec))
    srv = RunningServer(build_app(llm, MODEL, api_key="k", shutdown_engine=False))
    try:
        for prompt in PROMPTS:
            r = httpx.post(srv.base_url + "/v1/completions", headers=AUTH, timeout=60,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                                 "temperature": 0})
            assert r.status_code == 200, r.text
        off = httpx.post(srv.base_url + "/v1/completions", headers=AUTH, timeout=60,
                         json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "speculate": False})
        assert off.status_code == 200, off.text
        bad = httpx.post(srv.base_url + "/v1/completions", headers=AUTH, timeout=60,
                         json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "speculate": "sometimes"})
        assert bad.status_code == 400 and "speculate" in bad.text
        text = httpx.get(srv.base_url + "/metrics").text
    finally:
        srv.stop()
        llm.shutdown()
    drafts = _value(text, "vllm:spec_decode_num_drafts_total")
    proposed = _value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _value(text, "vllm:spec_decode_num_accepted_tokens_total")
    # three requests of 12 tokens: each round commits at most 3, so at least 4 rounds each
    assert drafts >= 3 * 4 and proposed == 2 * drafts and 0 <= accepted <= proposed
    per_pos = [_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(2)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
