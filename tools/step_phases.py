"""Where the host's time goes in each engine step of a `loopline bench` run (GPU diagnosis).

    python3 tools/step_phases.py --config ouro-1.4b --dtype bfloat16 --input-len 128 --output-len 512 \
        --concurrency 128 --depth-dist mean2.5 --variants refill,fixed --repeats 1 --no-progress

Takes `loopline bench`'s arguments and runs it with timers around the public methods of the engine's
phases: scheduling (``Scheduler.schedule``); the launch (``ModelRunner.launch``), split into the step's
inputs (``StepBuilder.fill``), the one forward run eagerly (``StepForward.__call__``) or replayed from a
captured graph (``StepGraph.replay``), and coda + sampling (``ModelRunner.sample``, with the
``Sampler`` call in it); the read of a step's results (``StepHandle.get``, with the wait for the
device: ``Event.synchronize`` of the readback); the scheduler's update (``Scheduler.update``); booking
tokens (``OutputProcessor.on_token``, ``add_prompt_logprobs``, ``on_finished``); collecting the step's
output deltas (``OutputProcessor.collect``) and building outputs from them (``OutputBuilder.build``).
Each phase is part of ``step (all)``, an indented one part of the phase above it.

Per measured run it prints each phase's host milliseconds per step and, on CUDA, the device time per
step of steps with decode rows only and of steps with prefill rows (CUDA events around each launch).
In the overlapped loop the device is the bottleneck exactly when the host spends a good part of each
step waiting; a run whose wait is near zero is host-bound, and the other phases say where the host's
time goes.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict
from functools import wraps

import torch

from loopline.bench import offline
from loopline.core.scheduler import Scheduler
from loopline.engine.deltas import OutputBuilder
from loopline.engine.llm_engine import LLMEngine
from loopline.engine.output_processor import OutputProcessor
from loopline.worker.cuda_graphs import StepGraph
from loopline.worker.forward import StepForward
from loopline.worker.model_runner import ModelRunner, StepHandle
from loopline.worker.sampler import Sampler
from loopline.worker.step_inputs import StepBuilder

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


SPANS: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []  # (step kind, rows, start, end)
LAUNCH_HOST: dict[str, list[float]] = defaultdict(list)  # step kind -> host seconds of each launch
# STEP_PHASES_CPROFILE=1: cProfile of the launches of steps with prefill rows (printed after the run)
PREFILL_PROFILE = cProfile.Profile() if os.environ.get("STEP_PHASES_CPROFILE") else None
_launch = ModelRunner.launch


def launch_with_events(self, sched, *args, **kwargs):
    """CUDA events around each launch: in a device-bound overlapped run the span between them is the
    step's device time (its kernels run between the previous step's end and its own last kernel)."""
    if self.device.type != "cuda" or not sched.rows:
        return _launch(self, sched, *args, **kwargs)
    kind = "with prefill rows" if any(r.is_prefill for r in sched.rows) else "decode rows only"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prof = PREFILL_PROFILE if kind == "with prefill rows" else None
    t0 = time.perf_counter()
    start.record()
    if prof is not None:
        prof.enable()
    handle = _launch(self, sched, *args, **kwargs)
    if prof is not None:
        prof.disable()
    end.record()
    LAUNCH_HOST[kind].append(time.perf_counter() - t0)
    SPANS.append((kind, len(sched.rows), start, end))
    return handle


ModelRunner.launch = launch_with_events

# (class, public method, phase); an indented phase is part of the one above it
PHASES = [
    (LLMEngine, "step", "step (all)"), (LLMEngine, "step_deltas", "step (all)"),
    (Scheduler, "schedule", "schedule"),
    (ModelRunner, "launch", "launch"),
    (StepBuilder, "fill", "  step inputs"),
    (StepForward, "__call__", "  eager forward"), (StepGraph, "replay", "  graph replay"),
    (ModelRunner, "sample", "  coda + sampling"), (Sampler, "__call__", "    sampler"),
    (StepHandle, "get", "read (all)"), (torch.cuda.Event, "synchronize", "  wait for the device"),
    (Scheduler, "update", "scheduler update"),
    (OutputProcessor, "on_token", "book tokens"), (OutputProcessor, "add_prompt_logprobs", "book tokens"),
    (OutputProcessor, "on_finished", "book tokens"),
    (OutputProcessor, "collect", "collect outputs"), (OutputBuilder, "build", "build outputs"),
]
for owner, name, label in PHASES:
    timed(owner, name, label)

_drive = offline.drive_closed_loop


def drive(engine, workload, params, concurrency, tag="run", **kw):
    TIMES.clear()
    COUNTS.clear()
    SPANS.clear()
    LAUNCH_HOST.clear()
    global PREFILL_PROFILE
    if PREFILL_PROFILE is not None:  # this run's launches only
        PREFILL_PROFILE = cProfile.Profile()
    t0 = time.perf_counter()
    out = _drive(engine, workload, params, concurrency, tag=tag, **kw)
    wall = time.perf_counter() - t0
    if tag == "run":
        steps = COUNTS["step (all)"] or 1
        print(f"\n[{engine.config.args.scheduling_mode} {engine.config.args.exit_mode}] {steps} steps, {wall:.2f} s wall, {wall / steps * 1e3:.3f} ms/step")
        for label in dict.fromkeys(label for *_, label in PHASES):  # in the table's order: parts under their phase
            if label in TIMES:
                t = TIMES[label]
                print(f"  {label:26s} {t / steps * 1e3:8.3f} ms/step  ({COUNTS[label]} calls, {t:.2f} s)")
        if SPANS:  # device time per kind of step (CUDA only)
            torch.cuda.synchronize()
            for kind in sorted({k for k, *_ in SPANS}):
                spans = [(rows, a.elapsed_time(b)) for k, rows, a, b in SPANS if k == kind]
                ms = sum(t for _, t in spans)
                host = LAUNCH_HOST[kind]
                print(f"  device, {kind:17s} {len(spans):6d} steps  {ms / len(spans):8.3f} ms/step  "
                      f"{sum(r for r, _ in spans) / len(spans):6.1f} rows/step  ({ms / 1e3:.2f} s); host launch "
                      f"{sum(host) / len(host) * 1e3:.3f} ms/step")
        if PREFILL_PROFILE is not None and LAUNCH_HOST:
            print("\nlaunches of steps with prefill rows, by cumulative time:")
            pstats.Stats(PREFILL_PROFILE, stream=sys.stdout).sort_stats("cumulative").print_stats(45)
        sys.stdout.flush()
    return out


offline.drive_closed_loop = drive

if __name__ == "__main__":
    from loopline.entrypoints.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
