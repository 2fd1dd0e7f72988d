"""The verl recipe's framework-free pieces: per-sample rollout seeds (loopline/integrations/rollout_seed.py),
the per-iteration summary (tools/verl_grpo_summary.py) and its plots (tools/verl_grpo_plot.py). No verl."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.integrations.rollout_seed import prompt_key, rollout_seed

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rollout_seed_is_stable_and_keyed_by_every_field():
    base = rollout_seed(42, 7, 3, 1, prompt_key([{"role": "user", "content": "x = ("}]))
    # a fixed value: the seed must not depend on the process (Python's hash is salted) or change silently,
    # or a run resumed with a newer loopline would sample other rollouts than the run it continues
    assert base == rollout_seed(42, 7, 3, 1, '[{"content":"x = (","role":"user"}]')
    assert base == 580250464038307987
    assert 0 <= base < 2**63
    others = {rollout_seed(43, 7, 3, 1, "p"), rollout_seed(42, 8, 3, 1, "p"), rollout_seed(42, 7, 4, 1, "p"),
              rollout_seed(42, 7, 3, 2, "p"), rollout_seed(42, 7, 3, 1, "q"), rollout_seed(42, 7, 3, 1, "p", "val"),
              rollout_seed(42, 7, 3, 1, "p")}
    assert len(others) == 7
    with pytest.raises(ValueError, match="phase"):
        rollout_seed(0, 0, 0, 0, phase="test")


def test_prompt_key_is_canonical():
    np = pytest.importorskip("numpy")
    assert prompt_key(np.array([1, 2, 3])) == prompt_key([1, 2, 3]) == "[1,2,3]"
    assert prompt_key({"b": 1, "a": 2}) == prompt_key({"a": 2, "b": 1})


def _log(path: Path, steps: int, diff: float) -> Path:
    lines = [json.dumps({"step": s, "data": {"critic/score/mean": 0.5 + 0.01 * s, "training/rollout_probs_diff_mean": diff,
                                             "training/rollout_probs_diff_max": 10 * diff, "timing_s/step": 1.5,
                                             "timing_s/update_weights": 0.1, "other": 1}})
             for s in range(1, steps + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_summary_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "summary.json"
    for label, diff in (("fixed", 3e-4), ("adaptive", 4e-4), ("stock", 2e-2)):
        subprocess.run([sys.executable, str(ROOT / "tools/verl_grpo_summary.py"), str(_log(tmp_path / f"{label}.jsonl", 3, diff)),
                        "--label", label, "--out", str(out)], check=True, capture_output=True)
    summary = json.loads(out.read_text())
    assert list(summary) == ["fixed", "adaptive", "stock"]
    assert summary["stock"][2] == {"step": 3, "critic/score/mean": pytest.approx(0.53), "training/rollout_probs_diff_mean": 2e-2,
                                   "training/rollout_probs_diff_max": 0.2, "timing_s/step": 1.5, "timing_s/update_weights": 0.1}
    paths = _tool("verl_grpo_plot").draw(summary, tmp_path / "img", "run")
    assert [p.name for p in paths] == ["run_reward.png", "run_mismatch.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    only = _tool("verl_grpo_plot").draw(summary, tmp_path / "two", "run", runs=["stock", "fixed", "resumed"])
    assert len(only) == 2  # "resumed" is not in the summary: skipped
    with pytest.raises(ValueError, match="no runs"):
        _tool("verl_grpo_plot").draw({}, tmp_path / "img")
    with pytest.raises(ValueError, match=r"no runs to plot \(asked for \['x'\]\)"):
        _tool("verl_grpo_plot").draw(summary, tmp_path / "img", runs=["x"])


def test_summary_keeps_the_held_out_reward(tmp_path):
    """verl's validation (trainer.val_before_train, test_freq): a record of step 0 with only validation metrics,
    and val-core metrics merged into the iterations it ran after; the plot takes the largest mean@N."""
    key = "val-aux/loopline_python_closes/reward/mean@8"  # (a float reward: verl files it under val-aux)
    lines = [{"step": 0, "data": {key: 0.4, "val-aux/loopline_python_closes/reward/mean@1": 0.3,
                                  "val-aux/loopline_python_closes/reward/std@8": 0.1}},
             {"step": 1, "data": {"critic/score/mean": 0.5, "timing_s/step": 1.0}},
             {"step": 2, "data": {"critic/score/mean": 0.7, "timing_s/step": 1.0, key: 0.6,
                                  "val-aux/loopline_python_closes/reward/best@8/mean": 1.0}}]
    rows = _tool("verl_grpo_summary").summarize([json.dumps(line) for line in lines])
    assert rows[0] == {"step": 0, key: 0.4, "val-aux/loopline_python_closes/reward/mean@1": 0.3}
    assert rows[2] == {"step": 2, "critic/score/mean": 0.7, "timing_s/step": 1.0, key: 0.6}
    plot = _tool("verl_grpo_plot")
    assert plot.held_out_key(rows) == key
    assert plot.held_out_key(rows[1:2]) is None
    assert plot._series(rows, key) == ([0, 2], [0.4, 0.6])
    assert plot._series(rows, "critic/score/mean") == ([1, 2], [0.5, 0.7])


def test_resume_check_compares_the_samples_per_prompt(tmp_path):
    check = _tool("verl_grpo_resume_check")
    rows = [("x = (", "1)\n"), ("x = (", "2)\n"), ("def f(", "a):\n")]
    for run, outputs in (("a", ["1)\n", "2)\n", "a):\n"]), ("b", ["2)\n", "1)\n", "ab):\n"])):
        (tmp_path / run).mkdir()
        with open(tmp_path / run / "11.jsonl", "w") as f:
            # the dump's order is the run's uid order: the second run lists the first prompt's samples swapped
            for (prompt, _), out in zip(rows, outputs):
                f.write(json.dumps({"input": prompt, "output": out, "score": 1.0, "step": 11}) + "\n")
    gen = check.compare_generations(tmp_path / "a" / "11.jsonl", tmp_path / "b" / "11.jsonl")
    assert (gen["samples"], gen["resumed_samples"], gen["differing"]) == (3, 3, 1)
    assert gen["details"] == [{"prompt": "def f(", "chars": 4, "shared_prefix_chars": 1}]
    same = check.compare_generations(tmp_path / "a" / "11.jsonl", tmp_path / "a" / "11.jsonl")
    assert same["differing"] == 0 and same["details"] == []
