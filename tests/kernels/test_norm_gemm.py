"""The few-row add + RMSNorm + projection kernel (loopline.kernels.norm_gemm) against the reference, its PDL
launch, and the TritonOps route that takes it (CPU interpreter or GPU)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, bf16_dot_in_the_interpreter, close, one_layer

import loopline.kernels.fused as fused
from loopline.kernels import norm_gemm as ng
from loopline.kernels.fused import TritonOps
from loopline.kernels.norm_gemm import MAX_ROWS, NormGemmConfig, norm_gemm, use_norm_gemm
from loopline.kernels.skinny_gemm import skinny_linear
from loopline.models.ops import TorchOps

F = torch.nn.functional
PRODUCT_DTYPES = [torch.float32, torch.bfloat16]


def _case(rows: int, k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, b = (torch.randn(rows, k, generator=g).to(DEVICE, dtype) for _ in range(2))
    wb, wn = ((torch.rand(k, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, b, wb, wn, weight


def _reference(dtype: torch.dtype) -> TorchOps:
    """TorchOps; in the interpreter (which truncates fp32 -> bf16 casts) bf16 is checked against the add +
    RMSNorm kernel, which rounds the same way (itself checked against TorchOps in test_fused)."""
    return TorchOps() if dtype == torch.float32 or DEVICE == "cuda" else TritonOps()


@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
# rows: 2 and a full 16-row tile (and one row, which the engine gives norm_gemv); k: ragged K tails (masked)
# and an even one over several tiles; n: a clamped last column block
@pytest.mark.parametrize("rows,k,n", [(2, 256, 70), (5, 200, 33), (16, 128, 40), (1, 96, 8)])
def test_norm_gemm_is_add_rms_norm_then_the_product(dtype, rows, k, n):
    x, b, wb, wn, weight = _case(rows, k, n, dtype, seed=rows + k + n)
    ref = _reference(dtype)
    x_ref, normed = ref.add_rms_norm(x, b, wb, wn, 1e-6)
    with bf16_dot_in_the_interpreter():
        x_out, y = norm_gemm(x, weight, wn, 1e-6, branch=b, branch_weight=wb)
        # another launch: 16-row blocks, 64-column K tiles (more programs, more K steps)
        close(norm_gemm(x, weight, wn, 1e-6, branch=b, branch_weight=wb, config=NormGemmConfig(16, 64, 4, 2))[1],
              y, dtype)
        same, y_plain = norm_gemm(x, weight, wn, 1e-6)
        wrong = norm_gemm(x, weight.flip(1).contiguous(), wn, 1e-6, branch=b, branch_weight=wb)[1]
    close(x_out, x_ref, dtype)
    close(y, F.linear(normed.float(), weight.float()), dtype)
    assert same is x
    close(y_plain, F.linear(ref.rms_norm(x, wn, 1e-6).float(), weight.float()), dtype)
    with pytest.raises(AssertionError):  # the test can fail: the columns in reverse order are caught
        close(wrong, y, dtype)


def test_pdl_launch_waits_in_every_program(monkeypatch):
    """Every program passes the grid-dependency wait once (loads its first weight tile before it); with the
    wait a no-op the results are those of the launch without PDL (same sums, same order). On the GPU: PDL as
    launched (on Hopper) against LOOPLINE_PDL=0."""
    x, b, wb, wn, weight = _case(3, 200, 70, torch.float32, seed=4)
    monkeypatch.setenv("LOOPLINE_PDL", "0")
    plain = norm_gemm(x, weight, wn, 1e-6, branch=b, branch_weight=wb)
    monkeypatch.delenv("LOOPLINE_PDL")
    waits = []
    if DEVICE != "cuda":
        monkeypatch.setattr(ng, "pdl_options", lambda device: {"PDL": True, "launch_pdl": True})
        monkeypatch.setattr(ng, "grid_dependency_wait", lambda pdl: waits.append(bool(pdl)))
    early = norm_gemm(x, weight, wn, 1e-6, branch=b, branch_weight=wb)
    for a, e in zip(plain, early, strict=True):
        assert torch.equal(a, e)
    if DEVICE != "cuda":
        assert waits == [True] * -(-70 // ng.DEFAULT_CONFIG.block_n)


def test_norm_gemm_rejects_bad_operands():
    x, b, wb, wn, weight = _case(2, 64, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match=f"1 <= M <= {MAX_ROWS}"):
        norm_gemm(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), weight, wn, 1e-6)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        norm_gemm(torch.zeros(2, 32, device=DEVICE), weight, wn, 1e-6)
    with pytest.raises(ValueError, match="come together"):
        norm_gemm(x, weight, wn, 1e-6, branch=b)
    with pytest.raises(ValueError, match="branch must be"):
        norm_gemm(x, weight, wn, 1e-6, branch=b[:, :32], branch_weight=wb)
    with pytest.raises(ValueError, match="norm_weight must be"):
        norm_gemm(x, weight, wn[:32], 1e-6)
    assert use_norm_gemm(x, weight) and not use_norm_gemm(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), weight)
    assert not use_norm_gemm(torch.zeros(4, 128, device=DEVICE)[:, :64], weight)  # rows must be contiguous
    with pytest.raises(ValueError, match="fuse_max_rows"):
        TritonOps(fuse_max_rows=MAX_ROWS + 1)


def test_fuse_max_rows_from_the_environment(monkeypatch):
    monkeypatch.delenv("LOOPLINE_FUSE_MAX_ROWS", raising=False)  # (a measurement's setting must not leak in)
    assert TritonOps().fuse_max_rows == fused.FUSE_MAX_ROWS == 0
    monkeypatch.setenv("LOOPLINE_FUSE_MAX_ROWS", "8")
    assert TritonOps().fuse_max_rows == 8 and TritonOps(fuse_max_rows=4).fuse_max_rows == 4  # the argument wins
    for bad, match in (("eight", "LOOPLINE_FUSE_MAX_ROWS must be an integer"), ("99", "fuse_max_rows must be in")):
        monkeypatch.setenv("LOOPLINE_FUSE_MAX_ROWS", bad)
        with pytest.raises(ValueError, match=match):
            TritonOps()


@pytest.mark.parametrize("dtype", [PRODUCT_DTYPES[0], pytest.param(PRODUCT_DTYPES[1], marks=pytest.mark.slow)])
def test_triton_ops_fuse_the_norm_into_few_row_projections(monkeypatch, dtype):
    """With fuse_max_rows, the layer's add + RMSNorm rides the packed q/k/v and gate/up products of 2 to
    that many rows (with and without the residual branch) and the activation rides down_proj's skinny kernel,
    equal to TorchOps; one row keeps the GEMVs, more rows (or the default 0) the norm kernel then the product
    and the activation kernel before down_proj. (bf16 in the interpreter: against the norm kernel
    then the product, see _reference.)"""
    assert fused.FUSE_MAX_ROWS == 0  # off until measured on a GPU (see fused.py)
    monkeypatch.delenv("LOOPLINE_FUSE_MAX_ROWS", raising=False)  # `off` below is the default
    g = torch.Generator().manual_seed(3)
    hidden, inter = 96, 160
    model, attn, mlp = one_layer(hidden, 96, 32, inter, dtype, g)
    ref, fast, off = _reference(dtype), TritonOps(fuse_max_rows=8), TritonOps()
    calls, downs = [], []
    monkeypatch.setattr(fused, "norm_gemm", lambda x, w, *a, **kw: calls.append((x.shape[0], w.shape[0]))
                        or norm_gemm(x, w, *a, **kw))
    monkeypatch.setattr(fused, "skinny_linear", lambda x, w, *a, **kw: downs.append((x.shape[0], "up" in kw))
                        or skinny_linear(x, w, *a, **kw))
    wn, wb = ((torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    with torch.inference_mode(), bf16_dot_in_the_interpreter():
        for rows in (2, 8, 9):
            x, b = (torch.randn(rows, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
            for ops, limit in ((fast, 8), (off, 0)):
                ops.prepare(model)
                calls.clear()
                for branch, branch_weight in ((None, None), (b, wb)):
                    got_x, got = ops.norm_project_qkv(attn, x, branch, branch_weight, wn, 1e-6)
                    want_x, want = ref.norm_project_qkv(attn, x, branch, branch_weight, wn, 1e-6)
                    close(got_x, want_x, dtype)
                    for a, e in zip(got, want, strict=True):
                        close(a, e, dtype)
                got_x, got = ops.norm_project_gate_up(mlp, x, b, wb, wn, 1e-6)
                want_x, want = ref.norm_project_gate_up(mlp, x, b, wb, wn, 1e-6)
                close(got_x, want_x, dtype)
                for a, e in zip(got, want, strict=True):
                    close(a, e, dtype)
                want_down = ref.swiglu_down(mlp, *want)
                downs.clear()
                close(ops.swiglu_down(mlp, *want), want_down, dtype)
                ops.release(model)
                fused_here = rows <= limit
                assert calls == ([(rows, 160), (rows, 160), (rows, 2 * inter)] if fused_here else []), rows
                assert downs == [(rows, fused_here)], rows  # down_proj: skinny either way, the activation inside
