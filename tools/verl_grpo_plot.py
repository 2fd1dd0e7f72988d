"""Plots of verl GRPO runs (docs/rl.md, section 10) from tools/verl_grpo_summary.py's JSON.

Two PNGs, one line per run (``fixed``, ``adaptive``, ``stock``, ... as labelled in the JSON):

* ``PREFIX_reward.png``: the mean reward per iteration (``critic/score/mean``, solid) and, where verl's
  validation ran, the mean reward on the held-out prompts (``val-core/*/reward/mean@N`` or, for a float
  reward, ``val-aux/*/reward/mean@N``; squares, dotted;
  iteration 0: before training);
* ``PREFIX_mismatch.png``: verl's rollout-vs-actor probability mismatch per iteration
  (``training/rollout_probs_diff_mean``, solid; ``..._max``, dashed), log scale.

    python tools/verl_grpo_plot.py OUT/verl_grpo_gpu.json --out docs/images --prefix verl_grpo_h200 \
        --runs fixed,adaptive,stock

Needs matplotlib (the ``plot`` extra).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REWARD = "critic/score/mean"
MISMATCH_MEAN, MISMATCH_MAX = "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"


def held_out_key(rows: list[dict[str, Any]]) -> str | None:
    """The run's held-out mean reward metric (``val-core|val-aux/SOURCE/reward/mean@N``, the largest N), if any."""
    keys = {k for r in rows for k in r if k.startswith(("val-core/", "val-aux/")) and "/reward/mean@" in k}
    return max(keys, key=lambda k: int(k.rsplit("@", 1)[1]), default=None)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of one metric over a run's rows, rows without it left out."""
    pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def draw(summary: dict[str, list[dict[str, Any]]], out_dir: Path, prefix: str = "verl_grpo",
         runs: list[str] | None = None) -> list[Path]:
    """Writes the reward and mismatch PNGs of the runs in ``summary`` (those named in ``runs``, when given,
    in that order; names it lacks are skipped) to ``out_dir``; returns their paths."""
    if runs is not None:
        summary = {label: summary[label] for label in runs if label in summary}
    if not summary:
        raise ValueError(f"the summary holds no runs to plot (asked for {runs})" if runs else "the summary holds no runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (label, rows) in enumerate(summary.items()):
        x, y = _series(rows, REWARD)
        ax.plot(x, y, marker="o", markersize=3, color=f"C{i}", label=label)
        held_out = held_out_key(rows)
        if held_out is not None:
            x, y = _series(rows, held_out)
            ax.plot(x, y, marker="s", markersize=5, linestyle=":", color=f"C{i}", label=f"{label} held-out")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward (critic/score/mean)")
    ax.set_title("GRPO reward per iteration")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}_reward.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (label, rows) in enumerate(summary.items()):
        color = f"C{i}"
        x, y = _series(rows, MISMATCH_MEAN)
        ax.plot(x, y, marker="o", markersize=3, color=color, label=f"{label} mean")
        x, y = _series(rows, MISMATCH_MAX)
        ax.plot(x, y, linestyle="--", color=color, alpha=0.6, label=f"{label} max")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("|p_rollout - p_actor| per token")
    ax.set_title("Rollout vs actor probability mismatch")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}_mismatch.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", help="JSON written by tools/verl_grpo_summary.py (label -> per-iteration rows)")
    ap.add_argument("--out", required=True, help="directory for the PNGs")
    ap.add_argument("--prefix", default="verl_grpo", help="file name prefix (default verl_grpo)")
    ap.add_argument("--runs", default=None, help="comma-separated run labels to plot, in order (default: all)")
    args = ap.parse_args()
    runs = args.runs.split(",") if args.runs else None
    for path in draw(json.loads(Path(args.summary).read_text()), Path(args.out), args.prefix, runs):
        print(path)


if __name__ == "__main__":
    main()
