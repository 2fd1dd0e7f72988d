"""Shared setup of the Triton kernel tests: the GPU when there is one, else Triton's CPU interpreter.

Import it before triton or any loopline kernel module: Triton reads ``TRITON_INTERPRET``
when a kernel is decorated. CPU cases are fp32 only (the interpreter mis-computes
``tl.dot`` on bf16 operands); bf16 runs on the GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal within fp32 rounding for fp32, within bf16 rounding otherwise."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
