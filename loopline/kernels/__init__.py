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


_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def kernel_operands(x: torch.Tensor, weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _KERNEL_DTYPES) -> bool:
    """Whether ``x @ weight.T`` may take a decode-sized Triton matmul: 2-D operands of one dtype
    (16-bit by default), unit stride along K, and no autograd being recorded."""
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if x.dtype not in dtypes or weight.dtype != x.dtype:
        return False
    # Parameters keep requires_grad under inference_mode; only recorded autograd rules a kernel out.
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
