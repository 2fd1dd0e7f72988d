"""Plots of the demo model's depth evidence (docs/demo-model.md), from its training_info.json and a
`loopline train curve` JSON.

    python tools/plot_demo_model.py loopline/models/demo_ouro/exit_curve.json docs/images/demo-model.png

Two sources, each panel naming its own: the loss per loop is the trainer's evaluation (training_info.json,
its own held-out split); the threshold sweep and the exit-depth histograms are the exit curve, measured
through the engine on another held-out split. The two loss levels therefore differ and are never drawn on
one axis. Needs matplotlib (the `plot` extra).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _label_groups(points: list[dict[str, Any]], min_gap: float = 0.05) -> list[tuple[str, dict[str, Any]]]:
    """One label per run of neighbouring sweep points (their mean depths closer than ``min_gap``), so
    thresholds that all run ~4 loops share one label instead of printing over each other."""
    groups: list[list[dict[str, Any]]] = []
    for p in sorted(points, key=lambda p: p["threshold"]):
        if groups and abs(p["mean_depth"] - groups[-1][-1]["mean_depth"]) < min_gap:
            groups[-1].append(p)
        else:
            groups.append([p])
    out = []
    for g in groups:
        name = f"{g[0]['threshold']}" if len(g) == 1 else f"{g[0]['threshold']}-{g[-1]['threshold']}"
        out.append((name, g[0]))
    return out


def draw(curve_path: Path, out: Path, model_dir: Path | None = None) -> Path:
    """Writes the three-panel PNG to ``out`` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = json.loads(curve_path.read_text())
    # the curve names its model without a path; `train curve --out DIR/exit_curve.json` writes it beside the weights
    info = json.loads((model_dir or curve_path.parent).joinpath("training_info.json").read_text())
    losses = info["metrics"]["loop_losses"]
    eng, den = curve["engine"], curve["dense"]
    scored = eng[0]["tokens"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))

    ax = axes[0]
    ax.bar(range(1, len(losses) + 1), losses, color="#4c72b0")
    for i, v in enumerate(losses, start=1):
        ax.text(i, v + 0.01, f"{v:.3f}", ha="center", fontsize=9)
    ax.set_ylim(min(losses) - 0.3, max(losses) + 0.1)
    ax.set_xticks(range(1, len(losses) + 1))
    ax.set_xlabel("loops run for every token")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"Loss per loop: trainer's held-out split\n({info['metrics']['heldout_tokens']:,} tokens; "
                 f"uniform {info['metrics']['uniform_loss']:.2f})", fontsize=10)

    ax = axes[1]
    full = next(p["loss"] for p in eng if p["threshold"] == 1.0)
    ax.axhline(full, color="0.6", ls="--", lw=1, label=f"full depth ({full:.3f})")
    ax.plot([p["mean_depth"] for p in eng], [p["loss"] for p in eng], "o-", label="engine (prompt_logprobs)")
    ax.plot([p["mean_depth"] for p in den], [p["loss"] for p in den], "x", color="k", label="dense model")
    for name, p in _label_groups(eng):
        at_end = p["mean_depth"] > 3.9  # the last group goes under its point, away from its left neighbour's label
        ax.annotate(name, (p["mean_depth"], p["loss"]), textcoords="offset points",
                    xytext=(-2, -13) if at_end else (0, 7), ha="right" if at_end else "center", fontsize=8)
    ax.set_xlim(min(p["mean_depth"] for p in eng) - 0.2, 4.15)
    ax.margins(y=0.12)
    ax.set_xlabel("mean loops per token")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"Exit threshold sweep through the engine\n({scored:,} tokens of the exit curve's split; "
                 "labels: threshold)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")

    ax = axes[2]
    picks = [p for p in eng if p["threshold"] in (0.3, 0.5, 0.8)] or eng[:3]
    width = 0.8 / len(picks)
    ds = range(1, len(losses) + 1)
    for j, p in enumerate(picks):
        ax.bar([d + (j - (len(picks) - 1) / 2) * width for d in ds],
               [p["depth_histogram"].get(str(d), 0) / p["tokens"] for d in ds], width,
               label=f"threshold {p['threshold']} (mean {p['mean_depth']:.2f})")
    ax.set_xticks(list(ds))
    ax.set_xlabel("exit depth")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"Per-token exit depths through the engine\n(the same {scored:,} tokens)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")

    fig.suptitle(f"loopline demo model (exit curve: {curve['device']}, CPython {curve['python_version']} "
                 f"held-out files, KV layout {curve['kv_layout']})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("curve", help="JSON written by `loopline train curve --out`")
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the curve file's directory)")
    ns = ap.parse_args()
    print(draw(Path(ns.curve), Path(ns.out), Path(ns.model) if ns.model else None))


if __name__ == "__main__":
    main()
