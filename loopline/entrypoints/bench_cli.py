"""``loopline bench`` (offline, in-process) and ``loopline bench serve`` (HTTP client).

Every engine flag comes from :class:`EngineArgs`; see docs/benchmarks/README.md
for the metrics and their formulas.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import urllib.parse
from typing import Any

from loopline.entrypoints.cli_args import (SAMPLING_HELP, HelpFormatter, add_cpu_threads_arg, apply_cpu_threads,
                                           common_parser, positive_float)
from loopline.errors import InvalidRequestError

HELP = "offline throughput/latency benchmark (and `bench serve` for an HTTP server)"


def add_parser(sub: Any) -> None:
    from loopline.config import EngineArgs

    p = sub.add_parser("bench", help=HELP, formatter_class=HelpFormatter, parents=[common_parser(config=False)],
                       description="Closed-loop offline benchmark of the engine on random prompts; see docs/benchmarks/README.md.")
    w = p.add_argument_group("workload")
    w.add_argument("--config", choices=["tiny", "ouro-1.4b", "ouro-2.6b", "huginn-tiny", "huginn-3.5b"], default=None,
                   help="random weights of these shapes, built in memory (default without --model: tiny); "
                        "--config FILE.yaml reads flags from a YAML file instead, as for the other commands")
    w.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (random ids)")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    w.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy); above 0 each request is seeded by its "
                        "index, so a run repeats its tokens")
    w.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default 1: off)")
    w.add_argument("--top-k", type=int, default=0, help="every request's top_k (default 0: off)")
    w.add_argument("--min-p", type=float, default=0.0, help="every request's min_p (default 0: off)")
    w.add_argument("--concurrency", default="8",
                   help="requests kept in flight (closed loop); a comma list such as 1,8,32 runs a sweep")
    w.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: 2 x concurrency)")
    w.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with the same this many tokens (a shared system prompt; "
                        "compare with --variants no_prefix_cache,prefix_cache)")
    w.add_argument("--depth-dist", default=None,
                   help="synthetic per-token exit depths, replayed with exit_mode=trace: 'd:w,...' "
                        "(e.g. 1:0.1,2:0.4,3:0.3,4:0.2), 'meanX' (e.g. mean2.5), 'uniform' or 'full'")
    w.add_argument("--exit-threshold", type=float, default=None,
                   help=SAMPLING_HELP["exit_threshold"] + "; with exit_mode=threshold")
    w.add_argument("--min-loops", type=int, default=None,
                   help=SAMPLING_HELP["min_loops"] + " (default: 1); with exit_mode threshold or lookahead")
    w.add_argument("--lookahead-threshold", type=float, default=None,
                   help="the lookahead head's threshold in [0, 1] with exit_mode=lookahead (--exit-mode lookahead, "
                        "or the lookahead variant; default: the head's calibrated one; docs/lookahead.md)")
    w.add_argument("--warmup-prompts", type=int, default=None, help="warm-up requests before each run (default: concurrency)")
    w.add_argument("--warmup-output-len", type=int, default=16, help="output tokens of each warm-up request")
    r = p.add_argument_group("comparison and output")
    r.add_argument("--compare", action="store_true",
                   help="run variants interleaved and report ratios vs the first (default: refill,no_refill,fixed)")
    r.add_argument("--variants", default=None,
                   help="comma list for --compare from: loopline (the flags given), refill, no_refill, fixed, "
                        "lookahead, shared, last_exited, no_prefix_cache, prefix_cache, sync, async, eager, triton, "
                        "flashinfer, no_spec (speculation off: no_spec,loopline gives its speedup), hf")
    r.add_argument("--hf-baseline", action="store_true",
                   help="also run transformers generate() on the same weights (static batches of concurrency)")
    r.add_argument("--repeats", type=int, default=None, help="interleaved rounds, medians reported (default: 3 with --compare, else 1)")
    r.add_argument("--json", action="store_true", help="print the whole record as JSON instead of tables")
    r.add_argument("--output-json", metavar="FILE", default=None, help="also write the whole record as JSON to FILE")
    r.add_argument("--plot", metavar="FILE.png", default=None, help="write output tok/s vs concurrency (needs matplotlib)")
    r.add_argument("--profile-kernels", action="store_true",
                   help="GPU idle from torch.profiler kernel intervals (exact, with profiler overhead) instead of CUDA "
                        "events; each run's record also gets its device time per kernel name ('kernels', top 30)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cpu_threads_arg(p)
    EngineArgs.add_cli_args(p)
    # None = "sized by the bench" (engine_args_for) or "resolved from --depth-dist" (exit_mode).
    p.set_defaults(max_num_seqs=None, max_num_batched_tokens=None, exit_mode=None)
    _add_serve(p.add_subparsers(dest="bench_command", metavar="{serve,compare}"))
    p.set_defaults(func=functools.partial(_run_bench, defaults=vars(p.parse_args([]))))


def _add_serve(sub: Any) -> None:

    s = sub.add_parser("serve", help="drive a running OpenAI-compatible server over HTTP", formatter_class=HelpFormatter,
                       parents=[common_parser(config=False)],
                       description="Fixed-rate (Poisson) or closed-loop load on a running server; see "
                                   "docs/benchmarks/README.md#loopline-bench-serve.")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (vLLM's default)")
    s.add_argument("--model", dest="served_model", default=None, help="model name for requests (default: first of /v1/models)")
    w = s.add_argument_group("workload")
    w.add_argument("--dataset", dest="serve_dataset", choices=["random", "sharegpt-synthetic"], default="random",
                   help="random: every prompt --input-len random ids, every output --output-len tokens; "
                        "sharegpt-synthetic: prompt and output lengths drawn from a lognormal fitted to published "
                        "ShareGPT statistics (mean 229.7 in / 203.1 out, within [4, 1024]), random ids")
    w.add_argument("--input-len", dest="serve_input_len", metavar="N", type=int, default=None,
                   help="prompt tokens (random ids; --dataset random only; default 1024)")
    w.add_argument("--output-len", dest="serve_output_len", metavar="N", type=int, default=None,
                   help="max_tokens with ignore_eos (default 128 for random); with sharegpt-synthetic it fixes every "
                        "output length instead of drawing it")
    w.add_argument("--max-model-len", dest="serve_max_model_len", metavar="N", type=int, default=None,
                   help="clip requests to this context (prompt + output); default: the server's max_model_len from "
                        "/v1/models")
    w.add_argument("--num-prompts", dest="serve_num_prompts", metavar="N", type=int, default=100,
                   help="requests per phase")
    w.add_argument("--vocab-size", type=int, default=500, help="random prompt ids are drawn from [3, vocab_size)")
    w.add_argument("--temperature", dest="serve_temperature", metavar="T", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy); above 0 each request is seeded by its "
                        "index, so a run repeats its tokens")
    w.add_argument("--top-p", dest="serve_top_p", metavar="P", type=float, default=None,
                   help="every request's top_p (default: the server's)")
    w.add_argument("--top-k", dest="serve_top_k", metavar="K", type=int, default=None,
                   help="every request's top_k (default: the server's)")
    w.add_argument("--min-p", dest="serve_min_p", metavar="P", type=float, default=None,
                   help="every request's min_p (default: the server's)")
    w.add_argument("--seed", dest="serve_seed", metavar="N", type=int, default=0,
                   help="seed of prompts, lengths and arrivals; rate k of a sweep uses seed + k")
    load = s.add_argument_group("load")
    load.add_argument("--request-rate", dest="request_rate", metavar="RATES", default=None,
                      help="Poisson arrivals per second; a comma list (e.g. 4,8) runs each rate in turn; inf: all at "
                           "once (default: inf, or none with only --capacity-rates)")
    load.add_argument("--concurrency", dest="serve_concurrency", metavar="N", type=int, default=None,
                      help="max requests in flight (closed loop with --request-rate inf)")
    load.add_argument("--replay", action="store_true",
                      help="when the initial phase has drained, send the same request set again right away, with the "
                           "same arrival gaps (the immediate-replay phase); both phases are reported; the replay "
                           "shows what prefix caching does for repeated prompts")
    load.add_argument("--timeout", type=positive_float, default=600.0, help="per-request timeout in seconds")
    cap = s.add_argument_group("peak capacity")
    cap.add_argument("--capacity-rates", metavar="RATES", default=None,
                     help="comma list of rates to step through upwards (e.g. 1,2,4,8,16) until one breaks the TTFT "
                          "bound; reports the highest that held")
    cap.add_argument("--ttft-bound-ms", type=float, default=2000.0, help="the TTFT bound of --capacity-rates")
    cap.add_argument("--ttft-bound-stat", choices=["p50", "p99", "mean"], default="p99",
                     help="which TTFT statistic (pooled over requests) the bound applies to")
    cap.add_argument("--capacity-refine", type=int, default=0,
                     help="bisection steps between the last rate that held and the first that did not")
    out = s.add_argument_group("output")
    out.add_argument("--label", default=None,
                     help="configuration name in the record and in `bench compare` tables (e.g. DP=4, 1P3D)")
    out.add_argument("--json", dest="serve_json", action="store_true", help="print the record as JSON")
    out.add_argument("--output-json", dest="serve_output_json", metavar="FILE", default=None,
                     help="also write the record as JSON to FILE")
    out.add_argument("--no-progress", dest="serve_no_progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_run_serve)

    c = sub.add_parser("compare", help="serving records side by side, as ratios against a baseline",
                       formatter_class=HelpFormatter, parents=[common_parser(config=False)],
                       description="Reads `loopline bench serve --output-json` records (one per configuration) and "
                                   "prints a markdown table per (request rate, phase): every metric as a ratio "
                                   "against the baseline record, and each record's peak capacity.")
    c.add_argument("records", nargs="+", metavar="RECORD.json", help="bench serve records")
    c.add_argument("--baseline", default=None,
                   help="the baseline record: its --label or its position among RECORD.json (0-based; default 0)")
    c.add_argument("--output-md", dest="compare_output", metavar="FILE.md", default=None,
                   help="also write the markdown to FILE.md")
    c.set_defaults(func=_run_compare)


# --- offline ------------------------------------------------------------------------------


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise InvalidRequestError(f"{name} must be >= 1, got {value}", param=name)


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"concurrency must be an integer or a comma list like 1,8,32, got {text!r}",
                                  param="concurrency") from None
    if not values or any(v < 1 for v in values):
        raise InvalidRequestError(f"concurrency values must be >= 1, got {text!r}", param="concurrency")
    return values


def canonical_command(ns: argparse.Namespace, defaults: dict[str, Any]) -> list[str]:
    """``bench`` plus every option that differs from its default: an equivalent command line."""
    args = ["bench"]
    for dest, value in vars(ns).items():
        if dest in ("func", "command", "bench_command") or dest not in defaults or value == defaults[dest]:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args


def _resolve_exit_mode(ns: argparse.Namespace) -> str:
    if ns.exit_mode is None:
        return "trace" if ns.depth_dist else "threshold"
    if ns.depth_dist and ns.exit_mode != "trace":
        raise InvalidRequestError(f"--depth-dist replays depths with exit_mode=trace; got --exit-mode {ns.exit_mode}",
                                  param="exit_mode")
    if ns.exit_mode == "trace" and not ns.depth_dist:
        raise InvalidRequestError("--exit-mode trace needs --depth-dist", param="depth_dist")
    return ns.exit_mode


def _variants(ns: argparse.Namespace) -> list:
    from loopline.bench.offline import DEFAULT_COMPARE, VARIANTS, Variant

    if ns.compare or ns.variants:
        names = [n.strip() for n in ns.variants.split(",") if n.strip()] if ns.variants else list(DEFAULT_COMPARE)
    else:
        names = ["loopline"]
    if ns.hf_baseline and "hf" not in names:
        names.append("hf")
    variants = []
    for name in names:
        if name == "loopline":
            variants.append(Variant("loopline", description="the engine with the flags given"))
        elif name in VARIANTS:
            variants.append(VARIANTS[name])
        else:
            raise InvalidRequestError(f"unknown variant {name!r}; allowed: {', '.join(VARIANTS)}", param="variants")
    if len({v.name for v in variants}) != len(variants):
        raise InvalidRequestError(f"variants must be distinct, got {names}", param="variants")
    return variants


def _checked_sampling(temperature: float, top_p: float | None, top_k: int | None,
                      min_p: float | None) -> dict[str, Any]:
    """Every benchmark request's sampling fields (``None``: not given), checked as a request's are, before
    anything loads or connects (the error names the field and its range)."""
    from loopline.sampling_params import SamplingParams

    fields = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                                ("min_p", min_p)) if v is not None}
    SamplingParams(**fields)
    return fields


def _sampling(ns: argparse.Namespace, variants: list) -> dict[str, Any]:
    """The offline requests' sampling fields; the transformers baseline only decodes greedily."""
    sampling = _checked_sampling(ns.temperature, ns.top_p, ns.top_k, ns.min_p)
    if ns.temperature > 0 and any(v.hf for v in variants):
        raise InvalidRequestError("the transformers baseline (hf) decodes greedily: drop --hf-baseline / the hf "
                                  "variant, or --temperature", param="temperature")
    return sampling


