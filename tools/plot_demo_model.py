"""Plots of the demo model's depth evidence (docs/demo-model.md), from its training_info.json and a
`loopline train curve` JSON.

    python tools/plot_demo_model.py CURVE.json docs/images/demo-model.png [--model DIR]

Three panels: held-out loss per loop (dense model); mean executed loops vs held-out loss as the exit
threshold sweeps (through the engine, with the dense model's points over them); the engine's per-token
exit-depth histograms at three thresholds. Needs matplotlib (the `plot` extra).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("curve", help="JSON written by `loopline train curve --out`")
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the curve file's directory)")
    ns = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = json.loads(Path(ns.curve).read_text())
    # the curve names its model without a path; `train curve --out DIR/exit_curve.json` writes it beside the weights
    info = json.loads((Path(ns.model or Path(ns.curve).parent) / "training_info.json").read_text())
    losses = info["metrics"]["loop_losses"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    ax = axes[0]
    ax.bar(range(1, len(losses) + 1), losses, color="#4c72b0")
    for i, v in enumerate(losses, start=1):
        ax.text(i, v + 0.02, f"{v:.3f}", ha="center", fontsize=9)
    ax.set_ylim(min(losses) - 0.3, max(losses) + 0.15)
    ax.set_xticks(range(1, len(losses) + 1))
    ax.set_xlabel("loops run for every token")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"Loss per loop (uniform: {info['metrics']['uniform_loss']:.2f})")

    ax = axes[1]
    eng, den = curve["engine"], curve["dense"]
    ax.plot([p["mean_depth"] for p in eng], [p["loss"] for p in eng], "o-", label="engine (prompt_logprobs)")
    ax.plot([p["mean_depth"] for p in den], [p["loss"] for p in den], "x", color="k", label="dense model")
    for p in eng:
        ax.annotate(f"{p['threshold']}", (p["mean_depth"], p["loss"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("mean loops per token")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Exit threshold sweep (labels: threshold)")
    ax.legend(fontsize=8)

    ax = axes[2]
    picks = [p for p in eng if p["threshold"] in (0.3, 0.6, 0.8)] or eng[:3]
    width = 0.8 / len(picks)
    for j, p in enumerate(picks):
        total = p["tokens"]
        ds = range(1, len(losses) + 1)
        ax.bar([d + (j - (len(picks) - 1) / 2) * width for d in ds],
               [p["depth_histogram"].get(str(d), 0) / total for d in ds], width, label=f"threshold {p['threshold']}")
    ax.set_xticks(range(1, len(losses) + 1))
    ax.set_xlabel("exit depth")
    ax.set_ylabel("fraction of held-out tokens")
    ax.set_title("Per-token exit depths (engine)")
    ax.legend(fontsize=8)

    fig.suptitle(f"loopline demo model, {curve['heldout_stream_tokens']:,}-token held-out split "
                 f"(CPython {curve['python_version']}), {curve['device']}", fontsize=10)
    fig.tight_layout()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(ns.out, dpi=110)
    print(ns.out)


if __name__ == "__main__":
    main()
