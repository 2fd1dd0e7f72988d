"""tools/step_phases.py (the host-phase timer of a bench run) runs on the CPU and times every phase."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^\s+(.+?)\s+([\d.]+) ms/step\s+\((\d+) calls, ([\d.]+) s\)$")


@pytest.mark.slow  # the tool's process (~6-7 s on 2 cores); tests/bench/test_bench.py runs the bench it times
def test_step_phases_times_each_phase_of_the_measured_run():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "step_phases.py"), "--config", "tiny", "--device", "cpu",
         "--input-len", "8", "--output-len", "6", "--concurrency", "2", "--num-prompts", "3",
         "--depth-dist", "mean2.5", "--variants", "refill", "--repeats", "1", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    head, body = out.stdout.split("[refill trace]", 1)[1].split("\n", 1)
    steps = int(head.split()[0])
    phases = {m[1]: (float(m[2]), int(m[3])) for m in map(LINE.match, body.splitlines()) if m}
    for phase in ("schedule", "launch", "coda + sampling", "read (all)", "book tokens", "collect outputs", "step (all)"):
        assert phase in phases, (phase, sorted(phases))
    assert phases["step (all)"][1] == phases["schedule"][1] == steps > 0
    # the phases are parts of the step: none takes longer than the whole
    assert all(ms <= phases["step (all)"][0] for ms, _ in phases.values())
