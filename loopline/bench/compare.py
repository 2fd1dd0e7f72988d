"""Runs variants interleaved (A B C A B C ...) and reduces repeats to medians and ratios.

Interleaving spreads slow drift of the machine (clocks, thermals, other load)
over every variant instead of penalizing whichever ran last. Every variant and
repeat runs the same workload (same prompts, same depth traces).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from loopline.bench.offline import BenchSpec, Variant, run_engine
from loopline.bench.report import ratio as _ratio
from loopline.bench.workload import Workload
from loopline.config import EngineArgs
from loopline.models.ouro import OuroForCausalLM

RunFn = Callable[..., dict[str, Any]]


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise median of run records (numbers; nested dicts recursively; other values from the first run)."""
    first = runs[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r.get(key) for r in runs]
        if isinstance(value, dict) and all(isinstance(v, dict) for v in values):
            out[key] = median_record(values)
        elif all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            nums = [v for v in values if v is not None]
            out[key] = statistics.median(nums) if nums else None
        else:
            out[key] = value
    return out


def run_point(model: OuroForCausalLM, base_args: EngineArgs, spec: BenchSpec, variants: list[Variant],
              workload: Workload, device: torch.device, dtype: torch.dtype, repeats: int = 1,
              progress: bool = True, hf_runner: RunFn | None = None) -> dict[str, Any]:
    """All variants at one concurrency, ``repeats`` interleaved rounds.

    Returns ``{"concurrency", "num_prompts", "variants": [{"name", "description",
    "median", "runs", "ratio_output_throughput", "ratio_tpot_p50"}]}`` with ratios
    against the first variant (throughput: higher is better; TPOT: lower is better).
    """
    if hf_runner is None and any(v.hf for v in variants):
        from loopline.bench.hf_baseline import run_hf as hf_runner
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    total = repeats * len(variants) * workload.num_prompts
    # disable=None: no bar when stderr is not a terminal (logs get no carriage-return litter)
    bar = tqdm(total=total, disable=True if not progress else None, unit="req", dynamic_ncols=True, leave=False,
               desc=f"bench C={spec.concurrency}")
    try:
        for round_ in range(repeats):
            for v in variants:
                bar.set_postfix_str(f"{v.name} round {round_ + 1}/{repeats}")
                if v.hf:
                    rec = hf_runner(model, spec, workload, device, dtype, progress=bar.update)
                else:
                    rec = run_engine(model, base_args, spec, v, workload, device, dtype, progress=bar.update)
                rec["round"] = round_
                runs[v.name].append(rec)
    finally:
        bar.close()
    rows = []
    for v in variants:
        rows.append({"name": v.name, "description": v.description, "median": median_record(runs[v.name]),
                     "runs": runs[v.name]})
    base = rows[0]["median"]
    for row in rows:
        med = row["median"]
        row["ratio_output_throughput"] = _ratio(med["output_throughput"], base["output_throughput"])
        row["ratio_tpot_p50"] = _ratio(med["tpot_ms"]["p50"], base["tpot_ms"]["p50"])
    return {"concurrency": spec.concurrency, "num_prompts": workload.num_prompts, "input_len": spec.input_len,
            "output_len": spec.output_len, "repeats": repeats, "trace_mean_loops": workload.trace_mean_depth,
            "variants": rows}
