"""tools/rl_gpu_measure.py (run on an H200 by hand) still runs: a tiny CPU pass prints its JSON line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rl_gpu_measure_runs_on_cpu():
    cmd = [sys.executable, str(ROOT / "tools" / "rl_gpu_measure.py"), "--config", "tiny", "--device", "cpu",
           "--prompts", "4", "--input-len", "16", "--output-len", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny model: threads only contend on small CI machines
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["output_tok_s"]) == {"None", "0", "5"} and all(v > 0 for v in result["output_tok_s"].values())
    assert result["update_from_memory_s"] >= 0 and result["update_from_disk_s"] >= 0
    assert result["version_after"] == 2 and result["generates_after_update"]
