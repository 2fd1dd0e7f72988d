"""Weight buckets across processes of one host: CUDA tensors as CUDA IPC handles, as plain bytes.

A trainer's bucket of ``(name, tensor)`` pairs must reach an engine in another process (verl's
server actor, reached over Ray). :func:`pack_bucket` turns each CUDA tensor into the bytes of
torch's sharing reduction (an IPC handle, its offset and size: the receiver maps the sender's
memory, nothing goes through the host) and leaves CPU tensors to the transport's own
serialization; :func:`unpack_bucket` rebuilds the tensors in the receiving process, on the same
physical device. The sender must keep its tensors alive until the receiver is done with them
(await the call that consumes the bucket), and both processes must see that device.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's sharing reductions with ForkingPickler)


@dataclass(frozen=True)
class CudaIpcTensor:
    """A CUDA tensor pickled with torch's sharing reductions: an IPC handle, not the data."""

    data: bytes


def pack_bucket(bucket: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """CUDA tensors become :class:`CudaIpcTensor`; everything else is left as it is."""
    return [(n, CudaIpcTensor(bytes(ForkingPickler.dumps(t))) if isinstance(t, torch.Tensor) and t.is_cuda else t)
            for n, t in bucket]


def unpack_bucket(bucket: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The tensors of a packed bucket (CUDA ones mapped from the sender's memory)."""
    return [(n, pickle.loads(t.data) if isinstance(t, CudaIpcTensor) else t) for n, t in bucket]