def run_offline(ns: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Runs ``loopline bench`` from parsed arguments; returns the record (also used by tests)."""
    from loopline.bench.compare import run_point
    from loopline.config import EngineArgs
    from loopline.bench.offline import BenchSpec, build_model
    from loopline.bench.report import environment, point_table
    from loopline.bench.workload import make_workload, parse_depth_dist

    for name in ("input_len", "output_len", "num_prompts", "repeats", "warmup_output_len"):
        _positive(name, getattr(ns, name))
    if ns.warmup_prompts is not None and ns.warmup_prompts < 0:
        raise InvalidRequestError(f"warmup_prompts must be >= 0, got {ns.warmup_prompts}", param="warmup_prompts")
    if ns.config and ns.model:
        raise InvalidRequestError("pass --model DIR or --config NAME, not both", param="config")
    concurrencies = _concurrencies(ns.concurrency)
    if ns.plot:
        from loopline.bench.plot import check_plot_available

        check_plot_available(ns.plot)  # before minutes of benchmarking, not after
    exit_mode = _resolve_exit_mode(ns)
    variants = _variants(ns)
    sampling = _sampling(ns, variants)
    repeats = ns.repeats or (3 if len(variants) > 1 else 1)
    args = dataclasses.replace(EngineArgs.from_cli_args(ns), exit_mode=exit_mode)
    apply_cpu_threads(ns.cpu_threads)
    model, device, dtype, source = build_model(args, ns.config, ns.seed)
    cfg = model.config
    depth = parse_depth_dist(ns.depth_dist, cfg.num_loops) if ns.depth_dist else None
    params = {
        "model_source": source, "config": ns.config, "total_ut_steps": cfg.num_loops,
        "dtype": str(dtype).removeprefix("torch."), "input_len": ns.input_len, "output_len": ns.output_len,
        "concurrency": concurrencies, "num_prompts": ns.num_prompts, "depth_dist": ns.depth_dist,
        "shared_prefix_len": ns.shared_prefix_len,
        "depth_dist_probs": None if depth is None else dict(zip(map(str, depth.depths), depth.probs)),
        "requested_mean_loops": None if depth is None else depth.mean,
        "exit_mode": exit_mode, "exit_threshold": ns.exit_threshold, "min_loops": ns.min_loops,
        "lookahead_threshold": ns.lookahead_threshold, "sampling": sampling,
        "variants": [v.name for v in variants], "repeats": repeats, "seed": ns.seed,
        "warmup_prompts": ns.warmup_prompts, "warmup_output_len": ns.warmup_output_len,
        "gpu_timing": "profiler" if ns.profile_kernels else "events",
        "engine_args": dataclasses.asdict(args),
    }
    argv = canonical_command(ns, defaults) if defaults is not None else None
    record = environment(device, argv, params)
    record["process_argv"] = list(sys.argv)
    record["results"] = []
    for c in concurrencies:
        n = ns.num_prompts or 2 * c
        spec = BenchSpec(ns.input_len, ns.output_len, c, n, seed=ns.seed, exit_threshold=ns.exit_threshold,
                         min_loops=ns.min_loops, lookahead_threshold=ns.lookahead_threshold,
                         warmup_prompts=ns.warmup_prompts,
                         warmup_output_len=ns.warmup_output_len, gpu_timing=params["gpu_timing"], **sampling)
        workload = make_workload(n, ns.input_len, ns.output_len, cfg.vocab_size, ns.seed, depth, ns.shared_prefix_len)
        point = run_point(model, args, spec, variants, workload, device, dtype, repeats=repeats,
                          progress=not ns.no_progress)
        record["results"].append(point)
        if not ns.json:
            if len(record["results"]) == 1:
                from loopline.bench.report import header_lines

                print("\n".join(header_lines(record)), flush=True)
            print("\n" + "\n".join(point_table(point)), flush=True)
    if ns.plot:
        from loopline.bench.plot import plot_throughput

        plot_throughput(record, ns.plot)
        if not ns.json:
            print(f"\nwrote {ns.plot}")
    return record


def _run_bench(ns: argparse.Namespace, defaults: dict[str, Any] | None = None) -> int:
    record = run_offline(ns, defaults)
    text = json.dumps(record, indent=2, default=str)
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if ns.json:
        print(text)
    return 0


# --- serve ---------------------------------------------------------------------------------


def server_hardware(base_url: str) -> dict[str, Any]:
    """Where the server runs, for a serve record's ``hardware``: a server on this host (the benchmark
    scripts' case) runs on this host's GPUs, named by ``nvidia-smi`` (the client never touches CUDA: a
    context of its own would take memory the server sized its KV pool around); a remote server's
    hardware is not visible from here."""
    if urllib.parse.urlparse(base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        return {"server": "remote: not visible here (the other fields are the client's)"}
    import subprocess

    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        names = []
    gpus = [n.strip() for n in names if n.strip()]
    return {"server": "this host", "server_gpus": gpus}


def _rates(text: str, param: str, allow_inf: bool = True) -> list[float]:
    """A comma list of request rates (> 0; ``inf`` where allowed)."""
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"{param} must be a number or a comma list like 4,8, got {text!r}",
                                  param=param) from None
    ok = all(v > 0 and (allow_inf or math.isfinite(v)) and not math.isnan(v) for v in values)
    if not values or not ok:
        allowed = "numbers > 0 (inf: all at once)" if allow_inf else "finite numbers > 0"
        raise InvalidRequestError(f"{param} must be {allowed}, got {text!r}", param=param)
    if len(set(values)) != len(values):
        raise InvalidRequestError(f"{param} must be distinct, got {text!r}", param=param)
    return values


def _dataset(ns: argparse.Namespace):
    from loopline.bench.workload import RandomDataset, ShareGPTSynthetic

    if ns.serve_dataset == "sharegpt-synthetic":
        if ns.serve_input_len is not None:
            raise InvalidRequestError("--input-len is for --dataset random; sharegpt-synthetic draws prompt lengths",
                                      param="input_len")
        return ShareGPTSynthetic(output_len=ns.serve_output_len)
    return RandomDataset(input_len=ns.serve_input_len or 1024, output_len=ns.serve_output_len or 128)


def run_serve_bench(ns: argparse.Namespace, transport: Any = None, progress: Any = None) -> dict[str, Any]:
    """Runs ``loopline bench serve`` from parsed arguments; returns the record (also used by tests)."""
    import dataclasses as dc

    import torch

    from loopline.bench.capacity import TTFTBound, check_rates, find_capacity
    from loopline.bench.report import environment
    from loopline.bench.serve import PHASES, ServeSpec, run_phases, run_rates, server_info

    for name in ("serve_input_len", "serve_output_len", "serve_num_prompts", "serve_concurrency",
                 "serve_max_model_len"):
        _positive(name.removeprefix("serve_"), getattr(ns, name))
    capacity_rates = (check_rates(_rates(ns.capacity_rates, "capacity_rates", allow_inf=False))
                      if ns.capacity_rates else None)
    bound = TTFTBound(ns.ttft_bound_ms, ns.ttft_bound_stat) if capacity_rates else None
    if ns.capacity_refine < 0:
        raise InvalidRequestError(f"capacity_refine must be >= 0, got {ns.capacity_refine}", param="capacity_refine")
    if ns.request_rate is not None:
        rates = _rates(ns.request_rate, "request_rate")
    else:
        rates = [] if capacity_rates else [math.inf]
    dataset = _dataset(ns)
    sampling = _checked_sampling(ns.serve_temperature, ns.serve_top_p, ns.serve_top_k, ns.serve_min_p)
    try:  # up front: a benchmark against no server would only print a table of failures
        reported, server_len = server_info(ns.base_url, transport, timeout_s=min(30.0, ns.timeout))
    except Exception as e:  # noqa: BLE001 -- httpx's connect/timeout/protocol errors, OSError: all mean no answer
        raise InvalidRequestError(f"no server answers at {ns.base_url} ({type(e).__name__}: {' '.join(str(e).split())}); "
                                  "start one with `loopline serve` or pass --base-url", param="base_url") from None
    model = ns.served_model or reported
    max_model_len = ns.serve_max_model_len or server_len
    spec = ServeSpec(ns.base_url, rates[0] if rates else math.inf, ns.serve_concurrency, model,
                     ns.serve_seed, ns.timeout, **sampling)

    def workload_for(k: int):
        return dataset.build(ns.serve_num_prompts, ns.vocab_size, ns.serve_seed + k, max_model_len)

    runs = run_rates(spec, rates, workload_for, ns.replay, transport, progress) if rates else []
    capacity = None
    if capacity_rates:
        first = len(rates)  # capacity steps get request sets of their own (seed + first + step)

        def run_at(rate: float, step: int) -> dict[str, Any]:
            k = first + step
            return run_phases(dc.replace(spec, request_rate=rate, seed=ns.serve_seed + k), workload_for(k),
                              PHASES[:1], transport, progress)[0]

        capacity = find_capacity(run_at, capacity_rates, bound, ns.capacity_refine)
    sample = workload_for(0)
    params = {"base_url": ns.base_url, "model": spec.model, **dataset.describe(), "num_prompts": ns.serve_num_prompts,
              "max_model_len": max_model_len, "request_rates": rates, "replay": ns.replay,
              "concurrency": ns.serve_concurrency, "seed": ns.serve_seed, "vocab_size": ns.vocab_size,
              "sampling": sampling,
              "workload_seed0": {"mean_input_len": sample.input_tokens / max(sample.num_prompts, 1),
                                 "mean_output_len": sample.output_tokens / max(sample.num_prompts, 1)},
              "capacity_rates": capacity_rates, "ttft_bound_ms": ns.ttft_bound_ms if bound else None,
              "ttft_bound_stat": ns.ttft_bound_stat if bound else None}
    record = environment(torch.device("cpu"), None, params)  # the client's machine
    record["hardware"].update(server_hardware(ns.base_url))
    record["label"] = ns.label or ns.base_url
    record["results"] = runs
    record["capacity"] = capacity
    return record


def _run_serve(ns: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from loopline.bench.report import serve_table

    # disable=None: no bar when stderr is not a terminal (logs get no carriage-return litter)
    bar = tqdm(disable=True if ns.serve_no_progress else None, unit="req", leave=False, desc="bench serve")
    try:
        record = run_serve_bench(ns, progress=bar.update)
    finally:
        bar.close()
    text = json.dumps(record, indent=2, default=str)
    if ns.serve_output_json:
        with open(ns.serve_output_json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    # NOTE: a capacity step may fail every request (overload is what it looks for): only the rates count here
    ok = all(r.get("completed") for r in record["results"])
    if ns.serve_json:
        print(text)
        return 0 if ok else 1
    p = record["params"]
    print(f"command:  {record['command']}\nserver:   {ns.base_url} (model {p['model']}, max_model_len "
          f"{p['max_model_len']}) | label {record['label']}")
    w = p["workload_seed0"]
    print(f"workload: {p['dataset']}, {p['num_prompts']} requests per phase, mean {w['mean_input_len']:.1f} in / "
          f"{w['mean_output_len']:.1f} out (seed {p['seed']}), greedy, ignore_eos")
    if record["results"]:
        print("\n".join(serve_table(record["results"])))
    for run in record["results"]:
        for err in run["errors"]:
            print(f"  error ({_rate_text(run['request_rate'])} req/s, {run['phase']}): {err}")
    cap = record["capacity"]
    if cap:
        steps = ", ".join(f"{s['request_rate']:g}: p50/p99 TTFT {_ms(s['ttft_ms'], 'p50')}/"
                          f"{_ms(s['ttft_ms'], 'p99')} ms"
                          f"{'' if s['holds'] else ' (breaks the bound)'}" for s in cap["steps"])
        value = cap["capacity_rps"]
        head = ("below the lowest rate tried" if value is None
                else (f">= {value:g} req/s (every rate held)" if cap["lower_bound_only"] else f"{value:g} req/s"))
        print(f"peak capacity ({cap['bound']['text']}): {head}\n  {steps}")
    return 0 if ok else 1


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(summary: dict | None, stat: str) -> str:
    value = (summary or {}).get(stat)
    return "-" if value is None else f"{value:,.1f}"


def _run_compare(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from loopline.bench.report import check_serve_record, serve_comparison

    records = []
    for path in ns.records:
        try:
            record = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidRequestError(f"{path}: cannot read a JSON record ({e})", param="records") from None
        check_serve_record(record, path)
        record.setdefault("label", Path(path).stem)
        records.append(record)
    baseline = 0
    if ns.baseline is not None:
        labels = [r["label"] for r in records]
        if ns.baseline in labels:
            baseline = labels.index(ns.baseline)
        elif ns.baseline.isdigit() and int(ns.baseline) < len(records):
            baseline = int(ns.baseline)
        else:
            raise InvalidRequestError(f"baseline {ns.baseline!r} is neither a record label ({', '.join(labels)}) nor "
                                      f"an index in [0, {len(records) - 1}]", param="baseline")
    text = "\n".join(serve_comparison(records, baseline))
    print(text)
    if ns.compare_output:
        Path(ns.compare_output).write_text(text + "\n", encoding="utf-8")
    return 0
