"""Do batch shapes change sampled tokens? The same seeded requests run all at once, in reverse order and one
at a time; prints how many samples differ from the all-at-once run, and where they first differ.

An RL run resumed from a checkpoint sees its requests arrive in another order, so in other batches: where a
step's numbers depend on its rows (a one-row GEMV against a cuBLAS GEMM, kernel choices by batch size), a
sampled token can flip and the rest of that sample changes (docs/rl.md, section 10, the resume check).

    python tools/batch_shape_tokens.py --device cuda --dtype bfloat16 [--enforce-eager] [--model DIR] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

PROMPTS = ["def f(", "x = [", "import os\n", "class A(", "for i in range(", "print(", "if x ==", "return {"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--copies", type=int, default=8, help="copies of each of the 8 prompts, each its own seed")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (as verl's rollout config sets)")
    ap.add_argument("--out", help="JSON file for the result")
    args = ap.parse_args()

    from loopline import LLM, SamplingParams

    prompts = PROMPTS * args.copies
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=1000 + i) for i in range(len(prompts))]
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager)

    def run(order: list[int]) -> dict[int, list[int]]:
        outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
        return {i: list(o.outputs[0].token_ids) for i, o in zip(order, outs)}

    n = len(prompts)
    together = run(list(range(n)))
    others = {"reverse": run(list(reversed(range(n)))), "alone": {}}
    for i in range(n):
        others["alone"].update(run([i]))
    result = {"device": args.device, "dtype": args.dtype, "enforce_eager": args.enforce_eager, "samples": n,
              "max_tokens": args.max_tokens}
    for name, other in others.items():
        diff = [i for i in range(n) if together[i] != other[i]]
        first = [len(os.path.commonprefix([together[i], other[i]])) for i in diff]
        result[name] = {"differing": len(diff), "first_differing_token": first}
        print(f"{args.device} {args.dtype}: all at once vs {name}: {len(diff)} of {n} samples differ"
              + (f", first at token {first}" if first else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
