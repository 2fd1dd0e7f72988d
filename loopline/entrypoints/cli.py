"""The ``loopline`` command: ``generate``, ``serve``, ``bench``.

Engine flags come from :class:`EngineArgs` and sampling flags from
:class:`SamplingParams` (``--max-tokens``, ``--exit-threshold``, ...), so the
CLI and the Python API share one definition.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from loopline.config import EngineArgs, add_dataclass_args
from loopline.errors import LooplineError
from loopline.sampling_params import SamplingParams


SAMPLING_RENAMES = {"seed": "sampling_seed"}  # --seed is the engine's


def add_sampling_args(parser: Any) -> None:
    add_dataclass_args(parser.add_argument_group("sampling"), SamplingParams, rename=SAMPLING_RENAMES)


def sampling_from_ns(ns: argparse.Namespace) -> SamplingParams:
    kwargs = {}
    for f in dataclasses.fields(SamplingParams):
        dest = SAMPLING_RENAMES.get(f.name, f.name)
        if f.name != "extra" and hasattr(ns, dest):
            kwargs[f.name] = getattr(ns, dest)
    return SamplingParams(**kwargs)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text offline (default model: the bundled tiny checkpoint)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts (default: one demo prompt)")
    p.add_argument("--prompt-file", help="file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    p.add_argument("--stats", action="store_true", help="print steps, rows per step, mean exit depth and tokens/s")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(ns: argparse.Namespace) -> int:
    from loopline.entrypoints.llm import LLM

    prompts = list(ns.prompts)
    if ns.prompt_file:
        with open(ns.prompt_file, encoding="utf-8") as fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
        prompts = ["Once upon a time"]
    params = sampling_from_ns(ns)
    args = EngineArgs.from_cli_args(ns)
    llm = LLM(**dataclasses.asdict(args))
    t0 = time.perf_counter()
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outs):
        prompt_lps = logprob_rows(out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs)
        for comp in out.outputs:
            lps = logprob_rows(comp.token_ids, comp.logprobs, params.logprobs)
            if ns.json:
                record = {"prompt": prompt, "index": comp.index, "text": comp.text, "token_ids": comp.token_ids,
                          "exit_depths": comp.exit_depths, "finish_reason": comp.finish_reason,
                          "cumulative_logprob": comp.cumulative_logprob, "seed": comp.seed}
                if lps is not None:
                    record["logprobs"] = lps
                if prompt_lps is not None:
                    record["prompt_logprobs"] = prompt_lps
                print(json.dumps(record))
            else:
                print(f"prompt: {prompt!r}\noutput[{comp.index}]: {comp.text!r}\n"
                      f"exit depths: {comp.exit_depths} (mean {comp.mean_exit_depth:.2f})  finish: {comp.finish_reason}")
                if prompt_lps is not None and comp.index == 0:
                    print("prompt logprobs (id, token, logprob, rank | top: id, token, logprob):\n" + format_logprob_rows(prompt_lps))
                if lps is not None:
                    print("logprobs (id, token, logprob, rank | top: id, token, logprob):\n" + format_logprob_rows(lps))
                print()
    if ns.stats:
        st = llm.llm_engine.stats
        stats = {"steps": st.steps, "rows_per_step": round(st.rows_per_step, 2),
                 "mean_exit_depth": round(st.mean_exit_depth, 3), "generated_tokens": st.generated_tokens,
                 "elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(st.generated_tokens / elapsed, 1)}
        print(json.dumps({"stats": stats}) if ns.json else "stats: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
    return 0


def logprob_rows(token_ids: list[int], entries: list | None, k: int | None) -> list[dict | None] | None:
    """One JSON-ready row per token: its id, text, logprob and rank, and the top ``k`` ranked
    (``None`` where a position has no logprob: the first prompt token)."""
    if entries is None or k is None:
        return None
    rows: list[dict | None] = []
    for tid, entry in zip(token_ids, entries):
        if not entry:
            rows.append(None)
            continue
        lp = entry[tid]
        ranked = sorted((v.rank, t, v) for t, v in entry.items() if v.rank is not None and v.rank <= k)
        rows.append({"token_id": tid, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank,
                     "top": [{"token_id": t, "token": v.decoded_token, "logprob": v.logprob, "rank": r}
                             for r, t, v in ranked]})
    return rows


def format_logprob_rows(rows: list[dict | None]) -> str:
    lines = []
    for row in rows:
        if row is None:
            lines.append("  (first prompt token: no logprob)")
            continue
        top = ", ".join(f"{t['token_id']} {t['token']!r} {t['logprob']:.3f}" for t in row["top"])
        lines.append(f"  {row['token_id']:>6} {row['token']!r:<12} {row['logprob']:8.3f} {row['rank']:>6}"
                     + (f" | {top}" if top else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopline", description="Inference and serving for looped language models (Ouro).")
    sub = parser.add_subparsers(dest="command", metavar="{generate,serve,bench}")
    sub.required = True
    _add_generate(sub)
    for name in ("serve", "bench"):
        try:
            module = __import__(f"loopline.entrypoints.{name}_cli", fromlist=["add_parser"])
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except LooplineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
