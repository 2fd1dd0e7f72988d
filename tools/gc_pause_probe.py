"""Collector pauses in an engine's step loop, with and without the startup heap frozen (CPU, tiny model).

    python tools/gc_pause_probe.py --rows 128 --steps 256 [--frozen]

Builds the tiny Ouro model's engine on the CPU, decodes ``--rows`` requests and times every garbage
collection during ``--steps`` steps (``gc.callbacks``); ``--frozen`` runs them inside
``loopline.runtime.heap.frozen_heap`` as ``loopline bench`` and the engine process do.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import tiny_config
from loopline.runtime.heap import frozen_heap
from loopline.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--frozen", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    engine = LLMEngine(EngineArgs(device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_seqs=a.rows,
                                  max_model_len=512), model=OuroForCausalLM(tiny_config()))
    params = SamplingParams(max_tokens=a.steps, temperature=0.0, ignore_eos=True)
    for i in range(a.rows):
        engine.add_request(f"r{i}", [3 + (i * 7 + j) % 50 for j in range(64)], params)
    while any(r.status.value != "decode" for r in engine.scheduler.requests.values()):
        engine.step()
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    with frozen_heap() if a.frozen else contextlib.nullcontext():
        gc.callbacks.append(timed)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        step_ms = (time.perf_counter() - t0) / a.steps * 1e3
        gc.callbacks.remove(timed)
    total = sum(p for _, p in pauses)
    print(f"rows {a.rows} frozen={a.frozen}: {step_ms:.2f} ms a step; {len(pauses)} collections "
          f"({sum(1 for g, _ in pauses if g == 2)} of the oldest generation), {total:.1f} ms in all, longest "
          f"{max((p for _, p in pauses), default=0.0):.1f} ms")


if __name__ == "__main__":
    main()
