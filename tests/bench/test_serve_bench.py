"""``loopline bench serve``'s serving workload: ShareGPT-like lengths, pooled percentiles, several rates with
an immediate-replay phase against a real tiny server, the peak-capacity search and ``bench compare``."""
from __future__ import annotations

import json
import random
import statistics

import numpy as np
import pytest

from loopline.bench.capacity import TTFTBound, find_capacity
from loopline.bench.metrics import RequestTiming, latency_metrics
from loopline.bench.report import serve_comparison
from loopline.bench.serve import parse_counters
from loopline.bench.workload import (SHAREGPT_INPUT_MEAN, SHAREGPT_MEAN_OVER_MEDIAN, SHAREGPT_OUTPUT_MEAN,
                                     RandomDataset, ShareGPTSynthetic, clip_to_context, fit_length_dist,
                                     sharegpt_length_dists)
from loopline.entrypoints.cli import main
from loopline.errors import InvalidRequestError

# --- the length distribution ------------------------------------------------------------------


def test_fitted_distributions_hit_the_published_statistics():
    prompt, output = sharegpt_length_dists()
    for dist, mean in ((prompt, SHAREGPT_INPUT_MEAN), (output, SHAREGPT_OUTPUT_MEAN)):
        assert dist.mean == pytest.approx(mean, rel=1e-6)
        assert dist.mean / dist.median == pytest.approx(SHAREGPT_MEAN_OVER_MEDIAN, rel=1e-6)
        assert (dist.lo, dist.hi) == (4, 1024)
        xs = dist.sample(random.Random(7), 40_000)
        # a large seeded sample has the target statistics (rounding to integers moves them < 1 %)
        assert statistics.mean(xs) == pytest.approx(mean, rel=0.02)
        assert statistics.mean(xs) / statistics.median(xs) == pytest.approx(SHAREGPT_MEAN_OVER_MEDIAN, rel=0.04)
        assert min(xs) >= 4 and max(xs) <= 1024
        assert max(xs) > 900 and min(xs) < 10  # a long right tail and short requests, not a narrow band


def test_fit_follows_its_targets():
    d = fit_length_dist(100.0, 1.3, 1, 500)
    xs = d.sample(random.Random(1), 40_000)
    assert statistics.mean(xs) == pytest.approx(100.0, rel=0.02)
    assert statistics.mean(xs) / statistics.median(xs) == pytest.approx(1.3, rel=0.04)
    with pytest.raises(InvalidRequestError) as e:
        fit_length_dist(2000.0, 1.7, 4, 1024)
    assert e.value.param == "mean"
    with pytest.raises(InvalidRequestError) as e:
        fit_length_dist(200.0, 0.9, 4, 1024)
    assert e.value.param == "mean_over_median"


def test_sharegpt_workload_is_seeded():
    a = ShareGPTSynthetic().build(64, 500, seed=3, max_model_len=None)
    assert a == ShareGPTSynthetic().build(64, 500, seed=3, max_model_len=None)
    b = ShareGPTSynthetic().build(64, 500, seed=4, max_model_len=None)
    assert [len(p) for p in a.prompts] != [len(p) for p in b.prompts] and a.output_lens != b.output_lens
    assert len({len(p) for p in a.prompts}) > 20 and len(set(a.output_lens)) > 20  # lengths vary
    assert all(3 <= t < 500 for p in a.prompts for t in p)
    assert a.output_len == max(a.output_lens) and a.output_tokens == sum(a.output_lens)
    assert [a.max_tokens(i) for i in range(3)] == a.output_lens[:3]
    fixed = ShareGPTSynthetic(output_len=128).build(64, 500, seed=3, max_model_len=None)
    assert fixed.output_lens == [128] * 64
    assert [len(p) for p in fixed.prompts] == [len(p) for p in a.prompts]  # the same prompts, outputs fixed


