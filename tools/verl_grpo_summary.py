"""Per-iteration summary of a verl run's file log (``trainer.logger=[...,file]``, VERL_FILE_LOGGER_PATH).

Reads verl's JSON lines (one ``{"step": n, "data": {metric: value}}`` per iteration) and writes one
JSON object: per iteration the mean reward (``critic/score/mean``), the rollout-vs-actor logprob
mismatch verl measures when ``rollout.calculate_log_probs=True`` (``training/rollout_probs_diff_*``,
``training/rollout_actor_probs_pearson_corr``), the step and weight-sync times (``timing_s/*``), the
mean response length, and verl's validation on the held-out prompts where it ran: its ``mean@N`` metrics
(``val-core/*`` and ``val-aux/*``; a float reward is ``val-aux/loopline_python_closes/reward/mean@8``;
with ``trainer.val_before_train`` a record of step 0 holds only those).

    python tools/verl_grpo_summary.py RUN.jsonl --label adaptive --out summary.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KEYS = ("critic/score/mean", "critic/rewards/mean", "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max", "training/rollout_probs_diff_std",
        "training/rollout_actor_probs_pearson_corr", "response_length/mean", "actor/pg_loss", "actor/entropy")
#: verl's validation means over N samples a prompt (its std / best@ / worst@ statistics are left out)
VALIDATION = re.compile(r"val-(core|aux)/.+/mean@\d+")


def summarize(lines: list[str]) -> list[dict]:
    """One dict per logged record: its step, the metrics of KEYS it has, every ``timing_s/`` entry and
    validation mean."""
    rows = []
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        data = record.get("data", record)
        row = {"step": record.get("step", data.get("training/global_step"))}
        row.update({k: data[k] for k in KEYS if k in data})
        row.update({k: v for k, v in data.items() if k.startswith("timing_s/") or VALIDATION.fullmatch(k)})
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="verl's file-logger output (JSON lines)")
    ap.add_argument("--label", default="run", help="name of this run in the output")
    ap.add_argument("--out", required=True, help="JSON file to write (merged with an existing one by label)")
    args = ap.parse_args()
    out = Path(args.out)
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged[args.label] = summarize(Path(args.log).read_text().splitlines())
    out.write_text(json.dumps(merged, indent=1))
    print(f"{len(merged[args.label])} records of {args.label!r} in {out}")


if __name__ == "__main__":
    main()
