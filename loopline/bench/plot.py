"""``--plot FILE.png``: output throughput vs concurrency, one line per variant."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from loopline.errors import LooplineError


class PlotUnavailableError(LooplineError):
    """matplotlib is not installed (or the plot's folder does not exist)."""


def check_plot_available(path: str) -> None:
    """Fails before a benchmark runs, not after: matplotlib must import and ``path``'s folder exist."""
    _pyplot()
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise PlotUnavailableError(f"--plot {path}: the folder {folder} does not exist")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'loopline[plot]' (or pip install matplotlib)") from None
    return plt


def plot_throughput(record: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    fig = throughput_figure(record)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def throughput_figure(record: dict[str, Any]) -> Any:
    """The matplotlib figure of :func:`plot_throughput` (one axes)."""
    plt = _pyplot()
    points = record["results"]
    names = [row["name"] for row in points[0]["variants"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        xs, ys = [], []
        for point in points:
            for row in point["variants"]:
                if row["name"] == name and row["median"]["output_throughput"] is not None:
                    xs.append(point["concurrency"])
                    ys.append(row["median"]["output_throughput"])
        ax.plot(xs, ys, marker="o", label=name)
    concurrencies = [p["concurrency"] for p in points]
    if len(concurrencies) > 1 and max(concurrencies) / max(1, min(concurrencies)) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s (median)")
    ax.set_ylim(bottom=0)  # ratios between lines read true only from a zero baseline
    p, hw = record["params"], record["hardware"]
    device = hw.get("gpu") or f"CPU ({hw['cpu_count']} cores)"
    commit = (record["git"].get("commit") or "unknown")[:10]
    ax.set_title(f"{p['model_source']}, {p['input_len']} in / {p['output_len']} out, "
                 f"depth {p['depth_dist'] or p['exit_mode']}\n{device}, {p['dtype']}, commit {commit}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