def test_clipping_to_the_context():
    free = ShareGPTSynthetic().build(200, 500, seed=0, max_model_len=None)
    clipped = ShareGPTSynthetic().build(200, 500, seed=0, max_model_len=256)
    pairs = list(zip([len(p) for p in free.prompts], free.output_lens))
    assert any(p + o > 256 for p, o in pairs)  # the test would be empty otherwise
    for (p, o), prompt, out in zip(pairs, clipped.prompts, clipped.output_lens):
        assert len(prompt) + out <= 256 and len(prompt) >= 1 and out >= 1
        if p + o <= 256:
            assert (len(prompt), out) == (p, o)  # what fits is unchanged
    fixed = ShareGPTSynthetic(output_len=128).build(200, 500, seed=0, max_model_len=256)
    assert fixed.output_lens == [128] * 200 and max(len(p) for p in fixed.prompts) == 128
    assert clip_to_context(300, 100, 200) == (150, 50)  # in proportion
    assert clip_to_context(300, 100, 200, keep_output=True) == (100, 100)
    assert clip_to_context(10, 500, 200, keep_output=True) == (1, 199)
    assert clip_to_context(10, 20, 200) == (10, 20)
    assert RandomDataset(1024, 128).build(2, 500, 0, 512).prompts[0].__len__() == 384
    with pytest.raises(InvalidRequestError):
        clip_to_context(1, 1, 1)


# --- pooled percentiles ------------------------------------------------------------------------


def _timing(submit: float, times: list[float]) -> RequestTiming:
    t = RequestTiming(submit=submit)
    for i, now in enumerate(times, start=1):
        t.on_tokens(i, now)
    return t


