"""``loopline bench``: the offline harness end to end on tiny shapes, its parts, and ``bench serve`` against a stub."""
from __future__ import annotations

import json
import sys

import pytest

from loopline.bench.metrics import ByteModel, RequestTiming, interval_union_s, latency_metrics, percentile
from loopline.bench.workload import make_workload, parse_depth_dist
from loopline.entrypoints.bench_cli import run_offline
from loopline.entrypoints.cli import build_parser, main
from loopline.errors import InvalidRequestError

TINY = ["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--no-progress"]

RUN_FIELDS = {
    "variant", "engine", "duration_s", "completed", "failed", "input_tokens", "output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "mean_loops_per_token",
    "exit_depth_counts", "steps", "rows_per_step", "tokens_per_step", "mean_step_time_ms", "head_steps", "gpu_timing",
    "gpu_busy_s", "gpu_idle_fraction", "bytes_read", "achieved_gbps", "peak_gbps", "bandwidth_utilization", "round",
}


def bench(*argv: str) -> dict:
    ns = build_parser().parse_args(["bench", *TINY, *argv])
    return run_offline(ns)


# --- end to end ------------------------------------------------------------------------


def test_json_record_has_every_field(capsys):
    assert main(["bench", *TINY, "--input-len", "8", "--output-len", "6", "--concurrency", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert {"command", "argv", "git", "hardware", "software", "params", "process_argv", "results"} <= set(record)
    assert record["command"].startswith("loopline bench ") and "--config tiny" in record["command"]
    assert {"commit", "dirty"} <= set(record["git"])
    assert record["hardware"]["gpu"] is None and record["hardware"]["cpu"]
    assert record["software"]["torch"]
    params = record["params"]
    assert params["input_len"] == 8 and params["output_len"] == 6 and params["concurrency"] == [2]
    assert params["engine_args"]["exit_mode"] == "threshold"
    (point,) = record["results"]
    assert point["concurrency"] == 2 and point["num_prompts"] == 4  # 2 x concurrency by default
    (row,) = point["variants"]
    assert row["ratio_output_throughput"] == 1.0
    run = row["median"]
    assert RUN_FIELDS <= set(run)
    assert run["completed"] == 4 and run["failed"] == 0
    assert run["output_tokens"] == 4 * 6 and run["input_tokens"] == 4 * 8
    assert run["mean_loops_per_token"] == 4.0  # tiny checkpoint threshold 1.0: full depth
    assert run["output_throughput"] > 0 and run["total_token_throughput"] > run["output_throughput"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert run[key]["p50"] is not None and run[key]["p99"] >= run[key]["p50"] > 0
    assert run["engine"]["max_num_seqs"] == 2  # sized by the bench
    assert run["gpu_idle_fraction"] is None  # CPU
    assert run["steps"] > 0 and run["rows_per_step"] > 0 and run["achieved_gbps"] > 0


def test_text_report_prints_header_and_table(capsys, tmp_path):
    saved = tmp_path / "record.json"
    assert main(["bench", *TINY, "--input-len", "4", "--output-len", "3", "--concurrency", "1",
                 "--output-json", str(saved)]) == 0
    out = capsys.readouterr().out
    for needle in ("command:  loopline bench", "commit:", "hardware: CPU", "NOTE: CPU run", "| variant | out tok/s",
                   "| loopline |"):
        assert needle in out
    assert json.loads(saved.read_text())["results"][0]["variants"][0]["median"]["output_tokens"] == 2 * 3


def test_trace_depth_dist_gives_requested_mean_loops():
    record = bench("--input-len", "4", "--output-len", "64", "--concurrency", "4", "--num-prompts", "8",
                   "--depth-dist", "mean2.5")
    point = record["results"][0]
    run = point["variants"][0]["median"]
    assert record["params"]["exit_mode"] == "trace" and record["params"]["requested_mean_loops"] == pytest.approx(2.5)
    # The engine's reported mean exit depth is the mean of the replayed trace (up to how the
    # first token, which comes from the full-depth prefill, is counted)...
    assert run["mean_loops_per_token"] == pytest.approx(point["trace_mean_loops"], abs=0.05)
    # ... which is close to the requested mean (512 draws).
    assert run["mean_loops_per_token"] == pytest.approx(2.5, abs=0.15)
    assert set(run["exit_depth_counts"]) == {"1", "2", "3", "4"}


def test_compare_interleaves_variants_and_reports_ratios():
    record = bench("--input-len", "6", "--output-len", "8", "--concurrency", "2", "--depth-dist", "1:0.5,4:0.5",
                   "--compare", "--hf-baseline", "--repeats", "2")
    (point,) = record["results"]
    names = [row["name"] for row in point["variants"]]
    assert names == ["refill", "no_refill", "fixed", "hf"]
    for row in point["variants"]:
        assert row["ratio_output_throughput"] is not None and row["ratio_output_throughput"] > 0
        assert row["ratio_tpot_p50"] is not None
        assert [r["round"] for r in row["runs"]] == [0, 1]
        assert row["median"]["output_tokens"] == 4 * 8
    by_name = {row["name"]: row for row in point["variants"]}
    assert by_name["refill"]["ratio_output_throughput"] == 1.0
    assert by_name["refill"]["median"]["mean_loops_per_token"] == pytest.approx(point["trace_mean_loops"])
    assert by_name["no_refill"]["median"]["engine"]["scheduling_mode"] == "no_refill"
    assert by_name["fixed"]["median"]["mean_loops_per_token"] == 4.0
    assert by_name["fixed"]["median"]["engine"]["exit_mode"] == "fixed"
    hf = by_name["hf"]["median"]
    assert hf["mean_loops_per_token"] == 4.0 and hf["ttft_ms"]["p50"] > 0 and hf["tpot_ms"]["p50"] > 0


def test_sync_async_variants_produce_the_same_tokens():
    record = bench("--input-len", "6", "--output-len", "8", "--concurrency", "2", "--depth-dist", "1:0.5,4:0.5",
                   "--compare", "--variants", "sync,async", "--repeats", "1")
    (point,) = record["results"]
    by_name = {row["name"]: row["median"] for row in point["variants"]}
    assert by_name["sync"]["engine"]["async_scheduling"] is False
    assert by_name["async"]["engine"]["async_scheduling"] is True
    for key in ("output_tokens", "mean_loops_per_token", "exit_depth_counts"):
        assert by_name["sync"][key] == by_name["async"][key]


def test_hf_baseline_ignores_eos():
    import torch

    from loopline.bench.hf_baseline import run_hf
    from loopline.bench.offline import BenchSpec, build_model
    from loopline.config import EngineArgs

    model, device, dtype, _ = build_model(EngineArgs(device="cpu", dtype="float32"), "tiny", 0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy picks token 0, the eos id
    workload = make_workload(3, 4, 5, model.config.vocab_size, seed=0)
    record = run_hf(model, BenchSpec(4, 5, concurrency=2, num_prompts=3), workload, device, dtype)
    assert record["output_tokens"] == 3 * 5 and record["completed"] == 3
    assert record["head_steps"] == 2 * 5  # two batches (2 + 1 rows), one forward per token
    assert record["rows_per_step"] == 1.5


def test_model_dir_and_concurrency_sweep(tiny_gqa):
    ns = build_parser().parse_args(["bench", "--model", str(tiny_gqa.path), "--device", "cpu", "--no-progress",
                                    "--input-len", "4", "--output-len", "3", "--concurrency", "1,3"])
    record = run_offline(ns)
    assert [p["concurrency"] for p in record["results"]] == [1, 3]
    assert [p["num_prompts"] for p in record["results"]] == [2, 6]
    assert record["params"]["model_source"] == str(tiny_gqa.path)


@pytest.mark.parametrize("speculative", [None, '{"method": "loop", "draft_loops": 1}'])
def test_a_speculating_engine_warms_up_plain_then_speculating(tiny_gqa, monkeypatch, speculative):
    """The throughput guard decodes an engine's first requests plainly (measuring plain steps); the warm-up
    runs a second wave, which speculates (its kernels compile before the clock). A plain engine warms up once."""
    from loopline.bench import offline

    waves, drive = [], offline.drive_closed_loop

    def counting(engine, *args, tag, **kw):
        drafts = engine.stats.spec_num_draft_tokens
        out = drive(engine, *args, tag=tag, **kw)
        if tag == "warmup":
            waves.append(engine.stats.spec_num_draft_tokens - drafts)
        return out

    monkeypatch.setattr(offline, "drive_closed_loop", counting)
    argv = ["bench", "--model", str(tiny_gqa.path), "--device", "cpu", "--no-progress", "--input-len", "4",
            "--output-len", "16", "--concurrency", "1", "--num-prompts", "1", "--warmup-prompts", "1",
            "--warmup-output-len", "12"]
    run_offline(build_parser().parse_args(argv + (["--speculative-config", speculative] if speculative else [])))
    if speculative is None:
        assert waves == [0]
    else:  # (12 tokens x 4 loops of plain steps measure them; the second request pipelines)
        assert len(waves) == 2 and waves[0] == 0 < waves[1], waves


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "tput.png"
    bench("--input-len", "4", "--output-len", "3", "--concurrency", "1,2", "--plot", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    from loopline.bench.plot import PlotUnavailableError, plot_throughput

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailableError, match=r"pip install 'loopline\[plot\]'"):
        plot_throughput({"results": []}, "x.png")


# --- arguments -------------------------------------------------------------------------


def test_parser_accepts_documented_flags():
    ns = build_parser().parse_args([
        "bench", "--input-len", "1024", "--output-len", "128", "--concurrency", "1,8,32", "--num-prompts", "64",
        "--dtype", "bfloat16", "--kv-layout", "shared", "--scheduling-mode", "no_refill", "--exit-mode", "trace",
        "--depth-dist", "mean2.5", "--config", "ouro-1.4b", "--compare", "--variants", "refill,fixed,hf",
        "--hf-baseline", "--repeats", "5", "--json", "--output-json", "r.json", "--plot", "out.png", "--profile-kernels", "--max-num-seqs", "128",
        "--enforce-eager", "--gpu-memory-utilization", "0.85", "--seed", "3", "--warmup-prompts", "4",
        "--warmup-output-len", "8", "--exit-threshold", "0.5", "--min-loops", "2"])
    assert (ns.input_len, ns.output_len, ns.concurrency, ns.num_prompts) == (1024, 128, "1,8,32", 64)
    assert (ns.dtype, ns.kv_layout, ns.scheduling_mode, ns.exit_mode) == ("bfloat16", "shared", "no_refill", "trace")
    assert ns.depth_dist == "mean2.5" and ns.config == "ouro-1.4b" and ns.compare and ns.hf_baseline
    assert ns.repeats == 5 and ns.json and ns.output_json == "r.json" and ns.plot == "out.png" and ns.profile_kernels and ns.max_num_seqs == 128
    assert ns.enforce_eager and ns.gpu_memory_utilization == 0.85 and ns.seed == 3

    defaults = build_parser().parse_args(["bench"])
    assert defaults.max_num_seqs is None and defaults.exit_mode is None and defaults.bench_command is None

    serve = build_parser().parse_args(["bench", "serve", "--base-url", "http://h:1", "--request-rate", "4",
                                       "--concurrency", "8", "--input-len", "16", "--output-len", "4",
                                       "--num-prompts", "10", "--model", "m", "--json"])
    assert serve.bench_command == "serve" and serve.base_url == "http://h:1" and serve.request_rate == "4"
    assert (serve.serve_concurrency, serve.serve_input_len, serve.serve_output_len) == (8, 16, 4)
    assert serve.served_model == "m" and serve.serve_json and serve.func.__name__ == "_run_serve"
    assert build_parser().parse_args(["bench", "serve", "--base-url", "x"]).request_rate is None  # inf unless capacity


@pytest.mark.parametrize("argv, param", [
    (["--exit-mode", "fixed", "--depth-dist", "mean2"], "exit_mode"),
    (["--exit-mode", "trace"], "depth_dist"),
    (["--concurrency", "0"], "concurrency"),
    (["--concurrency", "a,b"], "concurrency"),
    (["--variants", "refill,bogus"], "variants"),
    (["--depth-dist", "9:1"], "depth_dist"),
    (["--output-len", "0"], "output_len"),
])
def test_bad_arguments_name_the_field(argv, param):
    with pytest.raises(InvalidRequestError) as e:
        bench(*argv)
    assert e.value.param == param


def test_bad_arguments_exit_with_message(capsys):
    assert main(["bench", *TINY, "--depth-dist", "mean7"]) == 2
    assert "mean must be in [1, 4]" in capsys.readouterr().err


# --- parts -----------------------------------------------------------------------------


def test_depth_dist_parsing():
    d = parse_depth_dist("mean2.5", 4)
    assert d.depths == (1, 2, 3, 4) and d.probs == pytest.approx((1 / 8, 3 / 8, 3 / 8, 1 / 8)) and d.mean == pytest.approx(2.5)
    assert parse_depth_dist("mean1", 4).mean == pytest.approx(1.0)
    d = parse_depth_dist("1:0.1,2:0.4,3:0.3,4:0.2", 4)
    assert d.mean == pytest.approx(2.6)
    assert parse_depth_dist("1:1, 4:3", 4).probs == pytest.approx((0.25, 0.75))
    assert parse_depth_dist("full", 3).depths == (3,) and parse_depth_dist("uniform", 4).mean == pytest.approx(2.5)
    for bad in ("5:1", "1:-1", "x", "1:0", "mean0.5", "mean4.5"):
        with pytest.raises(InvalidRequestError):
            parse_depth_dist(bad, 4)


def test_workload_is_seeded_and_identical_for_every_variant():
    dist = parse_depth_dist("mean2", 4)
    a = make_workload(3, 5, 7, 512, seed=1, depth_dist=dist)
    assert a == make_workload(3, 5, 7, 512, seed=1, depth_dist=dist)
    assert a != make_workload(3, 5, 7, 512, seed=2, depth_dist=dist)
    assert all(3 <= t < 512 for p in a.prompts for t in p) and [len(p) for p in a.prompts] == [5, 5, 5]
    assert [len(t) for t in a.exit_depths] == [7, 7, 7]
    warm = a.head(2, 3)
    assert warm.num_prompts == 2 and warm.output_len == 3 and [len(t) for t in warm.exit_depths] == [3, 3]


def test_latency_metrics_follow_vllm_definitions():
    t = RequestTiming(submit=0.0)
    for n, now in ((1, 0.5), (1, 0.6), (2, 0.7), (4, 1.0)):  # a chunk of two tokens at 1.0
        t.on_tokens(n, now)
    assert t.token_times == [0.5, 0.7, 1.0] and t.num_tokens == 4
    assert t.ttft == 0.5 and t.tpot == pytest.approx(0.5 / 3) and t.e2el == 1.0
    assert t.itls == pytest.approx([0.2, 0.3])
    m = latency_metrics([t, RequestTiming(submit=0.0, error="boom")], duration_s=2.0, input_tokens=10)
    assert m["completed"] == 1 and m["failed"] == 1 and m["output_throughput"] == 2.0
    assert m["total_token_throughput"] == 7.0 and m["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) is None
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_byte_model_matches_ouro_1p4b_arithmetic():
    import torch

    from loopline.models.tiny import random_checkpoint_config

    bm = ByteModel.for_config(random_checkpoint_config("ouro-1.4b"), torch.bfloat16)
    # docs/benchmarks/README.md: loop body 1,233,321,984 params (+ final norm and gate), lm_head 100,663,296.
    assert bm.body == 2 * (1_233_321_984 + 2048 + 2049)
    assert bm.head == 2 * 100_663_296
    assert bm.kv_per_token_loop == 196_608
    # prefill: 4 loops x 2 positions; token 1 at 3 loops over 3 positions; token 2 at 2 loops over 4.
    assert bm.kv_read(2, [4, 3, 2], prefill_loops=4) == (8 + 9 + 8) * 196_608
    assert bm.bytes_read(traversals=10, head_reads=3, kv_bytes=5) == 10 * bm.body + 3 * bm.head + 5


def test_profiled_busy_time_reads_kineto_events():
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from loopline.bench.env import DeviceTimer, profiled_busy_s, profiled_kernels

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a = torch.randn(64, 64)
        for _ in range(3):
            (a @ a).sum()
    assert profiled_busy_s(prof, DeviceType.CPU) > 0  # the same reading the CUDA path does for GPU activities
    table = profiled_kernels(prof, DeviceType.CPU, top=50)  # the per-kernel table --profile-kernels records
    by_name = {row["name"]: row for row in table}
    assert by_name["aten::mm"]["calls"] == 3
    assert [r["total_ms"] for r in table] == sorted((r["total_ms"] for r in table), reverse=True)
    assert len(profiled_kernels(prof, DeviceType.CPU, top=1)) == 1
    timer = DeviceTimer(torch.device("cpu"), "profiler")
    timer.start(), timer.before_step(), timer.after_step(), timer.stop()
    assert timer.busy_s() is None and timer.method is None  # no GPU, no idle fraction


def test_interval_union():
    assert interval_union_s([]) == 0.0
    assert interval_union_s([(0, 10), (5, 20), (30, 40)]) == pytest.approx(30e-9)


# --- bench serve against a stub server -------------------------------------------------


def test_bench_serve_against_stub():
    httpx = pytest.importorskip("httpx")
    from loopline.bench.serve import ServeSpec, run_serve

    seen = []

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "stub-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "text": "a", "exit_depths": [2]}]} for _ in range(n - 2)]
        events.append({"choices": [{"index": 0, "text": "bc", "exit_depths": [3, 3]}]})  # a two-token chunk
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    workload = make_workload(6, 5, 4, 500, seed=0)
    spec = ServeSpec("http://stub", request_rate=1000.0, concurrency=2, seed=0)
    record = run_serve(spec, workload, transport=httpx.MockTransport(handler))
    assert record["model"] == "stub-model" and record["completed"] == 6 and record["failed"] == 0
    assert record["output_tokens"] == 6 * 4 and record["mean_loops_per_token"] == pytest.approx(2.5)
    assert record["ttft_ms"]["p50"] is not None and record["itl_ms"]["p50"] is not None
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 and b["model"] == "stub-model" for b in seen)
    assert sorted(b["prompt"] for b in seen) == sorted(workload.prompts)
    assert all(b["temperature"] == 0.0 and "seed" not in b and "top_p" not in b for b in seen)  # greedy by default

    seen.clear()  # sampled: every request seeded by its index; unset fields left to the server
    run_serve(ServeSpec("http://stub", concurrency=2, seed=3, temperature=0.7, top_p=0.9), workload,
              transport=httpx.MockTransport(handler))
    by_prompt = {tuple(b["prompt"]): b for b in seen}
    assert [by_prompt[tuple(p)]["seed"] for p in workload.prompts] == [3 * 1_000_003 + i for i in range(6)]
    assert all(b["temperature"] == 0.7 and b["top_p"] == 0.9 and "top_k" not in b for b in seen)

    def failing(request):
        if request.url.path == "/v1/models":
            return httpx.Response(404)
        return httpx.Response(400, json={"error": {"message": "bad"}})

    record = run_serve(ServeSpec("http://stub"), make_workload(2, 3, 4, 500, 0),
                       transport=httpx.MockTransport(failing))
    assert record["completed"] == 0 and record["failed"] == 2 and "HTTP 400" in record["errors"][0]


def test_shared_prefix_workload():
    from loopline.bench.workload import make_workload

    w = make_workload(4, 20, 3, 500, seed=1, shared_prefix_len=12)
    assert all(p[:12] == w.prompts[0][:12] for p in w.prompts)
    assert len({tuple(p[12:]) for p in w.prompts}) == 4
    with pytest.raises(InvalidRequestError):
        make_workload(2, 8, 3, 500, seed=1, shared_prefix_len=9)


# --- polish: --plot checked first, y from 0, quiet bars in logs, help ------------------------------


def test_plot_is_checked_before_the_benchmark_runs(monkeypatch, tmp_path):
    import loopline.bench.offline as offline
    from loopline.bench.plot import PlotUnavailableError

    def must_not_run(*a, **k):
        raise AssertionError("the benchmark ran before --plot was checked")

    monkeypatch.setattr(offline, "build_model", must_not_run)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)
        with pytest.raises(PlotUnavailableError, match="needs matplotlib"):
            bench("--plot", str(tmp_path / "x.png"))
    pytest.importorskip("matplotlib")
    with pytest.raises(PlotUnavailableError, match="does not exist"):
        bench("--plot", str(tmp_path / "missing" / "x.png"))


def test_plot_y_axis_starts_at_zero():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from loopline.bench.plot import throughput_figure

    record = bench("--input-len", "4", "--output-len", "3", "--concurrency", "1,2")
    fig = throughput_figure(record)
    assert fig.axes[0].get_ylim()[0] == 0
    plt.close(fig)


def test_progress_bar_stays_out_of_logs(capsys):
    argv = [a for a in TINY if a != "--no-progress"]
    assert main(["bench", *argv, "--input-len", "4", "--output-len", "2", "--concurrency", "1"]) == 0
    err = capsys.readouterr().err  # not a terminal: no bar, no carriage returns
    assert "bench C=" not in err and "\r" not in err


def test_bench_help_has_no_default_none():
    sub = build_parser()._subparsers._group_actions[0].choices["bench"]
    text = sub.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert all(a.help for a in sub._actions if a.option_strings)


def test_record_names_the_timing_hooks_set(monkeypatch):
    """A run under LOOPLINE_DECODE_LAUNCH / LOOPLINE_SPLIT_RULE says so in its record and its header: it is not the
    defaults' run."""
    from loopline.bench.env import software_info
    from loopline.bench.report import header_lines

    for name in ("LOOPLINE_DECODE_LAUNCH", "LOOPLINE_SPLIT_RULE"):
        monkeypatch.delenv(name, raising=False)
    assert "timing_hooks" not in software_info()
    monkeypatch.setenv("LOOPLINE_SPLIT_RULE", "full_wave_programs_per_sm=inf")
    sw = software_info()
    assert sw["timing_hooks"] == {"LOOPLINE_SPLIT_RULE": "full_wave_programs_per_sm=inf"}
    record = {"command": "loopline bench", "git": {"commit": "abc"}, "hardware": {"gpu": "H100"}, "software": sw,
              "params": {"model_source": "tiny", "dtype": "float32", "total_ut_steps": 4, "input_len": 8,
                         "output_len": 4, "depth_dist": None, "exit_mode": "fixed", "repeats": 1}}
    assert any("LOOPLINE_SPLIT_RULE=full_wave_programs_per_sm=inf" in line for line in header_lines(record))


def test_sampled_workload_seeds_every_request():
    from loopline.bench.offline import BenchSpec, sampling_params_for
    from loopline.bench.report import header_lines

    record = bench("--input-len", "4", "--output-len", "3", "--concurrency", "2", "--temperature", "0.8",
                   "--top-k", "5")
    assert record["params"]["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 5, "min_p": 0.0}
    assert record["results"][0]["variants"][0]["median"]["output_tokens"] == 4 * 3
    assert "closed loop, sampled temperature=0.8 top_k=5, ignore_eos" in "\n".join(header_lines(record))
    workload = make_workload(3, 4, 5, 100, seed=0)
    spec = BenchSpec(4, 5, 2, 3, seed=7, temperature=0.8, top_k=5)
    params = [sampling_params_for("fixed", spec, workload, i) for i in range(3)]
    assert [(p.temperature, p.top_k) for p in params] == [(0.8, 5)] * 3
    assert len({p.seed for p in params}) == 3  # distinct, and the same again for the same run
    assert [p.seed for p in params] == [sampling_params_for("fixed", spec, workload, i).seed for i in range(3)]
    greedy = sampling_params_for("fixed", BenchSpec(4, 5, 2, 3), workload, 0)
    assert greedy.temperature == 0.0 and greedy.seed is None
    assert "closed loop, greedy, ignore_eos" in "\n".join(header_lines(bench("--input-len", "4", "--output-len", "2",
                                                                            "--concurrency", "1")))


@pytest.mark.parametrize("argv, field", [(["--top-p", "1.5"], "top_p"), (["--temperature", "-1"], "temperature"),
                                         (["--temperature", "0.5", "--hf-baseline"], "temperature")])
def test_bad_sampling_flags_name_the_field(argv, field):
    with pytest.raises(InvalidRequestError) as e:
        bench("--input-len", "4", "--output-len", "2", *argv)
    assert e.value.param == field
