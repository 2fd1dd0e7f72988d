"""vLLM's serve conventions: /ping, the startup line, stats logging on by default."""
from __future__ import annotations

import httpx

from loopline.config import EngineArgs
from loopline.entrypoints.openai.startup import kv_pool_summary, startup_line


def test_ping_answers_like_health(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, server.base_url + "/ping")  # no API key needed, as /health
        assert r.status_code == 200
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_startup_line_reports_device_dtype_kv_pool_and_rl_api(async_llm):
    info = async_llm.info  # what the engine process reported when it started
    kv = kv_pool_summary(info)
    mc, cfg = info.model_config, info.config
    page_bytes = 2 * mc.num_hidden_layers * cfg.block_size * mc.num_key_value_heads * mc.head_dim * 4  # float32
    assert kv["pages"] == async_llm.snapshot.kv_total_blocks and kv["planes"] == mc.total_ut_steps
    assert abs(kv["gib"] - kv["pages"] * page_bytes / 2**30) < 1e-9
    # the fixture's max_model_len is 256 tokens: 4 planes x 16 pages per request
    assert abs(kv["max_concurrency"] - kv["pages"] / (4 * 16)) < 1e-9
    line = startup_line(info, rl_api=False)
    assert line.startswith("device cpu, dtype float32, KV layout last_exited; KV cache ")
    assert f"{kv['pages']} pages of 16 tokens" in line and "requests of max_model_len 256 at once" in line
    assert line.endswith("RL API off") and "\n" not in line
    assert startup_line(info, rl_api=True).endswith("RL API on")


def test_stats_logging_is_on_by_default_every_10_s():
    args = EngineArgs()
    assert args.disable_log_stats is False and args.log_stats_interval == 10.0
