"""Draws the documentation's figures into docs/images/ (or another folder), headless.

    python tools/draw_figures.py [--out docs/images]

* architecture.png: the looped model, labelled from the bundled demo model's config.json and Ouro-1.4B's shapes;
* cdb-timeline.png: slots over steps for refill, no_refill and fixed depth, from real runs of the engine on
  the bundled demo model (four greedy requests, one engine step per loop, read back without overlap);
* kv-planes.png: what each KV plane holds under last_exited and shared, for example exit depths that show
  every case (1 to 4);
* performance.png: the README's performance table as a chart (the numbers are parsed from README.md);
* demo-model.png: the demo model's threshold-vs-loss plot (tools/plot_demo_model.py).

Needs matplotlib (the `plot` extra). Runs on the CPU in about ten seconds.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DPI = 100
PREFILL, IDLE = "#c7cedb", "#f2f2f2"
TOKEN_COLORS = ("#4c72b0", "#dd8452")  # alternate per token so neighbouring tokens stay apart


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- (a) the looped architecture ------------------------------------------------------------------------------
def draw_architecture(out: Path) -> Path:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    from loopline.models.loader import load_config
    from loopline.models.tiny import DEMO_CHECKPOINT, random_checkpoint_config

    demo, ouro, ouro_big = load_config(DEMO_CHECKPOINT), *map(random_checkpoint_config, ("ouro-1.4b", "ouro-2.6b"))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 6.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10.4)
    ax.axis("off")

    def box(x: float, y: float, w: float, h: float, text: str, color: str, size: int = 9) -> None:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.15", fc=color,
                                    ec="0.25", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)

    def arrow(a: tuple[float, float], b: tuple[float, float], text: str = "", rad: float = 0.0,
              color: str = "0.2") -> None:
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=13, color=color, lw=1.3,
                                     connectionstyle=f"arc3,rad={rad}"))
        if text:
            ax.text((a[0] + b[0]) / 2 + 0.12, (a[1] + b[1]) / 2, text, fontsize=8, va="center", color=color)

    box(3.0, 9.4, 3.4, 0.6, "token id", "white")
    box(3.0, 8.2, 3.4, 0.7, "embed_tokens (prelude)\nvocab x hidden", "#e5e5e5")
    arrow((4.7, 9.4), (4.7, 8.95))
    # the shared stack, run once per loop
    ax.add_patch(FancyBboxPatch((1.6, 3.35), 6.2, 4.35, boxstyle="round,pad=0.05,rounding_size=0.2",
                                fc="#eef3fb", ec="#4c72b0", lw=1.6, ls="--"))
    ax.text(1.75, 7.42, "loop r = 1 .. R", fontsize=9, color="#4c72b0", weight="bold")
    ax.text(7.7, 7.42, "the same weights every loop", fontsize=8, color="#4c72b0", ha="right")
    box(2.2, 6.25, 5.0, 0.85, "layer i: x + norm(attention(norm(x)))\n"
                              "attention reads and writes the KV plane of loop r", "white", 8)
    box(2.2, 5.2, 5.0, 0.8, "layer i: x + norm(SwiGLU MLP(norm(x)))", "white", 8)
    ax.text(7.3, 5.75, "x L\nlayers", fontsize=8, va="center")
    box(2.2, 4.3, 5.0, 0.6, "final norm: h_r", "#e5e5e5")
    box(2.2, 3.5, 5.0, 0.6, "exit gate: lambda_r = sigmoid(w . h_r + b)", "#fde7c8")
    arrow((4.7, 8.2), (4.7, 7.15))
    ax.text(4.82, 7.92, "h_0", fontsize=8)
    arrow((4.7, 6.25), (4.7, 6.05))
    arrow((4.7, 5.2), (4.7, 4.95))
    arrow((4.7, 4.3), (4.7, 4.15))
    box(2.45, 1.95, 4.5, 0.95, "exit?  r == max_loops, or\nF_r = 1 - prod(1 - lambda_i) >= exit_threshold\n"
                               "(and r >= min_loops)", "#fff7d6", 8)
    arrow((4.7, 3.5), (4.7, 2.95))
    arrow((2.45, 2.45), (1.55, 6.7), rad=-0.35, color="#4c72b0")
    ax.text(1.05, 2.3, "no: next loop\n(h_r feeds loop r+1)", fontsize=8, color="#4c72b0", ha="right")
    box(3.0, 0.35, 3.4, 0.8, "lm_head (coda)\nhidden -> vocab logits", "#e5e5e5")
    arrow((4.7, 1.95), (4.7, 1.2), "yes: sample from h_r")
    label = (f"bundled demo model: L = {demo.num_hidden_layers}, hidden {demo.hidden_size}, "
             f"R = total_ut_steps = {demo.total_ut_steps}, vocab {demo.vocab_size:,}, "
             f"early_exit_threshold {demo.early_exit_threshold}\n"
             f"Ouro-1.4B: L = {ouro.num_hidden_layers}, hidden {ouro.hidden_size}, R = {ouro.total_ut_steps}, "
             f"vocab {ouro.vocab_size:,}, early_exit_threshold {ouro.early_exit_threshold} (fixed depth); "
             f"Ouro-2.6B: L = {ouro_big.num_hidden_layers}")
    ax.text(5.0, -0.35, label, ha="center", fontsize=8, color="0.25")
    fig.tight_layout()
    return _save(fig, out / "architecture.png")


# --- (b) continuous depth batching, from real engine runs -----------------------------------------------------
@dataclass
class Trace:
    """When each request's tokens finished (1-based engine steps) and at which depth, for one engine run."""

    name: str
    steps: int
    finished: dict[str, list[int]]  # request id -> the step each generated token came out
    depths: dict[str, list[int]]  # request id -> exit depth of each generated token


