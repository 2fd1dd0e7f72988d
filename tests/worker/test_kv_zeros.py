"""The KV pool's allocation: zeroed, and on the CPU resident only where written."""
from __future__ import annotations

import gc
import sys

import pytest
import torch

from loopline.worker.model_runner import kv_zeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_is_zero_writable_and_keeps_its_pages(dtype):
    pool = kv_zeros((2, 3, 16, 2, 8), dtype, torch.device("cpu"))
    assert pool.shape == (2, 3, 16, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    gc.collect()  # the mapping must outlive the function that made it
    pool[1, 2] = 1.5
    assert pool[1, 2].eq(1.5).all() and pool.sum().item() == 1.5 * 16 * 2 * 8
    assert kv_zeros((0, 4), dtype, torch.device("cpu")).numel() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_pool_costs_memory_only_where_written():
    before = _resident_bytes()
    pool = kv_zeros((64, 1024, 1024), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _resident_bytes() - before < 16 << 20  # torch.zeros would make all 256 MiB resident here
    pool[0] = 1.0  # 4 MiB written
    assert 4 << 20 <= _resident_bytes() - before < 24 << 20
