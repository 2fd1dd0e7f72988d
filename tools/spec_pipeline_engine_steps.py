"""Steps per token of the depth pipeline in the engine against the plain-PyTorch reference's (issue #41,
scheme 2), on the bundled demo model, greedy, concurrency 1, decode steps only.

    python tools/spec_pipeline_engine_steps.py --threshold 1.0 --tokens 48
    python tools/spec_pipeline_engine_steps.py --threshold 0.5 --tokens 48

For each draft depth ``d`` and each of the 8 code prompts of ``tools/spec_pipeline_steps.py``, one sequence
at a time: the reference's ``speculative_generate(..., scheme="pipeline")`` and the engine with
``speculative_config={"scheme": "pipeline", "draft_loops": d}`` (pinned: no adaptive stop), and plain
decoding in the engine. Prints decode steps per token (the prompt's first token, sampled by the prefill,
not counted; the engine's prefill steps left out), the engine's judged-draft acceptance, and whether the
engine's tokens equal the reference's and plain decoding's.
"""
from __future__ import annotations

import argparse

import torch
from spec_pipeline_steps import PROMPTS

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.loader import load_model, load_tokenizer
from loopline.models.tiny import default_checkpoint
from loopline.spec import SpeculativeConfig
from loopline.spec.reference import speculative_generate


def engine_run(prompts: list[list[int]], params: SamplingParams, speculative: dict | None) -> tuple[list, int, dict]:
    """Each prompt alone through one engine: (token ids per prompt, decode steps, spec_decode counters)."""
    eng = LLMEngine(EngineArgs(device="cpu", dtype="float32", skip_tokenizer_init=True, async_scheduling=False,
                               speculative_config=speculative))
    outs = []
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs.append(list(out.outputs[0].token_ids))
    return outs, eng.stats.steps - eng.stats.prefill_steps, eng.stats.spec_decode_metrics()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threshold", type=float, default=1.0, help="exit_threshold of every sequence")
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--tokens", type=int, default=48)
    ns = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_model(default_checkpoint(), dtype=torch.float32).eval()
    prompts = [load_tokenizer(default_checkpoint()).encode(t) for t in PROMPTS]
    params = SamplingParams(max_tokens=ns.tokens, temperature=0.0, ignore_eos=True, exit_threshold=ns.threshold)
    plain, plain_steps, _ = engine_run(prompts, params, None)
    n = sum(len(t) - 1 for t in plain)
    print(f"threshold {ns.threshold}, {len(prompts)} prompts x {ns.tokens} tokens; plain (engine) "
          f"{plain_steps / n:.2f} decode steps/token")
    print("| d | reference steps/token | engine steps/token | engine acceptance (judged drafts) | "
          "engine tokens = reference's | = plain's |")
    print("|---|---|---|---|---|---|")
    for d in ns.draft_loops:
        ref_steps, ref_tokens = 0, []
        for prompt in prompts:
            out = speculative_generate(model, prompt, ns.tokens, SpeculativeConfig(scheme="pipeline", draft_loops=d),
                                       exit_threshold=ns.threshold)
            ref_steps += out.steps
            ref_tokens.append(list(out.tokens))
        spec = {"method": "loop", "scheme": "pipeline", "draft_loops": d, "adaptive": False,
                "disable_by_batch_size": None}
        got, steps, counters = engine_run(prompts, params, spec)
        drafts = counters["vllm:spec_decode_num_draft_tokens"]
        acc = counters["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else float("nan")
        print(f"| {d} | {ref_steps / n:.2f} | {steps / n:.2f} | {acc:.3f} | {got == ref_tokens} | {got == plain} |",
              flush=True)


if __name__ == "__main__":
    main()