PROMPTS = ("def f(x):", "import os", "class A:", "for i in")


def run_engine(scheduling_mode: str, exit_mode: str, max_tokens: int = 6) -> Trace:
    """Four greedy requests in four slots, stepped one loop at a time (``async_scheduling=False``: a step's
    outputs come back from that step, so the step numbers are the engine's own)."""
    from loopline import EngineArgs, SamplingParams
    from loopline.engine import LLMEngine

    engine = LLMEngine(EngineArgs(max_num_seqs=len(PROMPTS), async_scheduling=False, device="cpu",
                                  scheduling_mode=scheduling_mode, exit_mode=exit_mode, max_model_len=256,
                                  kv_cache_memory_gb=1 / 64))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finished: dict[str, list[int]] = {}
    depths: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            c = out.outputs[0]
            done = finished.setdefault(out.request_id, [])
            done.extend([step] * (len(c.token_ids) - len(done)))
            depths[out.request_id] = list(c.exit_depths)
    name = "fixed depth (exit_mode fixed)" if exit_mode == "fixed" else scheduling_mode
    return Trace(name, step, finished, depths)


def _cells(trace: Trace, rid: str, prefill_loops: int) -> list[tuple[int, str, str]]:
    """(step, colour, text) for every step of one slot: prefill loops, each token's loops, idle steps."""
    cells = [(s, PREFILL, f"{s}") for s in range(1, prefill_loops + 1)]
    busy = {s for s, _, _ in cells}
    # token 0 comes out of the prompt's last position: the prefill steps above
    for k, (end, depth) in enumerate(zip(trace.finished[rid][1:], trace.depths[rid][1:]), start=1):
        for loop in range(1, depth + 1):
            step = end - depth + loop
            cells.append((step, TOKEN_COLORS[k % 2], f"{loop}"))
            busy.add(step)
    cells += [(s, IDLE, "") for s in range(1, trace.steps + 1) if s not in busy]
    return cells


