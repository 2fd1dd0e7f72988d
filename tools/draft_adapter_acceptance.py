"""Engine acceptance of loop self-speculation with and without a trained draft adapter (#41), from the
engine's counters: the same requests on ``--model`` (a checkpoint directory holding
``draft_adapter.json``, e.g. a copy of the demo model after ``loopline train draft --out COPY``) with
``draft_adapter`` ``"auto"`` and ``"none"``, per temperature and draft depth; outputs are checked equal.

    python tools/draft_adapter_acceptance.py --model COPY [--threshold 1.0] [--tokens 48]
"""
from __future__ import annotations

import argparse

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.loader import load_tokenizer

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Foo:\n    def __init__(self",
           "for i in range(10):\n    print(", "# Copyright", "def add(a, b):\n    return", "import numpy as np\n",
           "while True:\n    x =", "with open(path) as f:\n"]


def run(model: str, prompts: list[list[int]], params: SamplingParams, speculative: dict) -> tuple[LLMEngine, dict]:
    eng = LLMEngine(EngineArgs(model=model, device="cpu", dtype="float32", max_num_seqs=len(prompts),
                               speculative_config=speculative))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params.clone(seed=i))
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return eng, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory with draft_adapter.json beside its weights")
    ap.add_argument("--threshold", type=float, default=1.0, help="exit_threshold of every request (1.0: fixed depth)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--tokens", type=int, default=48)
    ns = ap.parse_args()
    tok = load_tokenizer(ns.model)
    prompts = [tok.encode(t) for t in PROMPTS]
    print("| T | d | drafts | acceptance (per position) | mean acceptance length | outputs equal |")
    print("|---|---|---|---|---|---|")
    for temp in ns.temperatures:
        params = SamplingParams(max_tokens=ns.tokens, temperature=temp, ignore_eos=True, exit_threshold=ns.threshold)
        for d in ns.draft_loops:
            runs = {}
            for setting in ("none", "auto"):
                spec = {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": ns.k, "draft_loops": d,
                        "adaptive": False, "disable_by_batch_size": None, "draft_adapter": setting}
                runs[setting] = run(ns.model, prompts, params, spec)
            assert runs["auto"][0].draft_adapter is not None, f"{ns.model} has no adapter for draft_loops={d}"
            equal = runs["auto"][1] == runs["none"][1]
            for setting, label in (("none", "plain coda"), ("auto", "adapter")):
                st = runs[setting][0].stats
                per = ", ".join(f"{n / st.spec_num_drafts:.2f}" for n in st.spec_accepted_per_pos)
                print(f"| {temp:g} | {d} | {label} | {st.spec_num_accepted_tokens / st.spec_num_draft_tokens:.3f} "
                      f"({per}) | {st.spec_mean_acceptance_length:.2f} | {equal} |", flush=True)


if __name__ == "__main__":
    main()
