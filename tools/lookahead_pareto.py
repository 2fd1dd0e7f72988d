"""Held-out loss vs mean executed loops: the stock exit gate and the lookahead head (issue #44).

Reads the report ``loopline train lookahead --report FILE`` writes, draws the Pareto plot (headless) and
prints the Markdown tables of docs/benchmarks/cpu-2026-12-04-lookahead.md.

    python tools/lookahead_pareto.py REPORT.json --png docs/images/lookahead-pareto.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SERIES = (("stock", "stock gate (min_loops 1)", "o-"), ("stock_min2", "stock gate, min_loops 2", "s--"),
          ("stock_delayed", "stock gate delayed 2 loops (no training)", "x:"),
          ("lookahead", "lookahead head (decided 2 loops ahead)", "^-"))


def table(points: list[dict]) -> str:
    """One Markdown table: threshold, mean loops, loss, early exits, exits whose token differs from full depth."""
    rows = ["| threshold | mean loops | held-out loss (nats) | early exits | wrong exits (rate) |",
            "|---:|---:|---:|---:|---:|"]
    for p in points:
        rows.append(f"| {p['threshold']} | {p['mean_depth']:.3f} | {p['loss']:.4f} | {p['early_exits']} | "
                    f"{p['wrong_exits']} ({p['wrong_exit_rate']:.3f}) |")
    return "\n".join(rows)


def draw(report: dict, png: Path) -> Path:
    """The held-out Pareto plot: loss vs mean loops per policy, full depth as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = report["heldout"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for key, label, style in SERIES:
        pts = sorted(held[key], key=lambda p: p["mean_depth"])
        ax.plot([p["mean_depth"] for p in pts], [p["loss"] for p in pts], style, label=label, markersize=4)
    chosen = held["lookahead_chosen"]
    ax.plot([chosen["mean_depth"]], [chosen["loss"]], "k*", markersize=10,
            label=f"lookahead, calibrated threshold {chosen['threshold']}")
    full = next(p["loss"] for p in held["stock"] if p["threshold"] >= 1.0)
    ax.axhline(full, color="grey", linestyle=":", linewidth=1, label="full depth")
    ax.set_xlabel("mean executed loops per token")
    ax.set_ylabel("held-out next-token loss (nats)")
    ax.set_title(f"demo model, {report['heldout_positions']} held-out positions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="JSON written by 'loopline train lookahead --report'")
    ap.add_argument("--png", type=Path, default=None, help="draw the plot here")
    ns = ap.parse_args()
    report = json.loads(ns.report.read_text(encoding="utf-8"))
    for key, label, _ in SERIES:
        print(f"### {label}\n\n{table(report['heldout'][key])}\n")
    if ns.png:
        print(f"wrote {draw(report, ns.png)}")


if __name__ == "__main__":
    main()
