"""What the engine's exit-trace recorder costs (issue #44; docs/lookahead.md, 'Engine traces'), in one process.

Variants, each a fresh engine on the same in-memory model and workload, run in turn ``--repeats`` times
(interleaved, so drift hits them alike); the table gives each variant's median output tok/s and its median
ratio to ``off`` over the rounds:

* ``off``: the default, no recorder (nothing of it runs);
* ``on``: ``exit_trace={"dir": ...}`` (projections, prompt rows, shards to a temporary directory);
* ``on_labels``: the same with ``"labels": true`` (an ``lm_head`` per row and loop).

On the CPU (the bundled demo model):

    python tools/exit_trace_cost.py --device cpu --dtype float32 --concurrency 1,8 --repeats 5

On a GPU (Ouro-1.4B shapes, random weights):

    python tools/exit_trace_cost.py --config ouro-1.4b --concurrency 1,32,128 --input-len 1024 --output-len 128
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from loopline.bench.offline import BenchSpec, Variant, build_model, run_engine
from loopline.bench.workload import make_workload
from loopline.config import EngineArgs
from loopline.models.tiny import default_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="random weights of a bench config (default: the demo model)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default=None, help="also write every run's figures here")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None if ns.config else str(default_checkpoint())
        base = EngineArgs(model=model_dir, device=ns.device, dtype=ns.dtype, disable_log_stats=True)
        model, device, dtype, source = build_model(base, ns.config, 0)
        if ns.config:
            base = dataclasses.replace(base, model=None)
        variants = [Variant("off"), Variant("on", {"exit_trace": {"dir": f"{tmp}/on"}}),
                    Variant("on_labels", {"exit_trace": {"dir": f"{tmp}/labels", "labels": True}})]
        rows = []
        for c in (int(x) for x in ns.concurrency.split(",")):
            n = max(4, ns.prompts_per_concurrency * c)
            workload = make_workload(n, ns.input_len, ns.output_len, model.config.vocab_size, 0, None)
            spec = BenchSpec(ns.input_len, ns.output_len, c, n, seed=0, warmup_prompts=min(c, 8))
            runs: dict[str, list[float]] = {v.name: [] for v in variants}
            for _ in range(ns.repeats):
                for v in variants:
                    runs[v.name].append(run_engine(model, base, spec, v, workload, device, dtype)["output_throughput"])
            for v in variants:
                ratios = [a / b for a, b in zip(runs[v.name], runs["off"])]
                rows.append({"concurrency": c, "variant": v.name, "out_tok_s": statistics.median(runs[v.name]),
                             "vs_off": statistics.median(ratios), "runs": runs[v.name]})
                print(json.dumps(rows[-1]), flush=True)
        rows_bytes = sum(f.stat().st_size for f in Path(tmp).rglob("*.safetensors"))
    print(f"\nmodel: {source}, device {device}, dtype {dtype}, {ns.repeats} interleaved rounds; "
          f"{rows_bytes / 2**20:.1f} MiB of shards written\n")
    print("| C | variant | out tok/s (median) | vs off (median ratio) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['variant']} | {r['out_tok_s']:.1f} | {r['vs_off']:.3f} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
