"""Shared fixtures: tiny checkpoints built once per session with the project's own helper."""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

torch.set_num_threads(1)  # tiny models: threads only add contention on small CI machines
# Without a GPU, Triton kernels run in its CPU interpreter, which Triton reads when a kernel is decorated:
# set here, before any test module imports a kernel, so that any subset of the tests sees one mode.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6") if sys.platform == "linux" else None
    except OSError:  # another libc (musl)
        return None


_LIBC = _glibc()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module():
    """Engines, servers and models of a finished module are garbage; glibc keeps the freed heap, so without a
    trim every worker's RSS only grows (two workers' together past 5 GB on CI, where the budget is 4 GB)."""
    yield
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class Tiny:
    """A tiny checkpoint on disk plus what the independent reference needs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cfg = json.loads((path / "config.json").read_text())
        self.state_dict = load_file(str(path / "model.safetensors"))

    def llm(self, **kwargs):
        from loopline import LLM

        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        return LLM(str(self.path), **kwargs)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict[tuple, Tiny] = {}

    def make(seed: int = 0, **overrides) -> Tiny:
        key = (seed, tuple(sorted(overrides.items())))
        if key not in cache:
            from loopline.models.tiny import make_tiny_checkpoint

            path = tmp_path_factory.mktemp("tiny")
            make_tiny_checkpoint(path, seed=seed, **overrides)
            cache[key] = Tiny(path)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_gqa(tiny_factory) -> Tiny:
    return tiny_factory(0)


@pytest.fixture(scope="session")
def tiny_mha(tiny_factory) -> Tiny:
    return tiny_factory(1, num_key_value_heads=4, total_ut_steps=3, num_hidden_layers=1)
