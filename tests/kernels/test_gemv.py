"""The one-row GEMV and its fused prologues against the reference ops (CPU interpreter or GPU)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, DTYPES, close

from loopline.kernels.gemv import GemvConfig, gemv, use_gemv
from loopline.models.ops import TorchOps

F = torch.nn.functional
CONFIGS = [None, GemvConfig(8, 64, 1, 4, 1), GemvConfig(4, 64, 3, 2, 1), GemvConfig(16, 128, 2, 4, 2)]


def _inputs(k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return g, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gemv_matches_linear(dtype, cfg):
    k, n = 320, 72  # K not a multiple of the tiles, N not of the row blocks: masked tails
    g, weight = _inputs(k, n, dtype)
    x = torch.randn(1, 2 * k, generator=g).to(DEVICE, dtype)[:, :k]
    close(gemv(x, weight, config=cfg), F.linear(x, weight), dtype)
    for _ in range(2):  # split-K counters are left at zero: a second launch sums correctly too
        close(gemv(x, weight, config=cfg), F.linear(x, weight), dtype)
    with pytest.raises(AssertionError):  # the test can fail: a weight in the wrong order is caught
        close(gemv(x, weight.flip(1).contiguous(), config=cfg), F.linear(x, weight), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_gemv_silu_prologue_is_the_mlp_tail(dtype, cfg):
    k, n = 384, 40
    g, weight = _inputs(k, n, dtype, seed=1)
    gate, up = torch.randn(1, 2 * k, generator=g).mul(3).to(DEVICE, dtype).split([k, k], dim=-1)
    want = F.linear(TorchOps.silu_mul(gate, up), weight)
    close(gemv(gate, weight, up=up, config=cfg), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_gemv_add_norm_prologue_is_the_sandwich_residual(dtype, cfg):
    k, n = 256, 96
    g, weight = _inputs(k, n, dtype, seed=2)
    x, branch = torch.randn(2, 1, k, generator=g).mul(4).to(DEVICE, dtype)
    wb, wn = (1 + 0.1 * torch.randn(2, k, generator=g)).to(DEVICE, dtype)
    want_x, normed = TorchOps().add_rms_norm(x, branch, wb, wn, 1e-6)
    x_out = torch.empty_like(x)
    got = gemv(x, weight, branch=branch, branch_weight=wb, norm_weight=wn, eps=1e-6, x_out=x_out, config=cfg)
    assert torch.equal(x_out, want_x)  # the residual is the reference's, bit for bit
    close(got, F.linear(normed, weight), dtype)


def test_gemv_rejects_bad_shapes_and_gates_on_one_16_bit_row():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(torch.zeros(2, 16), w)
    with pytest.raises(ValueError, match="x_out"):
        gemv(torch.zeros(1, 16), w, branch=torch.zeros(1, 16))
    bf = w.to(torch.bfloat16)
    with torch.inference_mode():
        assert use_gemv(torch.zeros(1, 16, dtype=torch.bfloat16), bf)
        assert not use_gemv(torch.zeros(2, 16, dtype=torch.bfloat16), bf)
        assert not use_gemv(torch.zeros(1, 16), w)
