"""tools/filter_cut_cost.py runs on the CPU (Triton's interpreter) and reports, for every filter case, that the
cuts keep exactly the tokens the torch filters keep."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the tool's process (~8 s on 2 cores); the cuts it checks are tested in test_sampling_kernels.py
def test_filter_cut_cost_checks_every_case():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "filter_cut_cost.py"), "--rows", "2", "--vocab", "1500"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("B=2 ")]
    assert len(lines) == 5 and all("same=True" in line for line in lines), out.stdout
