"""The lookahead exit policy on Ouro shapes with random weights, against the stock exit path at the same
depths and fixed depth, in one process (issue #44; docs/lookahead.md, 'In the engine').

Random weights have no meaningful gate and no trained head, so depths are *replayed*: every request gets
one seeded per-token depth trace (``--depth-dist``; depths >= 2, the least the lookahead policy can
announce two loops ahead). Variants, each a fresh engine on the same in-memory model, sharing one model
directory that holds a random lookahead head (default shapes: 32 projection channels, 64 hidden units):

* ``lookahead_replayed``: ``exit_mode="lookahead"``; the head's rule runs with a ``ReplayPredictor`` that
  fires where the trace says (labelled: the exit pattern is replayed, not predicted);
* ``stock_replayed``: ``exit_mode="trace"``: the stock exit path (exit decided after the loop on the
  device, the coda for every row) at exactly the same depths;
* ``fixed``: every token runs all loops (the head loaded and unused).

Writes ``lookahead_h200.json`` (every run's record, as ``loopline bench`` writes them) and
``lookahead_h200.md`` (one table per concurrency) to ``--out`` (default ``$OUT``). On one H200:

    python tools/lookahead_h200.py --config ouro-1.4b --concurrency 1,32,128 --input-len 1024 --output-len 128

On the CPU, to check it runs (tiny shapes):

    python tools/lookahead_h200.py --config tiny --device cpu --dtype float32 --concurrency 1,4 \\
        --input-len 32 --output-len 16 --out /tmp/la-h200
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loopline.bench.offline import BenchSpec, Variant, build_model, run_engine
from loopline.bench.workload import make_workload, parse_depth_dist
from loopline.config import EngineArgs
from loopline.models.lookahead_head import (
    HeadConfig,
    LookaheadHead,
    TraceSpec,
    num_features,
    save_head,
)
from loopline.worker.lookahead_rule import ReplayPredictor

VARIANTS = (
    Variant("lookahead_replayed", {"exit_mode": "lookahead"},
            description="exit_mode=lookahead, the head's rule with a ReplayPredictor (replayed exit pattern)"),
    Variant("stock_replayed", {"exit_mode": "trace"},
            description="the stock exit path (exit_mode=trace) at the same per-token depths"),
    Variant("fixed", {"exit_mode": "fixed"}, description="every token runs all loops"),
)


def head_dir(hidden_size: int, loops: int, out: Path) -> Path:
    """A directory holding a random lookahead head for the model's shapes (what the engine loads)."""
    spec = TraceSpec()
    torch.manual_seed(0)
    head = LookaheadHead(num_features(spec.proj_dim, loops), hidden=64)
    save_head(head, HeadConfig(threshold=0.5, loops=loops, hidden=64, spec=vars(spec), hidden_size=hidden_size), out)
    return out


def install_replay(engine: Any) -> None:
    """The replayed exit pattern in place of the head's decisions (the head still runs, its output ignored, so a
    step costs what it costs with a head); CUDA graphs, captured with the head, are captured again with it."""
    runner = engine.runner
    rule = runner.lookahead_rule
    rule.predictor = ReplayPredictor(runner.max_num_seqs + 1, runner.decode_state.max_tokens, runner.device,
                                     cost_of=rule.predictor)
    if runner.graphs is not None:
        runner.graphs = None
        gc.collect()
        torch.cuda.empty_cache()  # (the first graphs' pool, before the second capture)
        runner.restore_graphs()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _row(run: dict, base: dict) -> str:
    tps, ref = run["output_throughput"], base["output_throughput"]
    p50 = [run[k]["p50"] for k in ("ttft_ms", "tpot_ms")]
    step = run["decode_step_time_ms"]
    cells = [f"{v:.2f}" if v is not None else "-" for v in (step, *p50)]
    return (f"| {run['variant']} | {tps:,.1f} | {tps / ref:.3f}x | {run['mean_loops_per_token']:.2f} | {run['steps']:,} "
            f"| {' | '.join(cells)} |")


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [f"# Lookahead exits, replayed exit pattern: {meta['config']} shapes, random weights", "",
             f"Command: `{meta['command']}`", "",
             (f"Commit `{meta['commit']}`, {meta['device_name']}, {meta['dtype']}, depth distribution "
              f"`{meta['depth_dist']}` (mean {meta['depth_mean']:.3f}), {meta['input_len']} in / {meta['output_len']} "
              f"out, greedy, ignore_eos. `lookahead_replayed`: the lookahead policy's machinery with the exit pattern "
              f"replayed (not predicted). `vs stock`: output tokens/s over `stock_replayed` (same depths)."), ""]
    for point in results:
        runs = {r["variant"]: r for r in point["runs"]}
        lines += [f"## Concurrency {point['concurrency']} ({point['num_prompts']} requests)", "",
                  "| variant | out tok/s | vs stock | loops/tok | steps | decode step ms | TTFT p50 ms | TPOT p50 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [_row(r, runs["stock_replayed"]) for r in point["runs"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ouro-1.4b", choices=["tiny", "ouro-1.4b", "ouro-2.6b"])
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-concurrency", type=int, default=1, help="requests per run = this x concurrency "
                   "(at least --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--depth-dist", default="2:0.55,3:0.3,4:0.15", help="per-token depths replayed (>= 2)")
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON and the table")
    ns = p.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = EngineArgs(model=tmp, device=ns.device, dtype=ns.dtype, disable_log_stats=True)
        model, device, dtype, source = build_model(dataclasses.replace(base, model=None), ns.config, ns.seed)
        cfg = model.config
        head_dir(cfg.hidden_size, cfg.num_loops, Path(tmp))
        dist = parse_depth_dist(ns.depth_dist, cfg.num_loops)
        if min(dist.depths) < 2:
            raise SystemExit(f"--depth-dist {ns.depth_dist!r}: depths must be >= 2 (the lookahead policy's least)")
        chosen = [v for v in VARIANTS if v.name in ns.variants.split(",")]
        results, t0 = [], time.perf_counter()
        for c in (int(x) for x in ns.concurrency.split(",")):
            n = max(ns.min_prompts, ns.prompts_per_concurrency * c)
            workload = make_workload(n, ns.input_len, ns.output_len, cfg.vocab_size, ns.seed, dist)
            spec = BenchSpec(ns.input_len, ns.output_len, c, n, seed=ns.seed, lookahead_threshold=0.5,
                             warmup_prompts=min(c, 8))
            runs = []
            for v in chosen:
                run = run_engine(model, base, spec, v, workload, device, dtype,
                                 setup=install_replay if v.name == "lookahead_replayed" else None)
                runs.append(run)
                print(json.dumps({"concurrency": c, "variant": v.name, "out_tok_s": round(run["output_throughput"], 1),
                                  "loops_per_token": run["mean_loops_per_token"], "steps": run["steps"],
                                  "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
            results.append({"concurrency": c, "num_prompts": n, "runs": runs})
    meta = {"command": "python tools/lookahead_h200.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(ns).items() if k != "out"),
            "commit": _commit(), "config": ns.config, "model_source": source,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(dtype).removeprefix("torch."), "depth_dist": ns.depth_dist, "depth_mean": dist.mean,
            "input_len": ns.input_len, "output_len": ns.output_len, "torch": torch.__version__,
            "wall_s": round(time.perf_counter() - t0, 1)}
    (out / "lookahead_h200.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (out / "lookahead_h200.md").write_text(markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
