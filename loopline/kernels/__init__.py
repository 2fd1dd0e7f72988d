"""Fused GPU kernels for inference (Triton)."""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are unusable without triton
    triton = None
try:  # grid dependency control (Triton >= 3.3); without it kernels launch the ordinary way
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (looked up once per device), for launch grids."""
    return _sm_count(_index(device))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options for a kernel that calls :func:`grid_dependency_wait`: programmatic dependent
    launch (PDL) on Hopper and newer GPUs, off elsewhere and with ``LOOPLINE_PDL=0``.

    A decode step at small batch is a chain of ~200 short kernels, each of which ramps up only after
    the one before has drained. With PDL a kernel's programs start while the previous kernel's last
    ones still run, and may read what nothing earlier writes (weights) before they wait; the wait
    makes everything earlier kernels wrote visible. The kernel's ``PDL`` constant and the launch
    attribute always come together from here, so a kernel never launches early without waiting."""
    on = (gdc_wait is not None and device.type == "cuda" and os.environ.get("LOOPLINE_PDL", "1") != "0"
          and _capability(_index(device))[0] >= 9)
    return {"PDL": on, "launch_pdl": on}


if triton is not None:

    @triton.jit
    def grid_dependency_wait(PDL: tl.constexpr):
        """With PDL: let the next kernel launch, then wait until the kernels before this one have finished
        and their writes are visible. Every program of a PDL kernel calls it before it reads anything an
        earlier kernel wrote, writes anything, or returns: a kernel finishes only after its wait, which
        keeps the ordering transitive along the chain."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
else:  # pragma: no cover
    grid_dependency_wait = None


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
