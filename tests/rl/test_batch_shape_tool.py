"""tools/batch_shape_tokens.py (run on a GPU by hand): on the CPU in fp32 the same seeded requests sample the same
tokens all at once, in reverse order and one at a time (batched runs must equal serial ones)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the tool's process loads the demo model and runs 18 generate calls (~10 s on 2 cores)
def test_batch_shapes_do_not_change_tokens_on_the_cpu(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "tools" / "batch_shape_tokens.py"), "--device", "cpu", "--dtype", "float32",
           "--copies", "2", "--max-tokens", "6", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["samples"] == 16
    assert result["reverse"] == {"differing": 0, "first_differing_token": []}
    assert result["alone"] == {"differing": 0, "first_differing_token": []}
