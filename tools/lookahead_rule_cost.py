"""What the lookahead head costs an engine step (docs/lookahead.md, 'In the engine').

An engine on a model directory with a lookahead head evaluates the head in steps with a lookahead row
(before 2026-12-04's d6d6691: in every step, whatever the rows' exit policies). This tool runs the same greedy stock-gate requests on two
engines -- ``MODEL`` (the bundled demo model by default) without a head and ``--with-head DIR`` (the same
weights beside a head) -- one step each in turn, so the load of a shared machine hits both alike, and
reports the median step time of each at the same rows (the outputs are checked equal: the head changes
no stock-gate row) and the median over steps of the per-step ratio to the engine without a head (both run
the same steps, so step i of one pairs with step i of the other: the least noisy figure on a shared host). A third engine, when ``--lookahead-threshold`` is given, runs the same requests with
``exit_mode="lookahead"`` (its depths differ, so only its own median is reported).

    python tools/lookahead_rule_cost.py --with-head DIR [--concurrency 1,8] [--tokens 64]

``--replay DIST`` (e.g. ``2:0.55,3:0.3,4:0.15``) measures the lookahead policy's use of the depths it knows
ahead instead: every request replays one seeded per-token depth trace, on three engines with the head --
the stock exit path at those depths (``exit_mode="trace"``), the lookahead policy replaying them
(``ReplayPredictor``: its coda and sampling run for the rows that may exit), and the same with the plan
knowing nothing (every row runs the coda, as before the plan) -- so their steps pair one to one.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from loopline import SamplingParams
from loopline.bench.workload import parse_depth_dist
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.tiny import default_checkpoint
from loopline.worker.lookahead_rule import ReplayPredictor


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, dtype="float32", device="cpu", skip_tokenizer_init=True,
                                disable_log_stats=True, **kw))


def _add(eng: LLMEngine, concurrency: int, tokens: int, params: SamplingParams | Callable[[int], SamplingParams]) -> None:
    rng = np.random.default_rng(0)
    for i in range(concurrency):
        eng.add_request(str(i), {"prompt_token_ids": rng.integers(5, 4000, 32).tolist()},
                        params(i) if callable(params) else params)


def measure(engines: dict[str, tuple[LLMEngine, Any]], concurrency: int, tokens: int) -> dict:
    """Steps every engine in turn until all finish; per engine the median step time (ms) and its outputs."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, dict] = {name: {} for name in engines}
    for eng, params in engines.values():
        _add(eng, concurrency, tokens, params)
    order = list(engines.items())
    while any(eng.has_unfinished_requests() for eng, _ in engines.values()):
        order.reverse()  # (each engine steps first every other round: no order bias)
        for name, (eng, _) in order:
            if eng.has_unfinished_requests():
                t0 = time.perf_counter()
                for out in eng.step():
                    if out.finished:
                        outputs[name][out.request_id] = (out.outputs[0].token_ids, out.outputs[0].exit_depths)
                times[name].append(time.perf_counter() - t0)
    base = next(iter(times.values()))
    return {name: {"median_step_ms": 1e3 * statistics.median(t), "steps": len(t),
                   "mean_loops": float(np.mean([d for _, ds in outputs[name].values() for d in ds])),
                   "paired_ratio_median": (statistics.median(a / b for a, b in zip(t, base))
                                           if len(t) == len(base) else None),
                   "outputs": outputs[name]} for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_checkpoint()), help="the weights without a head")
    p.add_argument("--with-head", required=True, help="the same weights beside lookahead.json / lookahead.safetensors")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--exit-threshold", type=float, default=0.5)
    p.add_argument("--lookahead-threshold", type=float, default=None)
    p.add_argument("--replay", default=None, metavar="DIST", help="per-token depths to replay (module docstring)")
    ns = p.parse_args()
    torch.set_num_threads(1)
    if ns.replay is not None:
        return replay(ns)
    gate = SamplingParams(temperature=0.0, max_tokens=ns.tokens, ignore_eos=True, exit_threshold=ns.exit_threshold)
    for c in (int(x) for x in ns.concurrency.split(",")):
        engines = {"stock, no head": (_engine(ns.model), gate), "stock, head loaded": (_engine(ns.with_head), gate)}
        if ns.lookahead_threshold is not None:
            la = SamplingParams(temperature=0.0, max_tokens=ns.tokens, ignore_eos=True, exit_mode="lookahead",
                                lookahead_threshold=ns.lookahead_threshold)
            engines["lookahead"] = (_engine(ns.with_head), la)
        r = measure(engines, c, ns.tokens)
        assert r["stock, no head"]["outputs"] == r["stock, head loaded"]["outputs"], "the head changed a stock row"
        base = r["stock, no head"]["median_step_ms"]
        print(json.dumps({"concurrency": c, **{name: {k: round(v, 3) if isinstance(v, float) else v
                                                      for k, v in x.items() if k != "outputs"}
                                               | {"vs_no_head": round(x["median_step_ms"] / base, 3)}
                                               for name, x in r.items()}}))


def replay(ns: argparse.Namespace) -> None:
    """The ``--replay`` comparison: stock path, lookahead with its plan, lookahead with every row in the coda."""
    dist = parse_depth_dist(ns.replay, 4)
    base = {"temperature": 0.0, "max_tokens": ns.tokens, "ignore_eos": True}
    for c in (int(x) for x in ns.concurrency.split(",")):
        rng = random.Random(0)
        traces = [dist.sample(rng, ns.tokens) for _ in range(c)]
        engines = {"stock path (trace)": (_engine(ns.with_head, exit_mode="trace"),
                                          lambda i, traces=traces: SamplingParams(exit_depths=traces[i], **base))}
        for name, knows in (("lookahead, plan", True), ("lookahead, every row in the coda", False)):
            eng = _engine(ns.with_head)
            runner = eng.runner
            runner.lookahead_rule.predictor = ReplayPredictor(runner.max_num_seqs + 1, runner.decode_state.max_tokens,
                                                              runner.device, cost_of=runner.lookahead_rule.predictor)
            runner.lookahead_plan.counts_runs = knows
            engines[name] = (eng, lambda i, traces=traces: SamplingParams(exit_mode="lookahead", exit_depths=traces[i],
                                                                          **base))
        r = measure(engines, c, ns.tokens)
        outs = [x["outputs"] for x in r.values()]
        assert all(o == outs[0] for o in outs), "replayed depths gave different outputs"
        plan = engines["lookahead, plan"][0].runner.lookahead_plan
        print(json.dumps({"concurrency": c, "replay": ns.replay, "coda_rows_per_decode_row":
                          round(plan.coda_rows / max(plan.decode_rows, 1), 3),
                          **{name: {k: round(v, 3) if isinstance(v, float) else v for k, v in x.items() if k != "outputs"}
                             for name, x in r.items()}}))


if __name__ == "__main__":
    main()
