"""tools/stream_host_cost.py (the output path's host cost per token along one streamed completion) runs on
the CPU, times every part of the path and gives every token its own chunk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the tool's process (~8-10 s on 2 cores); the streaming path it times is tested in tests/entrypoints
def test_stream_host_cost_times_each_part_in_each_window(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "stream_host_cost.py"), "--max-tokens", "96", "--window", "32",
         "--repeats", "1", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    (run,) = result["runs"]
    assert run["chunks"] == run["tokens"] == 96  # one chunk per token: the engine waited for each
    for window in ("start", "middle", "end"):
        parts = run["windows"][window]
        assert all(parts[p] > 0 for p in ("engine", "transport", "client", "event loop", "control"))
        assert abs(parts["total"] - sum(parts[p] for p in ("engine", "transport", "client", "event loop"))) < 1e-6
    assert "EngineClient._on_message" in result["timed"] and "end/start" in out.stdout
