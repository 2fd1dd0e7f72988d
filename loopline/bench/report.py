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
        f"workload: {p['input_len']} in / {p['output_len']} out, closed loop, greedy, ignore_eos | "
        f"depth {p['depth_dist'] or p['exit_mode']} | repeats {p['repeats']} (medians)",
    ]
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
    return lines


def text_report(record: dict[str, Any]) -> str:
    lines = header_lines(record)
    for point in record["results"]:
        lines += [""] + point_table(point)
    return "\n".join(lines)
