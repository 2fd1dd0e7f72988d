"""What constrained decoding (structured outputs) costs per step, side by side with unconstrained decoding.

python3 tools/structured_cost.py [--config ouro-1.4b] [--concurrency 1,32] [--input-len 1024] [--output-len 128]
                                 [--rounds 2] [--out F]

Same engine, same random prompts, greedy, ``ignore_eos``, exactly ``--output-len`` tokens; variant ``free`` has
no constraint, ``regex`` constrains every request to ``--regex`` (default: lowercase words, which never ends
the grammar before ``max_tokens``), ``mixed`` constrains half of the requests (the unconstrained half must not
pay for the other). Variants alternate for ``--rounds`` rounds (A B C A B C) on one engine per concurrency
and the median of each is reported with its ratio to ``free``.

The model is random weights of ``--config`` shapes; the grammar engine needs a tokenizer, so the bundled demo
model's (or ``--tokenizer DIR``) is used with the model's vocabulary size: ids past the tokenizer's are never
allowed. The mask work of a grammar grows with the tokenizer's vocabulary, so a 49k-token tokenizer costs
more host time per row than the demo's: say which tokenizer a recorded figure used.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import torch

from loopline.bench.metrics import latency_metrics
from loopline.bench.offline import build_model, drive_closed_loop
from loopline.bench.workload import make_workload
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.tiny import default_checkpoint
from loopline.sampling_params import SamplingParams, StructuredOutputsParams

VARIANTS = ("free", "regex", "mixed")


def params_for(variant: str, n: int, output_len: int, regex: str) -> list[SamplingParams]:
    """Greedy, exactly ``output_len`` tokens; the variant decides which requests carry the constraint."""
    def one(i: int) -> SamplingParams:
        constrained = variant == "regex" or (variant == "mixed" and i % 2 == 0)
        so = StructuredOutputsParams(regex=regex) if constrained else None
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=so)
    return [one(i) for i in range(n)]


def measure(engine: LLMEngine, workload, params: list[SamplingParams], concurrency: int, tag: str) -> dict:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    before = engine.stats.steps
    t0 = time.perf_counter()
    timings, _ = drive_closed_loop(engine, workload, params, concurrency, tag=tag)
    duration = time.perf_counter() - t0
    record = latency_metrics(timings, duration, workload.input_tokens)
    record["steps"] = engine.stats.steps - before
    record["outputs"] = [t.num_tokens for t in timings]
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="ouro-1.4b")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the bundled demo model's)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--regex", default="[a-z]+( [a-z]+)*")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ns = ap.parse_args(argv)

    tokenizer = ns.tokenizer or str(default_checkpoint())
    base = EngineArgs(tokenizer=tokenizer, dtype=ns.dtype, device=ns.device, disable_log_stats=True)
    model, device, dtype, source = build_model(base, ns.config, seed=0)
    record: dict = {"command": " ".join(["python3", "tools/structured_cost.py", *(argv or sys.argv[1:])]),
                    "model": source, "tokenizer": tokenizer, "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "regex": ns.regex, "runs": {}}
    for c in (int(x) for x in ns.concurrency.split(",")):
        args = dataclasses.replace(base, dtype=str(dtype).removeprefix("torch."), max_num_seqs=c)
        engine = LLMEngine(args, model=model)
        n = 2 * c
        workload = make_workload(n, ns.input_len, ns.output_len, model.config.vocab_size, seed=c)
        warm = workload.head(min(n, c), 8)
        for v in VARIANTS:  # compiles the grammar, captures graphs, fills caches
            drive_closed_loop(engine, warm, params_for(v, warm.num_prompts, 8, ns.regex), c, tag=f"warm-{v}")
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(ns.rounds):
            for v in VARIANTS:
                rec = measure(engine, workload, params_for(v, n, ns.output_len, ns.regex), c, tag=f"{v}-{r}")
                runs[v].append(rec)
                print(f"C={c} {v:5s} round {r}: {rec['output_throughput']:.1f} tok/s, {rec['steps']} steps",
                      flush=True)
        summary = {}
        free = statistics.median(x["output_throughput"] for x in runs["free"])
        for v in VARIANTS:
            tput = statistics.median(x["output_throughput"] for x in runs[v])
            tpot = statistics.median(x["tpot_ms"]["p50"] for x in runs[v])
            summary[v] = {"output_throughput": tput, "ratio_to_free": tput / free, "median_tpot_ms": tpot,
                          "all_outputs_full": all(o == ns.output_len for x in runs[v] for o in x["outputs"])}
        record["runs"][str(c)] = {"summary": summary, "rounds": runs}
        print(json.dumps({"concurrency": c, **summary}), flush=True)
        del engine
        gc.collect()  # its KV pool and graphs go before the next engine sizes its pool from free memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
