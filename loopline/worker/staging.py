"""Host arrays to the device in one pinned transfer, without waiting for the device.

A copy from pageable host memory makes the CUDA driver synchronize the stream
before it starts, so every ``torch.tensor(list, device="cuda")`` on the hot path
stalls the host until the GPU has drained its queue: the host and the device
then take turns instead of overlapping. :func:`stage` packs a step's small
arrays into one pinned buffer (torch's caching host allocator keeps it alive
until the copy has run) and issues one asynchronous copy; the results are
views of one device buffer.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_ALIGN = 16  # bytes: every view starts aligned for any element type


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up so that the next array in a packed buffer starts aligned for any dtype."""
    return -(-nbytes // _ALIGN) * _ALIGN


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype, for views of a packed byte buffer."""
    return _TORCH_DTYPES[np.dtype(dtype)]


def _as_array(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], (type, np.dtype)):
        return np.asarray(a[0], dtype=a[1])
    return np.asarray(a)


def stage(device: torch.device, *arrays) -> list[Tensor]:
    """Device copies of ``arrays`` (numpy arrays, or ``(values, numpy dtype)`` pairs).

    On CUDA: one pinned buffer, one non-blocking copy. Elsewhere: plain tensors.
    """
    host = [np.ascontiguousarray(_as_array(a)) for a in arrays]
    if not host:
        return []
    if device.type != "cuda":
        return [torch.from_numpy(a.copy()).to(device) for a in host]
    offsets, total = [], 0
    for a in host:
        offsets.append(total)
        total += aligned(a.nbytes)
    pinned = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    buf = pinned.numpy()
    for a, off in zip(host, offsets):
        buf[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = pinned.to(device, non_blocking=True)
    return [dev[off:off + a.nbytes].view(torch_dtype(a.dtype)).view(a.shape) for a, off in zip(host, offsets)]


_TORCH_DTYPES = {np.dtype(k): v for k, v in {
    np.bool_: torch.bool, np.int8: torch.int8, np.uint8: torch.uint8, np.int16: torch.int16, np.int32: torch.int32,
    np.int64: torch.int64, np.float16: torch.float16, np.float32: torch.float32, np.float64: torch.float64,
}.items()}


def concat(parts: list[Tensor]) -> Tensor:
    """The step's parts as one tensor; a single part as it is (``torch.cat`` would copy it: a launch)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
