"""tools/profile_step.py's resource report (``--resources``): the programs an SM a kernel's registers, shared
memory and warps allow (tools/sm90.py), and one line per compiled variant of each loopline Triton kernel."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import profile_step  # noqa: E402  (tools/ on the path first)
import sm90  # noqa: E402


def _fake_kernel(x_ptr):
    pass


def test_programs_per_sm_names_the_bound():
    assert sm90.programs_per_sm(255, 40 * 1024, 4) == (2, "registers")  # the FP8 128-key launch
    assert sm90.programs_per_sm(64, 100 * 1024, 4) == (2, "shared")
    assert sm90.programs_per_sm(24, 1024, 16) == (4, "warps")
    assert sm90.programs_per_sm(40, 1024, 1) == (32, "blocks")


def test_the_resource_report_lists_each_compiled_variant(monkeypatch, capsys):
    jit = pytest.importorskip("triton.runtime.jit")  # (a JITFunction also where TRITON_INTERPRET is set)
    fake_kernel = jit.JITFunction(_fake_kernel)

    compiled = types.SimpleNamespace(n_regs=128, n_spills=16,
                                     metadata=types.SimpleNamespace(shared=13 * 1024, num_warps=4, num_stages=2))
    monkeypatch.setattr(fake_kernel, "device_caches", {0: ({"key": compiled}, {}, None, None, None)}, raising=False)
    module = types.ModuleType("loopline._fake_kernels")
    module.fake_kernel = fake_kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    profile_step.print_kernel_resources()
    lines = [line for line in capsys.readouterr().out.splitlines() if "fake_kernel" in line]
    assert len(lines) == 1
    assert lines[0].split()[1:] == ["128", "regs", "16", "spilled", "13.0", "KB", "4", "warps", "2", "stages",
                                   "->", "4", "(registers)"]
