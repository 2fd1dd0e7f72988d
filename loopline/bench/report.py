"""The benchmark record (command, commit, hardware, parameters, results) and its text tables."""
from __future__ import annotations

import shlex
import sys
from typing import Any

import torch

from loopline.bench.env import git_commit, hardware_info, software_info


def environment(device: torch.device, argv: list[str] | None, params: dict[str, Any]) -> dict[str, Any]:
    """Everything a reader needs to judge a result besides the numbers."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": "loopline " + shlex.join(args),
        "argv": args,
        "git": git_commit(),
        "hardware": hardware_info(device),
        "software": software_info(),
        "params": params,
    }


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _pair(d: dict[str, Any], digits: int = 1) -> str:
    return f"{_fmt(d.get('p50'), digits)} / {_fmt(d.get('p99'), digits)}"


def _sampling_words(params: dict[str, Any]) -> str:
    """``greedy``, or the sampling fields that differ from off (records before the fields existed: greedy)."""
    s = params.get("sampling") or {}
    if not s.get("temperature"):
        return "greedy"
    on = {"temperature": True, "top_p": s.get("top_p", 1.0) < 1.0, "top_k": s.get("top_k", 0) > 0,
          "min_p": s.get("min_p", 0.0) > 0.0}
    return "sampled " + " ".join(f"{k}={v}" for k, v in s.items() if on.get(k))


def header_lines(record: dict[str, Any]) -> list[str]:
    git, hw, sw = record["git"], record["hardware"], record["software"]
    commit = git["commit"] or "unknown"
    if git.get("dirty"):
        commit += " (+ local changes)"
    device = hw.get("gpu") or f"CPU: {hw['cpu']} ({hw['cpu_count']} cores, {hw['torch_threads']} torch threads)"
    p = record["params"]
    lines = [
        f"command:  {record['command']}",
        f"commit:   {commit}",
        f"hardware: {device}",
        f"software: torch {sw['torch']}, transformers {sw['transformers']}, python {sw['python']}",
        f"model:    {p['model_source']} | dtype {p['dtype']} | total_ut_steps {p['total_ut_steps']}",
        f"workload: {p['input_len']} in / {p['output_len']} out, closed loop, {_sampling_words(p)}, ignore_eos | "
        f"depth {p['depth_dist'] or p['exit_mode']} | repeats {p['repeats']} (medians)",
    ]
    if sw.get("timing_hooks"):
        hooks = ", ".join(f"{k}={v}" for k, v in sw["timing_hooks"].items())
        lines.append(f"NOTE: timing hooks set ({hooks}): not the defaults a user gets.")
    if not hw.get("gpu"):
        lines.append("NOTE: CPU run -- absolute numbers say little about GPU performance; GPU idle is n/a.")
    return lines


TABLE_COLUMNS = ("variant", "out tok/s", "vs first", "total tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                 "ITL p50/p99 ms", "loops/tok", "steps", "rows/step", "step ms", "prefill steps (s)", "GB/s", "% peak BW", "GPU idle")


def _prefill_cell(m: dict[str, Any]) -> str:
    """Steps that carried prefill chunks and their host time (loopline variants only)."""
    if m.get("prefill_steps") is None:
        return "-"
    return f"{m['prefill_steps']:,} ({m['prefill_step_time_s']:.2f})"


def point_table(point: dict[str, Any]) -> list[str]:
    """A markdown table of one concurrency point (medians over repeats)."""
    lines = [f"concurrency {point['concurrency']}, {point['num_prompts']} requests"
             + (f", trace mean loops {point['trace_mean_loops']:.3f}" if point.get("trace_mean_loops") else ""),
             "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for row in point["variants"]:
        m = row["median"]
        util = m.get("bandwidth_utilization")
        idle = m.get("gpu_idle_fraction")
        cells = [row["name"], _fmt(m["output_throughput"]), _fmt(row["ratio_output_throughput"], 2) + "x",
                 _fmt(m["total_token_throughput"]), _pair(m["ttft_ms"]), _pair(m["tpot_ms"], 2), _pair(m["itl_ms"], 2),
                 _fmt(m["mean_loops_per_token"], 2), _fmt(m["steps"], 0), _fmt(m["rows_per_step"], 1),
                 _fmt(m["mean_step_time_ms"], 2), _prefill_cell(m), _fmt(m["achieved_gbps"], 2),
                 "-" if util is None else f"{100 * util:.0f}%", "-" if idle is None else f"{100 * idle:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    for row in point["variants"]:  # loop self-speculation: vLLM's acceptance figures of the measured part
        spec = row["median"].get("spec_decode")
        if spec:
            drafts, accepted = spec["vllm:spec_decode_num_draft_tokens"], spec["vllm:spec_decode_num_accepted_tokens"]
            lines.append(f"{row['name']}: speculation {accepted:,} of {drafts:,} draft tokens accepted"
                         + (f" ({accepted / drafts:.1%})" if drafts else "")
                         + f", mean acceptance length {_fmt(spec['mean_acceptance_length'], 2)}")
    return lines


def text_report(record: dict[str, Any]) -> str:
    lines = header_lines(record)
    for point in record["results"]:
        lines += [""] + point_table(point)
    return "\n".join(lines)


# --- serving records side by side (``loopline bench compare``) -----------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


#: (column, record key, statistic or None) of the comparison table; latencies are milliseconds.
SERVE_METRICS = (
    ("out tok/s", "output_throughput", None),
    ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT p50", "tpot_ms", "p50"), ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"),
    ("E2E p50", "e2el_ms", "p50"), ("E2E p99", "e2el_ms", "p99"),
)


def _metric(run: dict[str, Any], key: str, stat: str | None) -> float | None:
    value = run.get(key)
    return value.get(stat) if stat is not None and isinstance(value, dict) else value


def _rate(rate: Any) -> str:
    return "inf" if rate is None or (isinstance(rate, float) and rate == float("inf")) else f"{rate:g}"


def check_serve_record(record: Any, name: str) -> None:
    """A ``loopline bench serve`` record: ``results`` is a list of runs with a phase and a rate."""
    results = record.get("results") if isinstance(record, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and "phase" in r and "request_rate" in r
                                                for r in results):
        from loopline.errors import InvalidRequestError

        raise InvalidRequestError(f"{name}: not a `loopline bench serve --output-json` record (its results need "
                                  "a request_rate and a phase per run)", param="records")


def serve_comparison(records: list[dict[str, Any]], baseline: int = 0) -> list[str]:
    """Markdown: every run of every record as ratios against the baseline record's run of the same
    (request rate, phase); the baseline row shows absolute values. Throughput: higher is better;
    latencies: lower is better. Then each record's peak capacity, if it searched for one."""
    base = records[baseline]
    label = lambda r: r.get("label") or "?"  # noqa: E731
    lines = [f"Baseline: **{label(base)}**. Cells are value / baseline (ratio), then the value; latencies in ms, "
             "percentiles pooled over requests (ITL over every inter-token gap).", "",
             "| configuration | commit | hardware | command |", "|---|---|---|---|"]
    for r in records:
        git, hw = r.get("git") or {}, r.get("hardware") or {}
        commit = (git.get("commit") or "unknown")[:12] + (" (+ local changes)" if git.get("dirty") else "")
        gpus = hw.get("server_gpus") or []  # a serve record's server on the client's host
        device = f"{len(gpus)} x {gpus[0]}" if len(gpus) > 1 and len(set(gpus)) == 1 else ", ".join(gpus) if gpus \
            else hw.get("gpu") or hw.get("cpu") or "-"
        if str(hw.get("server", "")).startswith("remote"):
            device = f"client: {device} (server not visible)"
        lines.append(f"| {label(r)} | {commit} | {device} | `{r.get('command', '-')}` |")
    keys: list[tuple[Any, str]] = []
    for r in records:
        for run in r["results"]:
            key = (run["request_rate"], run["phase"])
            if key not in keys:
                keys.append(key)
    header = "| configuration | " + " | ".join(c for c, _, _ in SERVE_METRICS) + " | prefix-cache hits | failed |"
    for rate, phase in keys:
        lines += ["", f"**{_rate(rate)} requests/s, {phase} phase**", "", header,
                  "|---|" + "---|" * (len(SERVE_METRICS) + 2)]
        base_run = next((x for x in base["results"] if (x["request_rate"], x["phase"]) == (rate, phase)), None)
        for i, r in enumerate(records):
            run = next((x for x in r["results"] if (x["request_rate"], x["phase"]) == (rate, phase)), None)
            if run is None:
                lines.append(f"| {label(r)} | " + " | ".join(["not run"] * len(SERVE_METRICS)) + " | - | - |")
                continue
            cells = []
            for _, key, stat in SERVE_METRICS:
                value = _metric(run, key, stat)
                digits = 1 if key in ("output_throughput", "ttft_ms", "e2el_ms") else 2
                if i == baseline:
                    cells.append(_fmt(value, digits))
                else:
                    q = ratio(value, None if base_run is None else _metric(base_run, key, stat))
                    cells.append(("-" if q is None else f"{q:.3f}x") + f" ({_fmt(value, digits)})")
            pc = run.get("prefix_cache") or {}
            hits = "-" if pc.get("hit_rate") is None else f"{100 * pc['hit_rate']:.0f}%"
            name = label(r) + (" (baseline)" if i == baseline else "")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {hits} | {run.get('failed', '-')} |")
    if any(r.get("capacity") for r in records):
        base_cap = (base.get("capacity") or {}).get("capacity_rps")
        lines += ["", "**Peak capacity** (highest request rate that held the bound)", "",
                  "| configuration | bound | capacity req/s | vs baseline | rates tried |", "|---|---|---|---|---|"]
        for r in records:
            cap = r.get("capacity")
            if not cap:
                lines.append(f"| {label(r)} | - | not searched | - | - |")
                continue
            value = cap.get("capacity_rps")
            shown = "below the lowest rate" if value is None else (f">= {value:g}" if cap.get("lower_bound_only")
                                                                    else f"{value:g}")
            q = ratio(value, base_cap)
            tried = ", ".join(f"{s['request_rate']:g}{'' if s['holds'] else ' (no)'}" for s in cap.get("steps", []))
            lines.append(f"| {label(r)} | {cap['bound']['text']} | {shown} | {'-' if q is None else f'{q:.3f}x'} | "
                         f"{tried} |")
    return lines


def serve_table(runs: list[dict[str, Any]]) -> list[str]:
    """A markdown table of ``loopline bench serve`` runs (one row per rate and phase)."""
    cols = ("rate req/s", "phase", "ok / failed", "duration s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
            "ITL p50/p99 ms", "E2E p50/p99 ms", "prefix-cache hits")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for run in runs:
        pc = run.get("prefix_cache") or {}
        hits = "-" if pc.get("hit_rate") is None else f"{100 * pc['hit_rate']:.0f}% of {pc['queries']:,.0f} tokens"
        cells = [_rate(run["request_rate"]), run["phase"], f"{run['completed']} / {run['failed']}",
                 _fmt(run["duration_s"], 2), _fmt(run["output_throughput"]), _pair(run["ttft_ms"]),
                 _pair(run["tpot_ms"], 2), _pair(run["itl_ms"], 2), _pair(run["e2el_ms"]), hits]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
