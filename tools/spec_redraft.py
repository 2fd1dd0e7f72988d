"""Re-drafting in the depth pipeline: steps per token on the bundled demo model, off and on (CPU, the reference).

    python tools/spec_redraft.py [--tokens 128] [--threshold 1.0] [--draft-loops 1]

On the plain-PyTorch reference of the depth pipeline (``loopline.spec.reference``), whose steps the engine
takes to the step (tests/spec/test_pipeline_engine.py). Without it a row drafts its successor once, at loop
``d``, and judges that draft at its own exit: a wrong draft costs the successor's loops and those of every row
behind it. **Re-drafting**: a row still looping after loop ``d`` reads its head at each of those loops too;
where that greedy token differs from its draft, the rows behind it are dropped at once and the new token
enters next step. A deeper loop's token agrees with the target more often (the demo model: 75% / 85% / 93% at
loops 1 / 2 / 3), so fewer drafts fail at the exit, for the price of earlier, cheaper restarts. Greedy only
(the engine's sampled drafts share the target's noise, so it re-drafts sampled rows too; the reference's
rejection sampling does not).

With re-drafting off and on (``SpeculativeConfig.redraft``, loops ``d+1`` to the exit), the 8 code prompts of
``tools/spec_pipeline_steps.py``, greedy: decode steps per token, row-loops per token, drafts that failed at
their exit and rows dropped; it checks the tokens equal plain decoding's (the rule cannot change what is
committed: a row's token commits only when it equals its predecessor's target).
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch
from spec_pipeline_steps import PROMPTS  # (tools/, beside this script)

from loopline.models.loader import load_model, load_tokenizer
from loopline.models.plain import plain_generate
from loopline.models.tiny import default_checkpoint
from loopline.spec import SpeculativeConfig
from loopline.spec.reference import speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=1.0)
    ap.add_argument("--draft-loops", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(default_checkpoint(), dtype=torch.float32, device="cpu")
    tok = load_tokenizer(default_checkpoint())
    prompts = [tok.encode(p) for p in PROMPTS]
    d = a.draft_loops
    plain = [plain_generate(model, p, a.tokens, exit_threshold=a.threshold) for p in prompts]
    print(f"demo model, d={d}, {a.tokens} tokens x {len(prompts)} prompts, greedy, exit threshold {a.threshold}")
    for redraft in (False, True):
        spec = SpeculativeConfig(scheme="pipeline", draft_loops=d, redraft=redraft)
        sums = Counter()
        for p, base in zip(prompts, plain):
            out = speculative_generate(model, p, a.tokens, spec, temperature=0.0, exit_threshold=a.threshold)
            assert out.tokens == base.tokens and out.exit_loops == base.exit_loops, "re-drafting changed the output"
            sums.update(tokens=len(out.tokens) - 1, steps=out.steps, row_loops=out.row_loops, dropped=out.dropped,
                        plain=sum(base.exit_loops[1:]), failed=sum(not m for m in out.matches))
        n = sums["tokens"]
        print(f"redraft={redraft!s:<5}: {sums['steps'] / n:.3f} steps a token (plain {sums['plain'] / n:.3f}), "
              f"{sums['row_loops'] / n:.3f} row-loops a token, {sums['failed']} drafts failed at the exit, "
              f"{sums['dropped']} rows dropped")


if __name__ == "__main__":
    main()
