"""The documentation's figures: tools/draw_figures.py draws each one headless; every image the docs embed is
checked in and small, and each of the script's figures is embedded somewhere."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import draw_figures

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DRAWN = {"architecture.png", "cdb-timeline.png", "kv-planes.png", "performance.png", "demo-model.png"}


def _embedded() -> set[Path]:
    found = set()
    for doc in DOCS:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", doc.read_text()):
            found.add((doc.parent / target).resolve())
    return found


def test_every_embedded_image_is_checked_in_and_small_and_the_scripts_figures_are_embedded():
    images = _embedded()
    assert DRAWN <= {p.name for p in images}, DRAWN - {p.name for p in images}
    for path in images:
        assert path.is_file(), path
        assert path.stat().st_size < 200 * 1024, f"{path.name}: {path.stat().st_size} bytes (keep PNGs < 200 KB)"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_static_figures_draw_headless(tmp_path):
    from plot_demo_model import draw as draw_demo_model

    paths = [draw_figures.draw_architecture(tmp_path), draw_figures.draw_kv_planes(tmp_path, [2, 4, 1, 3]),
             draw_figures.draw_performance(tmp_path),
             draw_demo_model(ROOT / "loopline" / "models" / "demo_ouro" / "exit_curve.json", tmp_path / "d.png")]
    for path in paths:
        assert path.stat().st_size > 10_000, path


def test_performance_numbers_come_from_the_readme_table(tmp_path):
    v = draw_figures.readme_numbers()
    assert v["loopline c1"] == pytest.approx(257.1) and v["transformers quoted c1"] == pytest.approx(7.7)
    assert v["adaptive"] > v["fixed"] > 0
    broken = tmp_path / "README.md"
    broken.write_text("| workload | loopline | reference point |\n|---|---|---|\n"
                      "| 1024 in / 128 out, full depth, concurrency 1 | fast | slow |\n")
    with pytest.raises((ValueError, KeyError, StopIteration)):
        draw_figures.readme_numbers(broken)


def _trace(name: str, finished: dict[str, list[int]], depths: dict[str, list[int]]) -> draw_figures.Trace:
    return draw_figures.Trace(name, max(max(v) for v in finished.values()), finished, depths)


def test_timeline_cells_place_each_token_before_the_step_it_came_out():
    # two slots, prompts done at step 4; slot b's second token exits early and waits for its cohort
    trace = _trace("no_refill", {"a": [4, 7, 9], "b": [4, 5, 9]}, {"a": [2, 3, 2], "b": [2, 1, 2]})
    cells = {rid: {s: text for s, _, text in draw_figures._cells(trace, rid, 4)} for rid in "ab"}
    assert cells["a"] == {1: "1", 2: "2", 3: "3", 4: "4", 5: "1", 6: "2", 7: "3", 8: "1", 9: "2"}
    assert cells["b"] == {1: "1", 2: "2", 3: "3", 4: "4", 5: "1", 6: "", 7: "", 8: "1", 9: "2"}


@pytest.mark.slow  # three engine runs on the demo model: ~10-20 s on 2 busy cores
def test_timeline_from_real_engine_runs(tmp_path):
    refill = draw_figures.run_engine("refill", "threshold")
    no_refill = draw_figures.run_engine("no_refill", "threshold")
    fixed = draw_figures.run_engine("refill", "fixed")
    assert fixed.steps == 4 + 5 * 4  # prefill's 4 loops, then 5 more tokens of 4 loops each
    assert refill.steps <= no_refill.steps < fixed.steps
    assert refill.depths == no_refill.depths  # greedy: the mode changes when tokens run, not what they are
    assert draw_figures.draw_timeline(tmp_path, [refill, no_refill, fixed]).stat().st_size > 10_000
