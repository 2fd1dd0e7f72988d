"""Fused Triton layer ops vs the reference ops (CPU under TRITON_INTERPRET=1, GPU when present)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from loopline.kernels.fused import TritonOps  # noqa: E402
from loopline.models.ops import TorchOps  # noqa: E402
from loopline.models.ouro import rotary_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(DEVICE, dtype)
    b = torch.randn(5, 48, generator=g).to(DEVICE, dtype) * 3
    w1 = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    w2 = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    ref, fused = TorchOps(), TritonOps()
    close(fused.rms_norm(x, w1, 1e-6), ref.rms_norm(x, w1, 1e-6), dtype)
    (xr, yr), (xf, yf) = ref.add_rms_norm(x, b, w1, w2, 1e-6), fused.add_rms_norm(x, b, w1, w2, 1e-6)
    close(xf, xr, dtype)
    close(yf, yr, dtype)
    with pytest.raises(AssertionError):  # the test can fail: a wrong weight is caught
        close(fused.add_rms_norm(x, b, w2, w2, 1e-6)[1], yr, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 4, 16, generator=g).to(DEVICE, dtype)
    k = torch.randn(6, 2, 16, generator=g).to(DEVICE, dtype)
    cos, sin = rotary_cos_sin(torch.arange(3, 9, device=DEVICE), 16, 10000.0, dtype)
    (qr, kr), (qf, kf) = TorchOps.rotary(q, k, cos, sin), TritonOps().rotary(q, k, cos, sin)
    close(qf, qr, dtype)
    close(kf, kr, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 1500, generator=g).to(DEVICE, dtype)
    b = torch.randn(3, 1500, generator=g).to(DEVICE, dtype)
    close(TritonOps().silu_mul(a, b), TorchOps.silu_mul(a, b), dtype)


def test_autograd_falls_back_to_reference():
    x = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE)
    TritonOps().rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None
