"""What a benchmark record says about where it ran, and device-time measurement.

GPU idle fraction (CUDA only; ``None`` on CPU), two methods:

* ``events`` (default): a CUDA event is recorded before and after every engine
  step (HF baseline: every forward); busy time is the sum of the spans between
  each pair. A span also covers gaps *inside* a step where the GPU waits for the
  host (launches, host-side scheduling), so busy time is an upper bound and
  ``idle = 1 - busy / wall`` a **lower bound** on the true idle fraction: it counts
  only the time between steps.
* ``profiler`` (``--profile-kernels``): ``torch.profiler`` records every GPU
  kernel and copy; busy time is the union of their intervals, which is the exact
  idle fraction, at the price of profiler overhead on the measured run.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from loopline.bench.metrics import interval_union_s


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether it has local changes (``LOOPLINE_GIT_COMMIT`` overrides)."""
    override = os.environ.get("LOOPLINE_GIT_COMMIT")
    if override:
        return {"commit": override, "dirty": None, "source": "LOOPLINE_GIT_COMMIT"}
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "source": "unavailable"}
    return {"commit": commit, "dirty": bool(status.strip()), "source": "git"}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_count=torch.cuda.device_count(), cuda=torch.version.cuda)
    else:
        info["gpu"] = None
    return info


#: Environment variables that change what the engine runs without a flag (timing hooks of tools/gpu_session.sh)
TIMING_HOOKS = ("LOOPLINE_DECODE_LAUNCH", "LOOPLINE_SPLIT_RULE")


def software_info() -> dict[str, Any]:
    """Versions, and the timing hooks set in the environment (a run under one is not the defaults' run)."""
    import transformers

    hooks = {name: os.environ[name] for name in TIMING_HOOKS if os.environ.get(name)}
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), **({"timing_hooks": hooks} if hooks else {})}


class DeviceTimer:
    """Device busy time of a measured run (see the module docstring). No-op on CPU."""

    def __init__(self, device: torch.device, method: str = "events") -> None:
        self.enabled = device.type == "cuda"
        self.method = method if self.enabled else None
        self._pairs: list[tuple[Any, Any]] = []
        self._prof: Any = None

    # --- run bracket ---------------------------------------------------------------------
    def start(self) -> None:
        if self.method == "profiler":
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.__enter__()

    def stop(self) -> None:
        if self.enabled:
            torch.cuda.synchronize()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)

    # --- per step (events method) ---------------------------------------------------------
    def before_step(self) -> None:
        if self.method == "events":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs.append((ev, None))

    def after_step(self) -> None:
        if self.method == "events":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs[-1] = (self._pairs[-1][0], ev)

    def busy_s(self) -> float | None:
        """Device busy seconds (call after ``stop``); None on CPU."""
        if not self.enabled:
            return None
        if self.method == "events":
            return sum(a.elapsed_time(b) for a, b in self._pairs if b is not None) / 1e3
        from torch.autograd import DeviceType

        return profiled_busy_s(self._prof, DeviceType.CUDA)

    def kernel_table(self, top: int = 30) -> list[dict[str, Any]] | None:
        """Device time per kernel name, largest first (profiler method only; call after ``stop``)."""
        if self._prof is None:
            return None
        from torch.autograd import DeviceType

        return profiled_kernels(self._prof, DeviceType.CUDA, top)


def profiled_kernels(prof: Any, device_type: Any, top: int) -> list[dict[str, Any]]:
    """The ``top`` activities on ``device_type`` by total time: name, total ms, calls, mean us."""
    totals: dict[str, list[float]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == device_type:
            t = totals.setdefault(e.name(), [0.0, 0])
            t[0] += e.duration_ns()
            t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name[:120], "total_ms": ns / 1e6, "calls": int(n), "mean_us": ns / n / 1e3} for name, (ns, n) in rows]


def profiled_busy_s(prof: Any, device_type: Any) -> float:
    """Union of the intervals of every profiled activity on ``device_type`` (kernels, copies), in seconds."""
    events = prof.profiler.kineto_results.events()
    return interval_union_s([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.device_type() == device_type])
