"""tools/spec_speed.py (speculation's speed at both ends of acceptance, random weights) runs on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # four engines on the CPU: ~15-30 s
def test_spec_speed_bounds_acceptance_with_the_branch_scale(tmp_path):
    record = tmp_path / "spec.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "spec_speed.py"), "--config", "tiny", "--device", "cpu",
         "--dtype", "float32", "--branch-scale", "0.0,1.0", "--spec", "2,1,pinned", "--input-len", "8",
         "--output-len", "9", "--json", str(record)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads(record.read_text())["runs"]
    spec = {"K": 2, "d": 1, "pinned": True, "scheme": "draft_verify", "replayed": None, "draft_adapter": None}
    assert [(r["branch_scale"], r["spec"]) for r in runs] == [(0.0, None), (0.0, spec), (1.0, None), (1.0, spec)]
    assert all(r["max_running"] == 1 for r in runs)  # C = 1, and the default pool holds it
    plain, best, _, worst = runs
    assert plain["speedup"] == 1.0 and plain["acceptance_rate"] is None
    assert all(r["output_tokens"] == 2 * 9 for r in runs)  # two requests (2 x C) of 9 tokens each
    # no branch: the hidden state never changes across loops, every draft is accepted: a round of
    # (K+1) d + (R - d) = 6 steps commits K + 1 = 3 tokens, against R = 4 steps a token (prefill steps and the
    # last, cut round count too)
    assert best["acceptance_rate"] == 1.0 and best["steps_per_token"] < 0.7 * plain["steps_per_token"]
    assert worst["acceptance_rate"] < 0.5 and worst["steps_per_token"] > best["steps_per_token"]


@pytest.mark.slow  # eight engines on the CPU: ~30-60 s
def test_spec_speed_reports_a_kv_bound_batch_and_medians_over_repeats(tmp_path):
    """A pool of too few pages for C requests shows as max_running < C (a run labelled C=32 that ran 9
    requests at a time is not a C=32 measurement); --repeat alternates plain and speculative runs and prints
    the median speedup."""
    record = tmp_path / "spec.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "spec_speed.py"), "--config", "tiny", "--device", "cpu",
         "--dtype", "float32", "--spec", "2,1", "--input-len", "64", "--output-len", "4", "--concurrency", "4",
         "--kv-gb", "0.0003", "--repeat", "2", "--json", str(record)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads(record.read_text())["runs"]
    assert [(r["repeat"], r["spec"] is None) for r in runs] == [(0, True), (0, False), (1, True), (1, False)]
    assert all(1 <= r["max_running"] < 4 for r in runs), [r["max_running"] for r in runs]
    assert "KV-bound: below C" in out.stdout
    assert "median over 2 repeats: K=2 d=1" in out.stdout