def draw_timeline(out: Path, traces: list[Trace]) -> Path:
    from matplotlib.patches import Patch, Rectangle

    plt = _plt()
    longest = max(t.steps for t in traces)
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 1.35 * len(traces) + 1.1), sharex=True)
    for ax, trace in zip(axes, traces):
        rids = sorted(trace.finished)
        prefill = trace.finished[rids[0]][0]  # prompts run every loop before their first token comes out
        for row, rid in enumerate(rids):
            for step, color, text in _cells(trace, rid, prefill):
                ax.add_patch(Rectangle((step - 1, row), 1, 1, fc=color, ec="white", lw=1))
                if text:
                    ax.text(step - 0.5, row + 0.5, text, ha="center", va="center", fontsize=7,
                            color="black" if color == PREFILL else "white")
        ax.set_ylim(len(rids), 0)
        ax.set_xlim(0, longest)
        ax.set_yticks([r + 0.5 for r in range(len(rids))], [f"slot {r}" for r in range(len(rids))], fontsize=8)
        tokens = sum(len(v) for v in trace.depths.values())
        ax.set_title(f"{trace.name}: {trace.steps} steps for {tokens} tokens", fontsize=9, loc="left")
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("engine step (one loop of the shared stack for every scheduled row)")
    axes[-1].set_xticks(range(0, longest + 1, 2))
    fig.legend(handles=[Patch(fc=PREFILL, label="prompt (prefill, all loops)"),
                        Patch(fc=TOKEN_COLORS[1], label="a generated token's loops (number: loop)"),
                        Patch(fc=TOKEN_COLORS[0], label="the next token"),
                        Patch(fc=IDLE, label="idle slot")], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Continuous depth batching on the bundled demo model (real engine runs: 4 greedy requests, "
                 "6 tokens each)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, out / "cdb-timeline.png")


# --- (c) KV planes ---------------------------------------------------------------------------------------------
def draw_kv_planes(out: Path, exit_depths: list[int], prompt_len: int = 4, loops: int = 4) -> Path:
    from matplotlib.patches import Patch, Rectangle

    plt = _plt()
    depths = [loops] * prompt_len + list(exit_depths)
    n = len(depths)
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.2), gridspec_kw={"height_ratios": [loops, 1.6]})
    written, copied, final = "#4c72b0", "#a9c1e6", "#55a868"

    ax = axes[0]
    for plane in range(1, loops + 1):
        for p, e in enumerate(depths):
            own = plane <= e
            ax.add_patch(Rectangle((p, plane - 1), 1, 1, fc=written if own else copied, ec="white", lw=1.5,
                                   hatch=None if own else "//"))
            ax.text(p + 0.5, plane - 0.5, f"L{min(plane, e)}", ha="center", va="center", fontsize=8,
                    color="white" if own else "black")
    ax.set_yticks([i + 0.5 for i in range(loops)], [f"plane {i + 1}\n(loop {i + 1})" for i in range(loops)],
                  fontsize=8)
    ax.set_title(f"last_exited: one plane per loop ({loops} x a dense model's KV); a token that exits at loop e\n"
                 "has its loop-e KV copied into the deeper planes, so a later query at loop d reads loop min(d, e)",
                 fontsize=9, loc="left")

    ax = axes[1]
    for p, e in enumerate(depths):
        ax.add_patch(Rectangle((p, 0), 1, 1, fc=final, ec="white", lw=1.5))
        ax.text(p + 0.5, 0.5, f"L{e}", ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks([0.5], ["the plane"], fontsize=8)
    ax.set_title("shared: one plane; each token's latest KV (the prompt's from its last loop, prefilled "
                 "depth-major)", fontsize=9, loc="left")

    for ax, rows in zip(axes, (loops, 1)):
        ax.set_xlim(0, n)
        ax.set_ylim(rows, 0)
        ax.set_xticks([p + 0.5 for p in range(n)],
                      [f"p{p}" if p < prompt_len else f"t{p - prompt_len}\ne={d}" for p, d in enumerate(depths)],
                      fontsize=8)
        ax.axvline(prompt_len, color="k", lw=1)
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("position (p: prompt, t: generated token; e: its exit depth)   L<k>: KV computed at loop k",
                       fontsize=8)
    fig.legend(handles=[Patch(fc=written, label="written by the token at this loop"),
                        Patch(fc=copied, hatch="//", label="copied at exit (last_exited)"),
                        Patch(fc=final, label="overwritten each loop: the last one stays (shared)")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, out / "kv-planes.png")


# --- (d) the README's performance table ------------------------------------------------------------------------
def _number(text: str) -> float:
    return float(text.replace(",", ""))


def readme_numbers(readme: Path = ROOT / "README.md") -> dict[str, float]:
    """The figures the performance chart draws, parsed from the README's table; a row that no longer reads
    as expected raises, so the chart never shows numbers the table lost."""
    rows = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows[cells[0]] = cells[1:]
    num = r"([\d,]+(?:\.\d+)?)"

    def grab(row: str, col: int, pattern: str) -> float:
        m = re.search(pattern, rows[row][col])
        if m is None:
            raise ValueError(f"README.md performance table: row {row!r} no longer matches {pattern!r}")
        return _number(m.group(1))

    c1, c32 = "1024 in / 128 out, full depth, concurrency 1", "same, concurrency 32"
    c128 = "same, concurrency 128"
    adaptive = next(r for r in rows if r.startswith("128 in / 512 out, adaptive depth"))
    return {
        "loopline c1": grab(c1, 0, num), "transformers quoted c1": grab(c1, 1, r"generate\(\)`?: " + num),
        "loopline c32": grab(c32, 0, num), "transformers quoted c32": grab(c32, 1, r"transformers: " + num),
        "transformers same process c32": grab(c32, 1, r"same process \(`\w+`\): " + num),
        "loopline c128": grab(c128, 0, num), "target c128": grab(c128, 1, r"target " + num),
        "serial bound c128": grab(c128, 1, r"read ceilings: " + num),
        "adaptive": grab(adaptive, 0, num), "fixed": grab(adaptive, 1, r"fixed depth: " + num),
    }


def draw_performance(out: Path) -> Path:
    plt = _plt()
    v = readme_numbers()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1.3]})
    quoted, same = "transformers (quoted)", "transformers (same process)"
    groups = [("concurrency 1", [("loopline", v["loopline c1"]), (quoted, v["transformers quoted c1"])]),
              ("concurrency 32", [("loopline", v["loopline c32"]), (quoted, v["transformers quoted c32"]),
                                  (same, v["transformers same process c32"])]),
              ("concurrency 128", [("loopline", v["loopline c128"])])]
    colors = {"loopline": "#4c72b0", quoted: "#bbbbbb", same: "#888888"}
    seen = set()
    for g, (name, bars) in enumerate(groups):
        for j, (who, value) in enumerate(bars):
            x = g + (j - (len(bars) - 1) / 2) * 0.27
            ax.bar(x, value, 0.25, color=colors[who], label=None if who in seen else who)
            inside = who == "loopline"  # above its bar, the concurrency-128 label met the target lines
            ax.text(x, value * (0.8 if inside else 1.08), f"{value:,.1f}", ha="center",
                    va="top" if inside else "bottom", fontsize=7, color="white" if inside else "black")
            seen.add(who)
    ax.hlines([v["serial bound c128"], v["target c128"]], 1.75, 2.25, colors=["#c44e52", "#55a868"], ls="--")
    ax.text(2.27, v["serial bound c128"], f"serial bound {v['serial bound c128']:,.0f}", fontsize=7, va="top")
    ax.text(2.27, v["target c128"], f"target {v['target c128']:,.0f}", fontsize=7, va="bottom")
    ax.set_yscale("log")
    ax.set_ylim(3, 20000)
    ax.set_xlim(-0.5, 2.9)
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_ylabel("output tokens/s (log scale)")
    ax.set_title("1024 in / 128 out, full depth (H200, Ouro-1.4B shapes, bf16)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")

    ax2.bar([0, 1], [v["fixed"], v["adaptive"]], 0.6, color=["#888888", "#4c72b0"])
    for x, value in enumerate((v["fixed"], v["adaptive"])):
        ax2.text(x, value * 1.02, f"{value:,.0f}", ha="center", fontsize=8)
    ax2.set_xticks([0, 1], ["fixed depth", "adaptive\n(mean 2.5 loops)"], fontsize=8)
    ax2.set_ylim(0, v["adaptive"] * 1.18)
    ax2.set_title(f"128 in / 512 out, concurrency 128\n(adaptive / fixed: {v['adaptive'] / v['fixed']:.2f}x)",
                  fontsize=9)
    fig.suptitle("README performance table (numbers parsed from README.md; records in docs/benchmarks/)",
                 fontsize=9)
    fig.tight_layout()
    return _save(fig, out / "performance.png")


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def draw_all(out: Path) -> list[Path]:
    """Every figure into ``out``; returns their paths."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plot_demo_model import draw as draw_demo_model

    traces = [run_engine("refill", "threshold"), run_engine("no_refill", "threshold"), run_engine("refill", "fixed")]
    return [draw_architecture(out), draw_timeline(out, traces), draw_kv_planes(out, [2, 4, 1, 3, 2]),
            draw_performance(out),
            draw_demo_model(ROOT / "loopline" / "models" / "demo_ouro" / "exit_curve.json", out / "demo-model.png")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "images"), help="folder to write the PNGs into")
    ns = ap.parse_args()
    for path in draw_all(Path(ns.out)):
        print(path, f"{path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
