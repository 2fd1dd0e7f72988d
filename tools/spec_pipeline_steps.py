"""Steps per token of both loop self-speculation schemes on the bundled demo model, from the plain-PyTorch
reference (issue #41, concurrency 1, decode steps only: prefill is the same for all).

    python tools/spec_pipeline_steps.py --threshold 1.0     # fixed depth
    python tools/spec_pipeline_steps.py --threshold 0.5     # the demo model's own exit threshold

For each temperature and draft depth ``d``, the 8 code prompts of ``tools/spec_engine_acceptance.py``,
``--tokens`` tokens each, one sequence at a time:

* **pipeline**: ``speculative_generate(..., scheme="pipeline")`` steps the depth pipeline as an engine
  would (one loop of every row in flight per step) and counts its steps, row-loops (rows summed over
  steps), dropped rows and accepted drafts;
* **draft then verify**: the reference's rounds at ``--k`` drafts, counted in the engine's fixed round
  shape (``(K+1)*d + R-d`` steps and ``(K+1)*R`` row-loops a round, exits never shorten it:
  ``loopline/core/speculation.py``);
* **plain**: one step per loop of every token, its exit depth (of the pipeline's own tokens; greedy
  outputs are identical in all three).

A step is one read of the weights; on a memory-bound GPU its cost grows far less than its rows, on a
CPU about in proportion to them (compare row-loops there). Not a timed run: the reference runs each row
on its own, so its wall time says nothing about an engine's.
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch

from loopline.models.loader import load_model, load_tokenizer
from loopline.models.tiny import default_checkpoint
from loopline.spec import SpeculativeConfig
from loopline.spec.reference import speculative_generate

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Foo:\n    def __init__(self",
           "for i in range(10):\n    print(", "# Copyright", "def add(a, b):\n    return", "import numpy as np\n",
           "while True:\n    x =", "with open(path) as f:\n"]


def measure(model, prompts: list[list[int]], tokens: int, d: int, k: int, temperature: float,
            threshold: float) -> dict:
    """Sums over the prompts: decode tokens, plain steps, both schemes' steps and row-loops."""
    loops = model.config.total_ut_steps
    pipe = SpeculativeConfig(scheme="pipeline", draft_loops=d)
    verify = SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=k, draft_loops=d)
    sums, rows = Counter(), Counter()
    for seed, prompt in enumerate(prompts):
        out = speculative_generate(model, prompt, tokens, pipe, temperature=temperature, seed=seed,
                                   exit_threshold=threshold)
        dv = speculative_generate(model, prompt, tokens, verify, temperature=temperature, seed=seed,
                                  exit_threshold=threshold)
        sums.update(tokens=len(out.tokens) - 1, plain=sum(out.exit_loops[1:]), steps=out.steps, row_loops=out.row_loops,
                    dropped=out.dropped, drafted=sum(out.drafted), accepted=sum(a and b for a, b in
                                                                             zip(out.drafted, out.matches)),
                    dv_tokens=len(dv.tokens) - 1, dv_steps=len(dv.drafts) * ((k + 1) * d + loops - d), dv_rounds=len(dv.drafts),
                    dv_drafts=sum(dv.drafts), dv_accepted=sum(dv.accepted))
        rows.update(out.rows)
    return {"sums": dict(sums), "rows": dict(sorted(rows.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threshold", type=float, default=1.0, help="exit_threshold of every sequence")
    ap.add_argument("--k", type=int, default=3, help="draft-then-verify's num_speculative_tokens")
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--tokens", type=int, default=64)
    ns = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_model(default_checkpoint(), dtype=torch.float32).eval()
    tok = load_tokenizer(default_checkpoint())
    prompts = [tok.encode(t) for t in PROMPTS]
    print(f"threshold {ns.threshold}, {len(prompts)} prompts x {ns.tokens} tokens, draft-then-verify K={ns.k}")
    print("| T | d | plain steps/token | draft-verify steps/token (row-loops/token, acceptance) | pipeline steps/token "
          "| pipeline row-loops/token | pipeline acceptance | dropped rows/token | pipeline steps by rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    for temp in ns.temperatures:
        for d in ns.draft_loops:
            r = measure(model, prompts, ns.tokens, d, ns.k, temp, ns.threshold)
            s, n = r["sums"], r["sums"]["tokens"]
            dv_acc = s["dv_accepted"] / s["dv_drafts"] if s["dv_drafts"] else float("nan")
            acc = s["accepted"] / s["drafted"] if s["drafted"] else float("nan")
            dv_rows = s["dv_rounds"] * (ns.k + 1) * model.config.total_ut_steps / s["dv_tokens"]
            print(f"| {temp:g} | {d} | {s['plain'] / n:.2f} | {s['dv_steps'] / s['dv_tokens']:.2f} ({dv_rows:.2f}, "
                  f"{dv_acc:.3f}) | {s['steps'] / n:.2f} | {s['row_loops'] / n:.2f} | {acc:.3f} | {s['dropped'] / n:.2f} | "
                  f"{r['rows']} |", flush=True)


if __name__ == "__main__":
    main()
