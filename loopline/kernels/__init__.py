"""Fused GPU kernels for inference (Triton)."""
from __future__ import annotations

import functools

import torch


def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (looked up once per device), for launch grids."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
