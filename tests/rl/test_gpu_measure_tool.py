"""tools/rl_gpu_measure.py (run on an H200 by hand) still runs: a tiny CPU pass prints its JSON line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the tool's process (~10 s on 2 cores); it measures what tests/rl tests
def test_rl_gpu_measure_runs_on_cpu():
    cmd = [sys.executable, str(ROOT / "tools" / "rl_gpu_measure.py"), "--config", "tiny", "--device", "cpu",
           "--prompts", "4", "--input-len", "16", "--output-len", "8", "--bucket-mb", "0.01,1",
           "--trainer-dtypes", "float32", "--repeats", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny model: threads only contend on small CI machines
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["output_tok_s"]) == {"None", "0", "5"} and all(v > 0 for v in result["output_tok_s"].values())
    assert result["update_from_memory_s"] >= 0 and result["update_from_disk_s"] >= 0
    assert result["generates_after_update"]
    # (d): every route x source x bucket size published (and the in-process ones moved the version on)
    rows = {(r["route"], r["source"], r["bucket_mib"]) for r in result["bucketed"]}
    assert rows == {(route, source, mb) for route in ("in_process", "engine_process")
                    for source in ("cpu", "device", "device_gathered") for mb in (0.01, 1.0)}
    assert all(r["downtime_s"] > 0 and r["trainer_dtype"] == "float32" for r in result["bucketed"])
    small = {r["buckets"] for r in result["bucketed"] if r["bucket_mib"] == 0.01}
    big = {r["buckets"] for r in result["bucketed"] if r["bucket_mib"] == 1.0}
    assert min(small) > max(big) >= 1  # a tiny bucket splits the update into more calls
    assert result["version_after"] == 2 + 6  # 2 full updates, then 3 sources x 2 bucket sizes in process
