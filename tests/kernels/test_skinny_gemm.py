"""The split-K skinny GEMM against F.linear, and the MLP tail that uses it (CPU interpreter or GPU)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, DTYPES, close

from loopline.kernels import skinny_gemm
from loopline.kernels.fused import TritonOps
from loopline.kernels.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear
from loopline.models.ops import TorchOps


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_linear_matches_linear(rows, dtype):
    g = torch.Generator().manual_seed(2)
    k, n = 512, 96
    x = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)[:, :k]  # a strided view, as split halves are
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    want = torch.nn.functional.linear(x, weight)
    assert skinny_config(n, k).split_k > 1  # the rule splits this K: partials and the reduce run
    for cfg in (None, SkinnyConfig(64, 128, 1, 4, 2), SkinnyConfig(32, 128, 3, 4, 2)):  # 3 splits: a ragged tail
        close(skinny_linear(x, weight, cfg), want, dtype)
    with pytest.raises(AssertionError):  # the test can fail: a transposed-order weight is caught
        close(skinny_linear(x, weight.flip(1).contiguous()), want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the engine takes the kernel for 16-bit activations only")
def test_triton_ops_mlp_tail_uses_skinny_gemm_for_decode_batches(monkeypatch):
    import loopline.kernels.fused as fused

    mlp = torch.nn.Module()
    mlp.down_proj = torch.nn.Linear(256, 64, bias=False).to(DEVICE, torch.bfloat16)
    weight = mlp.down_proj.weight  # requires grad, as the engine's parameters do
    gate, up = torch.randn(2, 8, 256, device=DEVICE, dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(fused, "skinny_linear", lambda x, w: calls.append(x.shape[0]) or skinny_gemm.skinny_linear(x, w))
    with torch.inference_mode():  # how the engine runs the model
        got, want = TritonOps().swiglu_down(mlp, gate, up), TorchOps().swiglu_down(mlp, gate, up)
        big = torch.randn(skinny_gemm.MAX_ROWS + 1, 256, device=DEVICE, dtype=torch.bfloat16)
        assert not skinny_gemm.use_skinny(big, weight)
        assert not skinny_gemm.use_skinny(gate.float(), weight.float())
    assert calls == [8]
    close(got, want, torch.bfloat16)
    assert not skinny_gemm.use_skinny(gate, weight)  # autograd recording: the differentiable path
