"""Acceptance of loop self-speculation in the engine (#41) on the bundled demo model, from its counters.

For each temperature and draft depth: 8 short code prompts, one request at a time, the engine with
``speculative_config`` and without; prints acceptance, acceptance per round position, mean acceptance
length and engine steps (each one read of the weights) of both. CPU by default.

    python tools/spec_engine_acceptance.py --threshold 0.5      # the demo model's own exit threshold
    python tools/spec_engine_acceptance.py --threshold 1.0      # fixed depth
"""
from __future__ import annotations

import argparse

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.loader import load_tokenizer
from loopline.models.tiny import default_checkpoint

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Foo:\n    def __init__(self",
           "for i in range(10):\n    print(", "# Copyright", "def add(a, b):\n    return", "import numpy as np\n",
           "while True:\n    x =", "with open(path) as f:\n"]


def run(prompts: list[list[int]], params: SamplingParams, device: str, speculative: dict | None) -> LLMEngine:
    eng = LLMEngine(EngineArgs(device=device, dtype="float32", max_num_seqs=1, speculative_config=speculative))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params.clone(seed=i))
    while eng.has_unfinished_requests():
        eng.step()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threshold", type=float, default=0.5, help="exit_threshold of every request")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ns = ap.parse_args()
    tok = load_tokenizer(default_checkpoint())
    prompts = [tok.encode(t) for t in PROMPTS]
    print("| T | d | acceptance | per position | mean acceptance length | steps (plain) |")
    print("|---|---|---|---|---|---|")
    for temp in ns.temperatures:
        params = SamplingParams(max_tokens=ns.tokens, temperature=temp, ignore_eos=True, exit_threshold=ns.threshold)
        plain = run(prompts, params, ns.device, None).stats.steps
        for d in ns.draft_loops:
            spec = {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": ns.k, "draft_loops": d,
                    "adaptive": False, "disable_by_batch_size": None}
            st = run(prompts, params, ns.device, spec).stats
            per = ", ".join(f"{n / st.spec_num_drafts:.2f}" for n in st.spec_accepted_per_pos)
            print(f"| {temp:g} | {d} | {st.spec_num_accepted_tokens / st.spec_num_draft_tokens:.3f} | {per} | "
                  f"{st.spec_mean_acceptance_length:.2f} | {st.steps} ({plain}) |", flush=True)


if __name__ == "__main__":
    main()
