"""tools/attention_resources.py compiles each decode kernel for sm_90 on the CPU and reports what bounds its
programs an SM (the figures depend on the Triton version: only their consistency is checked here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


@pytest.mark.slow  # three sm_90 compiles (~10 s on 2 cores)
def test_each_decode_kernel_compiles_for_sm90_and_reports_its_bound():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    for kernel, launch in (("paged", "32,4,2"), ("fused", "64,4,1,4"), ("mha", "16,1,0")):
        out = subprocess.run([sys.executable, str(ROOT / "tools" / "attention_resources.py"), "--kv", "fp8",
                              "--kernel", kernel, launch], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        line = out.stdout.strip().splitlines()[-1]
        regs, by_regs = int(line.split()[1]), int(line.split("programs per SM ")[1].split()[0])
        warps = int(launch.split(",")[1])
        assert 24 <= regs <= 255 and by_regs == 65536 // (regs * 32 * warps), line