def test_percentiles_are_pooled_over_requests_not_averaged():
    # A: 100 tokens 10 ms apart, first after 50 ms. B: 3 tokens 1 s apart, first after 2 s.
    a = _timing(0.0, [0.05 + 0.01 * k for k in range(100)])
    b = _timing(0.0, [2.0, 3.0, 4.0])
    m = latency_metrics([a, b], duration_s=4.0, input_tokens=0)
    gaps = [x * 1e3 for t in (a, b) for x in t.itls]
    assert len(gaps) == 99 + 2
    pooled_p99, pooled_p50 = np.percentile(gaps, 99), np.percentile(gaps, 50)
    averaged_p99 = np.mean([np.percentile([x * 1e3 for x in t.itls], 99) for t in (a, b)])
    assert m["itl_ms"]["p99"] == pytest.approx(pooled_p99) and m["itl_ms"]["p50"] == pytest.approx(pooled_p50)
    assert abs(pooled_p99 - averaged_p99) > 100  # the two readings differ: the test can tell them apart
    assert m["itl_ms"]["mean"] == pytest.approx(np.mean(gaps))
    ttfts, e2es = [50.0, 2000.0], [1040.0, 4000.0]
    assert m["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert m["e2el_ms"]["p50"] == pytest.approx(np.percentile(e2es, 50))
    assert m["tpot_ms"]["p50"] == pytest.approx(np.percentile([10.0, 1000.0], 50))
    assert m["output_tokens"] == 103 and m["output_throughput"] == pytest.approx(103 / 4.0)


# --- capacity search ----------------------------------------------------------------------------


def _fake_server(ms_per_rate: float, fail_above: float = float("inf")):
    calls = []

    def run_at(rate: float, step: int) -> dict:
        calls.append((rate, step))
        return {"ttft_ms": {"p50": ms_per_rate * rate / 2, "p99": ms_per_rate * rate, "mean": 1.0},
                "failed": 1 if rate > fail_above else 0, "completed": 10, "output_throughput": 10.0 * rate}

    return run_at, calls


def test_capacity_steps_up_until_the_bound_breaks():
    run_at, calls = _fake_server(100.0)
    cap = find_capacity(run_at, [8, 1, 2, 4, 16], TTFTBound(450.0))
    assert cap["capacity_rps"] == 4 and cap["first_failing_rps"] == 8 and not cap["lower_bound_only"]
    assert calls == [(1, 0), (2, 1), (4, 2), (8, 3)]  # sorted, stops at the first failure (16 never runs)
    assert [s["holds"] for s in cap["steps"]] == [True, True, True, False]
    assert cap["bound"]["stat"] == "p99" and "p99 TTFT <= 450 ms" in cap["bound"]["text"]

    run_at, calls = _fake_server(100.0)
    cap = find_capacity(run_at, [1, 2, 4, 8], TTFTBound(550.0), refine=3)
    assert [r for r, _ in calls] == [1, 2, 4, 8, 6, 5, 5.5] and cap["capacity_rps"] == 5.5  # 550 <= 550 holds
    assert cap["first_failing_rps"] == 6

    run_at, _ = _fake_server(100.0)
    assert find_capacity(run_at, [1, 2], TTFTBound(450.0, "p50"))["lower_bound_only"]  # p50 = 50 * rate
    run_at, _ = _fake_server(1.0, fail_above=2)  # fast but dropping requests above rate 2
    assert find_capacity(run_at, [1, 2, 3], TTFTBound(1e6))["capacity_rps"] == 2
    run_at, _ = _fake_server(1000.0)
    cap = find_capacity(run_at, [1, 2], TTFTBound(10.0))
    assert cap["capacity_rps"] is None and len(cap["steps"]) == 1
    for bad, param in ((lambda: TTFTBound(0.0), "ttft_bound_ms"), (lambda: TTFTBound(1.0, "p90"), "ttft_bound_stat"),
                       (lambda: find_capacity(run_at, [1, float("inf")], TTFTBound(1.0)), "capacity_rates"),
                       (lambda: find_capacity(run_at, [1, 1], TTFTBound(1.0)), "capacity_rates")):
        with pytest.raises(InvalidRequestError) as e:
            bad()
        assert e.value.param == param


def test_prometheus_counters_are_summed_over_series():
    text = "\n".join([
        "# HELP loopline:prefix_cache_hits_total Prompt tokens served from the prefix cache",
        "# TYPE loopline:prefix_cache_hits_total counter",
        'loopline:prefix_cache_hits_total{model_name="m",replica="0"} 32.0',
        'loopline:prefix_cache_hits_total{model_name="m",replica="1"} 16.0',
        'loopline:prefix_cache_hits_created{model_name="m",replica="0"} 1.7e9',
        'loopline:prefix_cache_queries_total{model_name="m"} 100.0',
    ])
    names = {"hits": "loopline:prefix_cache_hits", "queries": "loopline:prefix_cache_queries"}
    assert parse_counters(text, names) == {"hits": 48.0, "queries": 100.0}
    assert parse_counters("other 1.0", names) == {}


# --- the comparison table ----------------------------------------------------------------------


def _run(rate, phase, tput, ttft99, itl99=10.0, failed=0, hit_rate=None):
    s = lambda p50, p99: {"mean": p50, "p50": p50, "p99": p99}  # noqa: E731
    return {"request_rate": rate, "phase": phase, "output_throughput": tput, "ttft_ms": s(ttft99 / 2, ttft99),
            "tpot_ms": s(5.0, 8.0), "itl_ms": s(5.0, itl99), "e2el_ms": s(500.0, 900.0), "failed": failed,
            "completed": 8, "prefix_cache": None if hit_rate is None else {"hit_rate": hit_rate, "queries": 10}}


def _record(label, runs, capacity=None):
    return {"label": label, "command": f"loopline bench serve --label {label}", "git": {"commit": "abc123"},
            "hardware": {"gpu": "H200"}, "results": runs, "capacity": capacity}


def _cap(value, lower_only=False):
    return {"bound": {"ms": 2000.0, "stat": "p99", "text": "p99 TTFT <= 2000 ms, no failed requests"},
            "capacity_rps": value, "lower_bound_only": lower_only,
            "steps": [{"request_rate": 4, "holds": True}, {"request_rate": 8, "holds": not lower_only}]}


def test_a_serve_record_names_the_servers_hardware_only_when_it_shares_this_host(monkeypatch):
    import subprocess

    from loopline.entrypoints.bench_cli import server_hardware

    smi = subprocess.CompletedProcess([], 0, stdout="NVIDIA H200\nNVIDIA H200\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: smi)
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80"):
        assert server_hardware(url) == {"server": "this host", "server_gpus": ["NVIDIA H200", "NVIDIA H200"]}
    assert server_hardware("http://10.1.2.3:8000")["server"].startswith("remote")
    assert "server_gpus" not in server_hardware("http://10.1.2.3:8000")

    def no_smi(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", no_smi)
    assert server_hardware("http://127.0.0.1:8000") == {"server": "this host", "server_gpus": []}
    table = "\n".join(serve_comparison([_record("a", [_run(4, "initial", 1.0, 1.0)]),
                                         {**_record("b", [_run(4, "initial", 1.0, 1.0)]),
                                          "hardware": {"cpu": "Xeon", "server_gpus": ["NVIDIA H200"] * 4}}], 0))
    assert "| b | abc123 | 4 x NVIDIA H200 |" in table


def test_compare_table_has_ratios_against_the_baseline(tmp_path, capsys):
    dp4 = _record("DP=4", [_run(4, "initial", 1000.0, 200.0), _run(4, "replay", 1000.0, 100.0, hit_rate=0.9)],
                  _cap(8, lower_only=True))
    pd = _record("2P2D", [_run(4, "initial", 980.0, 150.0, itl99=5.0), _run(4, "replay", 990.0, 80.0)], _cap(4))
    remote = {**pd, "hardware": {"gpu": None, "cpu": "Xeon", "server": "remote: not visible here"}}
    assert "| 2P2D | abc123 | client: Xeon (server not visible) |" in "\n".join(serve_comparison([dp4, remote], 0))
    lines = serve_comparison([dp4, pd], baseline=0)
    text = "\n".join(lines)
    assert "Baseline: **DP=4**" in text and "**4 requests/s, initial phase**" in text and "replay phase" in text
    rows = [line for line in lines if line.startswith("| 2P2D | 0.")]  # the two runs' rows
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "0.980x (980.0)" and cells[3] == "0.750x (150.0)"  # out tok/s and TTFT p99
    assert cells[7] == "0.500x (5.00)"  # ITL p99
    base = next(line for line in lines if line.startswith("| DP=4 (baseline) |") and "90%" in line)
    assert "1,000.0" in base
    assert "| DP=4 | p99 TTFT <= 2000 ms, no failed requests | >= 8 |" in text
    assert "| 2P2D | p99 TTFT <= 2000 ms, no failed requests | 4 | 0.500x |" in text

    paths = []
    for rec in (dp4, pd):
        paths.append(tmp_path / f"{rec['label'].replace('=', '')}.json")
        paths[-1].write_text(json.dumps(rec))
    out = tmp_path / "cmp.md"
    assert main(["bench", "compare", str(paths[0]), str(paths[1]), "--baseline", "2P2D", "--output-md", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Baseline: **2P2D**" in printed and out.read_text().strip() == printed.strip()
    assert "| DP=4 | " in printed and "1.020x (1,000.0)" in printed  # 1000 / 980
    bad = tmp_path / "offline.json"
    bad.write_text(json.dumps({"results": [{"variants": []}]}))
    assert main(["bench", "compare", str(bad)]) == 2
    assert "not a `loopline bench serve --output-json` record" in capsys.readouterr().err
    assert main(["bench", "compare", str(paths[0]), "--baseline", "nope"]) == 2


# --- against a real tiny server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tiny_gqa):
    from entrypoints.conftest import RunningServer

    from loopline import AsyncLLM, EngineArgs
    from loopline.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", max_num_seqs=4,
                              max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=True))
    srv = RunningServer(build_app(llm, "tiny-test", shutdown_engine=False))
    yield srv
    srv.stop()
    llm.shutdown()


def test_rates_and_replay_phases_against_a_server(tiny_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", tiny_server.base_url, "--dataset", "sharegpt-synthetic",
            "--output-len", "3",
            "--num-prompts", "6", "--request-rate", "40,80", "--replay", "--label", "one", "--no-progress",
            "--output-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| 40 | initial |" in printed and "| 80 | replay |" in printed
    record = json.loads(out.read_text())
    runs = record["results"]
    assert [(r["request_rate"], r["phase"]) for r in runs] == [(40, "initial"), (40, "replay"), (80, "initial"),
                                                                (80, "replay")]
    p = record["params"]
    assert p["dataset"] == "sharegpt-synthetic" and p["fixed_output_len"] == 3 and p["max_model_len"] == 256
    assert record["label"] == "one" and p["request_rates"] == [40, 80] and p["replay"]
    assert record["hardware"]["server"] == "this host"  # a loopback server shares the client's machine
    assert isinstance(record["hardware"]["server_gpus"], list)
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 18
        assert r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
    # a replay sends the same prompts (same tokens in) and finds them in the prefix cache
    assert runs[0]["input_tokens"] == runs[1]["input_tokens"] != runs[2]["input_tokens"]
    for initial, replay in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert initial["prefix_cache"]["queries"] > 0 and replay["prefix_cache"]["queries"] > 0
        assert initial["prefix_cache"]["hits"] == 0  # a rate's own seed: nothing from the rate before
        assert replay["prefix_cache"]["hit_rate"] > 0.5


def test_capacity_search_against_a_server(tiny_server, tmp_path):
    from loopline.entrypoints.bench_cli import run_serve_bench
    from loopline.entrypoints.cli import build_parser

    base = ["bench", "serve", "--base-url", tiny_server.base_url, "--input-len", "8", "--output-len", "2",
            "--num-prompts", "4", "--capacity-rates", "20,40"]
    ns = build_parser().parse_args([*base, "--ttft-bound-ms", "1e6"])
    record = run_serve_bench(ns)
    cap = record["capacity"]
    assert record["results"] == [] and cap["lower_bound_only"] and cap["capacity_rps"] == 40
    assert [s["request_rate"] for s in cap["steps"]] == [20, 40] and all(s["completed"] == 4 for s in cap["steps"])
    ns = build_parser().parse_args([*base, "--ttft-bound-ms", "0.001", "--request-rate", "inf"])
    record = run_serve_bench(ns)
    assert record["capacity"]["capacity_rps"] is None and len(record["capacity"]["steps"]) == 1
    assert [r["request_rate"] for r in record["results"]] == [float("inf")]


@pytest.mark.parametrize("argv, param", [
    (["--request-rate", "0"], "request_rate"),
    (["--request-rate", "4,x"], "request_rate"),
    (["--request-rate", "4,4"], "request_rate"),
    (["--capacity-rates", "1,inf"], "capacity_rates"),
    (["--capacity-rates", "1,2", "--ttft-bound-ms", "-1"], "ttft_bound_ms"),
    (["--dataset", "sharegpt-synthetic", "--input-len", "5"], "input_len"),
    (["--num-prompts", "0"], "num_prompts"),
])
def test_bad_serve_arguments_name_the_field(argv, param):
    from loopline.entrypoints.bench_cli import run_serve_bench
    from loopline.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--max-model-len", "64",
                                    "--model", "m", *argv])
    with pytest.raises(InvalidRequestError) as e:
        run_serve_bench(ns)
    assert e.value.param == param


def test_serve_and_compare_help_have_no_default_none():
    from loopline.entrypoints.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    subs = bench._subparsers._group_actions[0].choices
    for name in ("serve", "compare"):
        text = subs[name].format_help()
        assert "(default: None)" not in text and "(default: False)" not in text
        assert all(a.help for a in subs[name]._actions if a.option_strings)
