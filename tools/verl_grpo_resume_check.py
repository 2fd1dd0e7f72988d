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

    python tools/verl_grpo_resume_check.py CONTINUED.jsonl RESUMED.jsonl --step 11 --out resume.json

Prints one line per metric and exits 1 when a metric is missing or out of tolerance.
"""
from __future__ import annotations

import argparse
import json
import math
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("continued", help="file log of the run that went on past the checkpoint")
    ap.add_argument("resumed", help="file log of the run resumed from the checkpoint")
    ap.add_argument("--step", type=int, required=True, help="the iteration after the checkpoint (k+1)")
    ap.add_argument("--out", help="JSON file for the comparison")
    args = ap.parse_args()
    rows = compare(step_metrics(Path(args.continued), args.step), step_metrics(Path(args.resumed), args.step))
    for key, r in rows.items():
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {key}: continued {r['continued']!r} resumed {r['resumed']!r}")
    ok = all(r["ok"] for r in rows.values())
    if args.out:
        Path(args.out).write_text(json.dumps({"step": args.step, "ok": ok, "metrics": rows}, indent=1))
    print(f"iteration {args.step}: resumed {'reproduces' if ok else 'DOES NOT reproduce'} the continued run")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
