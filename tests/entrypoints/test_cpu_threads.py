"""``--cpu-threads``: the default thread count and its precedence (flag, then OMP_NUM_THREADS, then
one less than the usable CPUs), issue #45."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loopline.entrypoints.cli_args import default_cpu_threads


@pytest.mark.parametrize("physical, usable, expected", [
    (2, 2, 1),     # the busy 2-core machine of the issue: torch's 2 threads collapsed there
    (1, 1, 1),     # never below one
    (16, 16, 15),  # one core left for the Python side and other processes
    (8, 16, 8),    # hyperthreads: never above torch's own default (physical cores)
    (16, 4, 3),    # a CPU affinity mask (taskset, a container's cpuset) bounds it
])
def test_default_cpu_threads(physical, usable, expected):
    assert default_cpu_threads(physical, usable) == expected


_PROBE = """
import sys, torch
from loopline.entrypoints.cli_args import apply_cpu_threads, default_cpu_threads
initial = torch.get_num_threads()
default = default_cpu_threads(initial)
got = apply_cpu_threads(None if sys.argv[1] == "none" else int(sys.argv[1]))
print(initial, default, got, torch.get_num_threads())
"""


def _probe(flag: str, omp: str | None) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    r = subprocess.run([sys.executable, "-c", _PROBE, flag], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


@pytest.mark.slow  # three python processes importing torch (~12 s on 2 cores); default run: the default's rule
# above, and the CLI tests run apply_cpu_threads (--stats prints cpu_threads)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="torch caps OMP_NUM_THREADS at the core count")
def test_precedence_flag_then_omp_num_threads_then_default():
    initial, default, got, now = _probe("none", None)
    assert got == now == default == default_cpu_threads(initial)  # nothing set: the default
    _, _, got, now = _probe("none", "2")
    assert got == now == 2  # OMP_NUM_THREADS set explicitly: honoured as torch read it
    _, _, got, now = _probe("1", "2")
    assert got == now == 1  # the flag wins over the environment
