"""Does a resumed verl run reproduce the iteration after its checkpoint? (docs/rl.md, section 10)

Compares one iteration's metrics in two verl file logs (``VERL_FILE_LOGGER_PATH``): the run that went
on past its save at iteration k (CONTINUED) and the run resumed from that save
(``trainer.resume_mode=resume_path``, RESUMED), at iteration ``--step`` (k+1).

* token-determined metrics (the rewards, response lengths, advantages) must be equal: the rollouts
  of iteration k+1 are seeded per sample (loopline/integrations/rollout_seed.py), and the weights,
  optimizer state and data order come back from the checkpoint;
* log-probability metrics (the rollout's and the actor's log-perplexity, verl's rollout-vs-actor
  mismatch, entropy, gradient norm) must agree within floating-point noise: the engine batches the
  same requests in another arrival order and the trainer's micro-batches may group samples
  differently, which changes reduction orders, not values beyond rounding.

    python tools/verl_grpo_resume_check.py CONTINUED.jsonl RESUMED.jsonl --step 11 --out resume.json \
        --generations CONTINUED_DIR RESUMED_DIR

``--generations`` also compares the iteration's samples themselves, from the two runs' dumps
(verl's ``trainer.rollout_data_dir``: ``STEP.jsonl``, one line per sample with its prompt and
completion text): per prompt, the completions of the two runs as multisets; it reports how many
samples differ and, for each, how many characters the closest completion of the other run shares
with it. It does not change the verdict; it says whether a log-probability difference comes from
other tokens or from other numbers for the same tokens.

Prints one line per metric and exits 1 when a metric is missing or out of tolerance.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

# metric -> (absolute, relative) tolerance
EXACT = (1e-9, 0.0)
TOLERANCES: dict[str, tuple[float, float]] = {
    "critic/score/mean": EXACT, "critic/score/max": EXACT, "critic/score/min": EXACT,
    "critic/advantages/max": (1e-5, 0.0), "critic/advantages/min": (1e-5, 0.0),
    "response_length/mean": EXACT, "prompt_length/mean": EXACT,
    "rollout_corr/rollout_log_ppl": (1e-4, 1e-3), "rollout_corr/training_log_ppl": (1e-4, 1e-3),
    "training/rollout_probs_diff_mean": (1e-4, 0.0), "training/rollout_probs_diff_max": (1e-3, 0.0),
    "actor/entropy": (1e-4, 1e-3), "actor/grad_norm": (1e-4, 1e-2),
}


def step_metrics(path: Path, step: int) -> dict[str, Any]:
    """The ``data`` of iteration ``step`` in a verl file log (the last record with that step)."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (did the run start?)")
    found = None
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("step") == step:
                found = record.get("data", record)
    if found is None:
        raise SystemExit(f"{path}: no iteration {step} (is --step the iteration after the checkpoint?)")
    return found


def compare(continued: dict[str, Any], resumed: dict[str, Any],
            tolerances: dict[str, tuple[float, float]] = TOLERANCES) -> dict[str, dict[str, Any]]:
    """Per metric: both values, their difference, the tolerance and whether it holds."""
    rows = {}
    for key, (atol, rtol) in tolerances.items():
        a, b = continued.get(key), resumed.get(key)
        if a is None or b is None:
            rows[key] = {"continued": a, "resumed": b, "ok": False, "why": "missing"}
            continue
        ok = math.isclose(float(a), float(b), abs_tol=atol, rel_tol=rtol)
        rows[key] = {"continued": a, "resumed": b, "diff": float(b) - float(a), "atol": atol, "rtol": rtol, "ok": ok}
    return rows


def compare_generations(continued: Path, resumed: Path) -> dict[str, Any]:
    """Samples of one iteration's dumps (``STEP.jsonl`` files) that the other run did not generate.

    Samples are matched per prompt as multisets of completions (a sample's position in the dump depends on
    uids drawn per run). For each unmatched completion: its prompt, its length and the longest prefix it
    shares with an unmatched completion of the same prompt in the other run (characters)."""
    def load(path: Path) -> dict[str, list[str]]:
        by_prompt: dict[str, list[str]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_prompt.setdefault(row["input"], []).append(row["output"])
        return by_prompt

    a, b = load(continued), load(resumed)
    samples = sum(len(v) for v in a.values())
    differing = []
    for prompt in sorted(set(a) | set(b)):
        left, right = Counter(a.get(prompt, [])), Counter(b.get(prompt, []))
        only_right = right - left
        for out in (left - right).elements():
            shared = max((len(os.path.commonprefix([out, other])) for other in only_right), default=0)
            differing.append({"prompt": prompt, "chars": len(out), "shared_prefix_chars": shared})
    return {"samples": samples, "resumed_samples": sum(len(v) for v in b.values()),
            "differing": len(differing), "details": differing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("continued", help="file log of the run that went on past the checkpoint")
    ap.add_argument("resumed", help="file log of the run resumed from the checkpoint")
    ap.add_argument("--step", type=int, required=True, help="the iteration after the checkpoint (k+1)")
    ap.add_argument("--out", help="JSON file for the comparison")
    ap.add_argument("--generations", nargs=2, metavar=("CONTINUED_DIR", "RESUMED_DIR"),
                    help="the two runs' trainer.rollout_data_dir: compare the iteration's samples too")
    args = ap.parse_args()
    rows = compare(step_metrics(Path(args.continued), args.step), step_metrics(Path(args.resumed), args.step))
    for key, r in rows.items():
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {key}: continued {r['continued']!r} resumed {r['resumed']!r}")
    ok = all(r["ok"] for r in rows.values())
    result: dict[str, Any] = {"step": args.step, "ok": ok, "metrics": rows}
    if args.generations:
        dumps = [Path(d) / f"{args.step}.jsonl" for d in args.generations]
        missing = [str(d) for d in dumps if not d.is_file()]
        if missing:
            print(f"generations: no dump {', '.join(missing)}")
        else:
            gen = result["generations"] = compare_generations(*dumps)
            shared = sorted(d["shared_prefix_chars"] for d in gen["details"])
            print(f"generations: {gen['differing']} of {gen['samples']} samples differ"
                  + (f" (shared prefix chars: {shared})" if shared else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"iteration {args.step}: resumed {'reproduces' if ok else 'DOES NOT reproduce'} the continued run")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
