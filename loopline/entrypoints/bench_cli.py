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
import shlex
import sys
from typing import Any

from loopline.errors import InvalidRequestError

HELP = "offline throughput/latency benchmark (and `bench serve` for an HTTP server)"


def add_parser(sub: Any) -> None:
    from loopline.config import EngineArgs
    from loopline.entrypoints.cli import SAMPLING_HELP, HelpFormatter, common_parser

    p = sub.add_parser("bench", help=HELP, formatter_class=HelpFormatter, parents=[common_parser(config=False)],
                       description="Closed-loop offline benchmark of the engine on random prompts; see docs/benchmarks/README.md.")
    w = p.add_argument_group("workload")
    w.add_argument("--config", choices=["tiny", "ouro-1.4b", "ouro-2.6b"], default=None,
                   help="random weights of these shapes, built in memory (default without --model: tiny); "
                        "--config FILE.yaml reads flags from a YAML file instead, as for the other commands")
    w.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (random ids)")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos, greedy)")
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
                   help=SAMPLING_HELP["min_loops"] + " (default: 1); with exit_mode=threshold")
    w.add_argument("--warmup-prompts", type=int, default=None, help="warm-up requests before each run (default: concurrency)")
    w.add_argument("--warmup-output-len", type=int, default=16, help="output tokens of each warm-up request")
    r = p.add_argument_group("comparison and output")
    r.add_argument("--compare", action="store_true",
                   help="run variants interleaved and report ratios vs the first (default: refill,no_refill,fixed)")
    r.add_argument("--variants", default=None,
                   help="comma list for --compare from: refill, no_refill, fixed, shared, last_exited, "
                        "no_prefix_cache, prefix_cache, sync, async, eager, hf")
    r.add_argument("--hf-baseline", action="store_true",
                   help="also run transformers generate() on the same weights (static batches of concurrency)")
    r.add_argument("--repeats", type=int, default=None, help="interleaved rounds, medians reported (default: 3 with --compare, else 1)")
    r.add_argument("--json", action="store_true", help="print the whole record as JSON instead of tables")
    r.add_argument("--output-json", metavar="FILE", default=None, help="also write the whole record as JSON to FILE")
    r.add_argument("--plot", metavar="FILE.png", default=None, help="write output tok/s vs concurrency (needs matplotlib)")
    r.add_argument("--profile-kernels", action="store_true",
                   help="GPU idle from torch.profiler kernel intervals (exact, with profiler overhead) instead of CUDA events")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(p)
    # None = "sized by the bench" (engine_args_for) or "resolved from --depth-dist" (exit_mode).
    p.set_defaults(max_num_seqs=None, max_num_batched_tokens=None, exit_mode=None)
    _add_serve(p.add_subparsers(dest="bench_command", metavar="{serve}"))
    p.set_defaults(func=functools.partial(_run_bench, defaults=vars(p.parse_args([]))))


