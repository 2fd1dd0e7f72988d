"""Huginn at fixed iterations: the prelude and the coda only where a row needs them, against every stage for
every row (the path before issue #46's skip), in one process on the CPU.

Builds a random Huginn checkpoint (default: hidden 1024, 2 + 4 + 2 layers, fp32, so each layer's weights are a
sizeable read, as on a GPU), runs the same requests through the engine with the skip and with it switched off
(every row a candidate for both stages: ``HuginnStack.plan`` told every row needs them), alternating, and
prints per run: engine steps, the median step time, the rows that ran the prelude / the coda out of the
tokens planned (``HuginnStack.stage_rows``), and the median ratio of the two settings' step times.

    python tools/huginn_skip_cpu.py --concurrency 1,8 --loops 8 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from loopline.config import EngineArgs
from loopline.engine.llm_engine import LLMEngine
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.sampling_params import SamplingParams
from loopline.worker.loop_stack import CODA, PRELUDE


def every_stage(stack) -> None:
    """Switches the skip off: each step plans both stages for all its rows (no gather, no variant)."""
    plan = stack.plan

    def planned(p):
        plan(p)
        p.features = p.features | {PRELUDE, CODA}
        dec, chunks = p.kinds
        all_rows = (np.arange(dec.num_rows), np.arange(chunks.num_rows))
        stack._need = (all_rows, all_rows)
        tokens = sum(part.num_tokens for part in p.kinds)
        stack.stage_rows.update({"prelude_all": tokens, "coda_all": tokens})

    stack.plan = planned


def run(path: Path, concurrency: int, loops: int, input_len: int, output_len: int, skip: bool) -> dict:
    eng = LLMEngine(EngineArgs(model=str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                               max_num_seqs=concurrency, max_num_loops=loops, max_num_batched_tokens=256))
    stack = eng.runner.stack
    if not skip:
        every_stage(stack)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, max_loops=loops)
    for i in range(concurrency):
        eng.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + 3 * j) % 500 + 1 for j in range(input_len)]}, params)
    times, tokens = [], []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        for out in eng.step():
            if out.finished:
                tokens.append(out.outputs[0].token_ids)
        times.append(time.perf_counter() - t)
    rows = stack.stage_rows
    prelude = rows["prelude"] if skip else rows["prelude_all"]
    coda = rows["coda"] if skip else rows["coda_all"]
    return {"steps": len(times), "median_ms": 1e3 * statistics.median(times), "total_s": sum(times),
            "tokens": rows["tokens"], "prelude": prelude, "coda": coda, "output": sorted(tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    path = make_tiny_huginn_checkpoint(Path(tempfile.mkdtemp()) / "huginn", seed=0, hidden_size=args.hidden,
                                       num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                                       intermediate_size=args.hidden * 11 // 4, vocab_size=8192, padded_vocab_size=8192,
                                       mean_recurrence=args.loops, torch_dtype="float32")
    run(path, 1, args.loops, args.input_len, 2, skip=True)  # (warm-up: first-call costs, discarded)
    for c in (int(x) for x in args.concurrency.split(",")):
        ratios = []
        for rep in range(args.repeats):
            on = run(path, c, args.loops, args.input_len, args.output_len, skip=True)
            off = run(path, c, args.loops, args.input_len, args.output_len, skip=False)
            assert on["output"] == off["output"], "the skip changed the tokens"
            ratios.append(off["median_ms"] / on["median_ms"])
            for name, r in (("skip", on), ("every stage", off)):
                print(f"C={c} rep {rep} {name:>11}: {r['steps']} steps, median step {r['median_ms']:.1f} ms, "
                      f"total {r['total_s']:.2f} s; prelude rows {r['prelude']}/{r['tokens']}, "
                      f"coda rows {r['coda']}/{r['tokens']}")
        print(f"C={c}: median step time, every stage / skip: {statistics.median(ratios):.2f}x "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
