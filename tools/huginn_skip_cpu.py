"""Huginn at fixed iterations: the prelude and the coda only where a row needs them, against every stage for
every row (the path before issue #46's skip), in one process on the CPU.

Builds a random Huginn checkpoint (default: hidden 1024, 2 + 4 + 2 layers, fp32, so each layer's weights are a
sizeable read, as on a GPU), runs the same requests through two engines in one process, one with the skip
and one with it switched off (every row a candidate for both stages: ``HuginnStack.plan`` told every row
needs them), stepping in turn, and prints the rows that ran the prelude / the coda out of the tokens
planned (``HuginnStack.stage_rows``), each run's median step times and the median over steps of the
paired time ratio (robust to a shared CPU's load, which moves both engines of a pair alike).
``--stagger N`` lets request i arrive at step i * N, so the rows' phases differ (else they decode in step).

    python tools/huginn_skip_cpu.py --concurrency 1,8 --loops 8 --repeats 5 --output-len 8
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


def paired(path: Path, concurrency: int, loops: int, input_len: int, output_len: int, stagger: int) -> dict:
    """Two engines on the same requests, one with the skip and one without, stepping in turn (which one
    steps first alternates): their steps pair one to one (the schedule depends neither on the skip nor on the
    tokens), so each pair's time ratio is taken under the same load."""
    engines = {}
    for skip in (True, False):
        eng = LLMEngine(EngineArgs(model=str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                                   max_num_seqs=concurrency, max_num_loops=loops, max_num_batched_tokens=256))
        if not skip:
            every_stage(eng.runner.stack)
        engines[skip] = eng
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, max_loops=loops)
    pending = [(i * stagger, f"r{i}", [(7 * i + 3 * j) % 500 + 1 for j in range(input_len)]) for i in range(concurrency)]
    times: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list] = {True: [], False: []}
    step = 0
    while pending or engines[True].has_unfinished_requests():
        while pending and pending[0][0] <= step:  # request i arrives at step i * stagger
            _, rid, prompt = pending.pop(0)
            for eng in engines.values():
                eng.add_request(rid, {"prompt_token_ids": prompt}, params)
        for skip in ((True, False) if step % 2 == 0 else (False, True)):
            t = time.perf_counter()
            outs = engines[skip].step()
            times[skip].append(time.perf_counter() - t)
            tokens[skip] += [(o.request_id, tuple(o.outputs[0].token_ids)) for o in outs if o.finished]
        step += 1
    # the schedule does not depend on the tokens (ignore_eos, fixed depth): the steps pair even where the tokens
    # differ. NOTE: they may, here: a random model this wide amplifies fp32 rounding (its plain path in fp32
    # and in fp64 disagree from the first token), and a gathered stage rounds differently from a full one;
    # the tests hold the skip to the plain path on the tiny model
    assert len(times[True]) == len(times[False]) and not engines[False].has_unfinished_requests()
    same = len(set(tokens[True]) & set(tokens[False]))
    rows = engines[True].runner.stack.stage_rows
    ratios = [off / on for on, off in zip(times[True], times[False])]
    return {"steps": step, "ratio": statistics.median(ratios), "on_ms": 1e3 * statistics.median(times[True]),
            "off_ms": 1e3 * statistics.median(times[False]), "tokens": rows["tokens"], "prelude": rows["prelude"],
            "coda": rows["coda"], "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--stagger", type=int, default=0, help="steps between two requests' arrivals (0: all at once)")
    args = ap.parse_args()
    path = make_tiny_huginn_checkpoint(Path(tempfile.mkdtemp()) / "huginn", seed=0, hidden_size=args.hidden,
                                       num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                                       intermediate_size=args.hidden * 11 // 4, vocab_size=8192, padded_vocab_size=8192,
                                       mean_recurrence=args.loops, torch_dtype="float32")
    paired(path, 1, args.loops, args.input_len, 2, 0)  # (warm-up: first-call costs, discarded)
    for c in (int(x) for x in args.concurrency.split(",")):
        runs = [paired(path, c, args.loops, args.input_len, args.output_len, args.stagger) for _ in range(args.repeats)]
        r = runs[0]
        print(f"C={c} stagger={args.stagger}: {r['steps']} steps; rows that ran the prelude {r['prelude']}/{r['tokens']}, "
              f"the coda {r['coda']}/{r['tokens']} (every stage: {r['tokens']}/{r['tokens']} each)")
        for i, r in enumerate(runs):
            print(f"  run {i}: median step {r['on_ms']:.1f} ms with the skip, {r['off_ms']:.1f} ms every stage; "
                  f"median paired ratio every stage / skip {r['ratio']:.2f}; equal outputs {r['same']}/{c}")
        print(f"C={c}: median of the runs' paired ratios {statistics.median(r['ratio'] for r in runs):.2f}x")


if __name__ == "__main__":
    main()
