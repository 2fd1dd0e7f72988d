"""/metrics under vLLM's names (loopline: prefix), the request timing series, and the Grafana dashboard."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from loopline.entrypoints.openai.metrics import ServerMetrics
from loopline.engine.deltas import CompletionDelta, OutputDelta
from loopline.outputs import RequestMetrics

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "tiny-test"


def _exported(server) -> tuple[str, dict[str, str]]:
    httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
               json={"model": MODEL, "prompt": "The cat sat", "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(server.base_url + "/metrics").text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    return text, types


def _family(sample: str) -> str:
    return re.sub(r"_(bucket|sum|count|created)$", "", sample)


def test_every_documented_metric_is_exported_with_its_type(server):
    text, types = _exported(server)
    doc = (ROOT / "docs" / "serving.md").read_text()
    table = doc[doc.index("## Metrics"):doc.index("## From Python")]
    rows = [r for r in table.splitlines() if r.startswith("| `loopline:")]
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        kind = cells[2]
        for name in re.findall(r"`(loopline:[a-z0-9_]+)", cells[0]):
            sample = name if kind != "counter" or name.endswith("_total") else name + "_total"
            assert types.get(sample) == kind, (name, types.get(sample))  # the text format types a counter's _total
            assert re.search(rf"^{re.escape(sample)}(_bucket|_count)?[{{ ]", text, re.M), name
        vllm = re.findall(r"`(vllm:[a-z0-9_]+)", cells[1])
        # same name after the prefix, where vLLM has one (ITL also names vLLM's former TPOT series)
        assert not vllm or vllm[0].removeprefix("vllm:") == re.findall(r"`loopline:([a-z0-9_]+)", cells[0])[0]


def test_request_series_after_a_completion(server):
    text, _ = _exported(server)

    def value(name: str, **labels) -> float:
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert value("loopline:request_success_total", finished_reason="length") >= 1
    assert value("loopline:request_generation_tokens_count") >= 1
    assert value("loopline:request_time_per_output_token_seconds_count") >= 1
    assert value("loopline:iteration_tokens_total_count") >= 1
    assert value("loopline:num_preemptions_total") == 0


def _delta(finished: bool, new_tokens: int, timing: RequestMetrics) -> OutputDelta:
    """What a request of prompt [1, 2, 3] added: ``new_tokens`` tokens."""
    comp = CompletionDelta(0, "x" * new_tokens, 0, list(range(new_tokens)), [4] * new_tokens, [0] * new_tokens, None,
                           None, "length" if finished else None, None, 0)
    return OutputDelta("r", [comp], finished, 0, timing)


def test_tracker_splits_queue_prefill_decode_from_engine_timing(async_llm):
    m = ServerMetrics(async_llm, "m")
    tracker = m.tracker()
    tracker.accepted(3)
    timing = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                            last_token_time=103.0)
    tracker.observe(_delta(False, 1, timing))
    tracker.observe(_delta(True, 4, timing))  # 5 tokens in all
    text = m.render().decode()

    def sample(name: str) -> float:
        return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M).group(1))

    assert sample("loopline:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert sample("loopline:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert sample("loopline:request_decode_time_seconds_sum") == pytest.approx(2.0)
    assert sample("loopline:request_inference_time_seconds_sum") == pytest.approx(2.5)
    assert sample("loopline:request_prompt_tokens_sum") == 3 and sample("loopline:request_generation_tokens_sum") == 5
    assert sample("loopline:request_time_per_output_token_seconds_count") == 1
    # without the engine's first_scheduled_time nothing is guessed
    t2 = m.tracker()
    t2.observe(_delta(True, 2, RequestMetrics(arrival_time=1.0, first_token_time=2.0, last_token_time=3.0)))
    assert sample("loopline:request_queue_time_seconds_count") == 1


def test_grafana_dashboard_charts_exported_series(server):
    dash = json.loads((ROOT / "docs" / "grafana-loopline.json").read_text())
    _, types = _exported(server)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {_family(n) for e in exprs for n in re.findall(r"loopline:[a-z0-9_]+", e)}
    exported = set(types)
    assert used and used <= exported, used - exported
    for series in ("loopline:time_to_first_token_seconds", "loopline:inter_token_latency_seconds",
                   "loopline:e2e_request_latency_seconds", "loopline:request_queue_time_seconds",
                   "loopline:num_requests_running", "loopline:kv_cache_usage_perc", "loopline:exit_depth"):
        assert series in used or series + "_total" in used, series
    depth = [p for p in dash["panels"] if any("exit_depth_bucket" in t["expr"] for t in p["targets"])]
    assert {p["type"] for p in depth} >= {"heatmap", "bargauge"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
