"""Batch-1 generation speed of a random-weight model of the demo run's shape, through ``loopline.LLM`` on the CPU.

    PYTHONPATH=. python tools/demo_model_speed.py [--threads 2] [--tokens 128] [--reps 5]

Prints the parameter count, the fp32 weight size and tokens/s per repetition (fixed depth: every token runs all
``total_ut_steps`` loops, the slowest case). docs/training.md records a run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from loopline import LLM, SamplingParams
    from loopline.models.tiny import make_tiny_checkpoint
    from loopline.train.trainer import TrainConfig

    shape = TrainConfig().model
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp), seed=0, **{f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)})
        weight_mb = (path / "model.safetensors").stat().st_size / 1e6
        llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_gb=0.25, disable_log_stats=True)
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
        llm.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        rates = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = llm.generate(["def main():"], params, use_tqdm=False)[0].outputs[0]
            rates.append(len(out.token_ids) / (time.perf_counter() - t0))
        n_params = sum(p.numel() for p in llm.llm_engine.model.parameters())
    print(json.dumps({"parameters": n_params, "weights_mb_fp32": round(weight_mb, 2), "threads": args.threads,
                      "tokens": args.tokens, "tok_per_s": [round(r, 1) for r in rates],
                      "median_tok_per_s": round(statistics.median(rates), 1)}))


if __name__ == "__main__":
    main()
