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
         "--output-len", "9", "--kv-gb", "0.05", "--json", str(record)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads(record.read_text())["runs"]
    assert [(r["branch_scale"], r["spec"]) for r in runs] == [
        (0.0, None), (0.0, {"K": 2, "d": 1, "pinned": True}), (1.0, None), (1.0, {"K": 2, "d": 1, "pinned": True})]
    plain, best, _, worst = runs
    assert plain["speedup"] == 1.0 and plain["acceptance_rate"] is None
    assert all(r["output_tokens"] == 2 * 9 for r in runs)  # two requests (2 x C) of 9 tokens each
    # no branch: the hidden state never changes across loops, every draft is accepted: a round of
    # (K+1) d + (R - d) = 6 steps commits K + 1 = 3 tokens, against R = 4 steps a token (prefill steps and the
    # last, cut round count too)
    assert best["acceptance_rate"] == 1.0 and best["steps_per_token"] < 0.7 * plain["steps_per_token"]
    assert worst["acceptance_rate"] < 0.5 and worst["steps_per_token"] > best["steps_per_token"]
