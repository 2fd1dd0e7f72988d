"""tools/train_speed_gpu.sh in its CPU form: trains the smoke preset a few steps per backend and reports
the time per step between logged steps, the first steps (and any compile) left out."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the script's training processes (~10 s on 2 cores); default run: tests/train/test_trainer.py
# trains the smoke preset
def test_reports_ms_per_step_for_each_backend(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "tools" / "train_speed_gpu.sh"), str(tmp_path), "8", "smoke", "eager-loss"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "eager-loss rc=0" in run.stdout, run.stdout
    line = next(line for line in run.stdout.splitlines() if line.startswith("eager-loss: steps"))
    assert re.match(r"eager-loss: steps 2-6: \d+\.\d ms/step; step 0 done at [\d.]+ s", line), line
    assert (tmp_path / "model-eager-loss" / "config.json").is_file()