def _add_serve(sub: Any) -> None:
    from loopline.entrypoints.cli import HelpFormatter, common_parser

    s = sub.add_parser("serve", help="drive a running OpenAI-compatible server over HTTP", formatter_class=HelpFormatter,
                       parents=[common_parser(config=False)])
    s.add_argument("--base-url", required=True, help="server root, e.g. http://localhost:8000")
    s.add_argument("--model", dest="served_model", default=None, help="model name for requests (default: first of /v1/models)")
    s.add_argument("--input-len", dest="serve_input_len", type=int, default=1024, help="prompt tokens (random ids)")
    s.add_argument("--output-len", dest="serve_output_len", type=int, default=128, help="max_tokens, with ignore_eos")
    s.add_argument("--num-prompts", dest="serve_num_prompts", type=int, default=100, help="requests to send")
    s.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    s.add_argument("--concurrency", dest="serve_concurrency", type=int, default=None,
                   help="max requests in flight (closed loop with --request-rate inf)")
    s.add_argument("--vocab-size", type=int, default=500, help="random prompt ids are drawn from [3, vocab_size)")
    s.add_argument("--seed", dest="serve_seed", type=int, default=0, help="seed of prompts and arrivals")
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    s.add_argument("--json", dest="serve_json", action="store_true", help="print the record as JSON")
    s.add_argument("--no-progress", dest="serve_no_progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_run_serve)


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
    repeats = ns.repeats or (3 if len(variants) > 1 else 1)
    args = dataclasses.replace(EngineArgs.from_cli_args(ns), exit_mode=exit_mode)
    model, device, dtype, source = build_model(args, ns.config, ns.seed)
    cfg = model.config
    depth = parse_depth_dist(ns.depth_dist, cfg.total_ut_steps) if ns.depth_dist else None
    params = {
        "model_source": source, "config": ns.config, "total_ut_steps": cfg.total_ut_steps,
        "dtype": str(dtype).removeprefix("torch."), "input_len": ns.input_len, "output_len": ns.output_len,
        "concurrency": concurrencies, "num_prompts": ns.num_prompts, "depth_dist": ns.depth_dist,
        "shared_prefix_len": ns.shared_prefix_len,
        "depth_dist_probs": None if depth is None else dict(zip(map(str, depth.depths), depth.probs)),
        "requested_mean_loops": None if depth is None else depth.mean,
        "exit_mode": exit_mode, "exit_threshold": ns.exit_threshold, "min_loops": ns.min_loops,
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
                         min_loops=ns.min_loops, warmup_prompts=ns.warmup_prompts,
                         warmup_output_len=ns.warmup_output_len, gpu_timing=params["gpu_timing"])
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


# --- serve --------------------------------------------------------------------------------


def _run_serve(ns: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from loopline.bench.report import environment
    from loopline.bench.serve import ServeSpec, run_serve
    from loopline.bench.workload import make_workload

    for name in ("serve_input_len", "serve_output_len", "serve_num_prompts", "serve_concurrency"):
        _positive(name.removeprefix("serve_"), getattr(ns, name))
    if not ns.request_rate > 0:
        raise InvalidRequestError(f"request_rate must be > 0 (inf: all at once), got {ns.request_rate}", param="request_rate")
    workload = make_workload(ns.serve_num_prompts, ns.serve_input_len, ns.serve_output_len, ns.vocab_size, ns.serve_seed)
    spec = ServeSpec(ns.base_url, ns.serve_output_len, ns.request_rate, ns.serve_concurrency, ns.served_model,
                     ns.serve_seed, ns.timeout)
    # disable=None: no bar when stderr is not a terminal (logs get no carriage-return litter)
    bar = tqdm(total=workload.num_prompts, disable=True if ns.serve_no_progress else None, unit="req", leave=False,
               desc="bench serve")
    try:
        result = run_serve(spec, workload, progress=bar.update)
    finally:
        bar.close()
    params = {"base_url": ns.base_url, "model": result["model"], "input_len": ns.serve_input_len,
              "output_len": ns.serve_output_len, "num_prompts": ns.serve_num_prompts,
              "request_rate": ns.request_rate, "concurrency": ns.serve_concurrency, "seed": ns.serve_seed}
    record = environment(torch.device("cpu"), None, params)  # the client's machine; the server's is not visible
    record["results"] = result
    if ns.serve_json:
        print(json.dumps(record, indent=2, default=str))
        return 0
    m = result
    print(f"command:  {shlex.join(['loopline', *sys.argv[1:]])}\nserver:   {ns.base_url} (model {m['model']})")
    print(f"requests: {m['completed']} ok, {m['failed']} failed, {m['duration_s']:.2f} s")
    for err in m["errors"]:
        print(f"  error: {err}")
    print(f"throughput: {m['request_throughput'] or 0:.2f} req/s, output {m['output_throughput'] or 0:,.1f} tok/s, "
          f"total {m['total_token_throughput'] or 0:,.1f} tok/s")
    if m["mean_loops_per_token"] is not None:
        print(f"mean loops per token (server's exit_depths): {m['mean_loops_per_token']:.3f}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = m[key]
        vals = " ".join(f"{k} {v:,.2f}" if v is not None else f"{k} -" for k, v in s.items())
        print(f"{key[:-3].upper():5s} (ms): {vals}")
    return 0 if m["completed"] else 1
