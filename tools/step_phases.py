"""Where the host's time goes in each engine step of a `loopline bench` run (GPU diagnosis).

    python3 tools/step_phases.py --config ouro-1.4b --dtype bfloat16 --input-len 128 --output-len 512 \
        --concurrency 128 --depth-dist mean2.5 --variants refill,fixed --repeats 1 --no-progress

Takes `loopline bench`'s arguments and runs it with timers around the engine's phases: scheduling,
the launch (split into decode-graph, mixed-graph and eager traversals plus sampling), the wait for
the device's results (``Event.synchronize`` of the readback), reading them back, and booking them.
Per measured run it prints each phase's host milliseconds per step. In the overlapped loop the
device is the bottleneck exactly when the host spends a good part of each step waiting; a run whose
wait is near zero is host-bound, and the other phases say where the host's time goes.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from functools import wraps

import torch

from loopline.bench import offline
from loopline.core.scheduler import Scheduler
from loopline.engine.llm_engine import LLMEngine
from loopline.worker.model_runner import ModelRunner

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t0
            COUNTS[label] += 1

    setattr(owner, name, wrapper)


for owner, name, label in [
    (LLMEngine, "step", "step (all)"), (Scheduler, "schedule", "schedule"), (ModelRunner, "launch", "launch"),
    (ModelRunner, "_run_eager", "  eager traversal"), (ModelRunner, "_run_mixed", "  mixed-graph traversal"),
    (ModelRunner, "_sample", "  coda + sampling"), (ModelRunner, "_decode_host_rows", "  decode host rows"),
    (LLMEngine, "_read", "read (all)"), (torch.cuda.Event, "synchronize", "  wait for the device"),
    (ModelRunner, "_collect", "  runner readback"), (Scheduler, "update", "  scheduler update"),
    (LLMEngine, "_apply_results", "  book tokens"), (LLMEngine, "_collect", "collect outputs"),
]:
    timed(owner, name, label)

_drive = offline.drive_closed_loop


def drive(engine, workload, params, concurrency, tag="run", **kw):
    TIMES.clear()
    COUNTS.clear()
    t0 = time.perf_counter()
    out = _drive(engine, workload, params, concurrency, tag=tag, **kw)
    wall = time.perf_counter() - t0
    if tag == "run":
        steps = COUNTS["step (all)"] or 1
        print(f"\n[{engine.config.args.scheduling_mode} {engine.config.args.exit_mode}] {steps} steps, {wall:.2f} s wall, {wall / steps * 1e3:.3f} ms/step")
        for label, t in TIMES.items():
            print(f"  {label:26s} {t / steps * 1e3:8.3f} ms/step  ({COUNTS[label]} calls, {t:.2f} s)")
        sys.stdout.flush()
    return out


offline.drive_closed_loop = drive

if __name__ == "__main__":
    from loopline.entrypoints.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
