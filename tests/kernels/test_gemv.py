"""The one-row GEMV, its fused SwiGLU activation and its fused add + RMSNorm against the reference ops
(CPU interpreter or GPU)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, DTYPES, bf16_dot_in_the_interpreter, close, one_layer

from loopline.kernels.gemv import GemvConfig, gemv, norm_gemv, use_gemv, use_norm_gemv
from loopline.models.ops import TorchOps

F = torch.nn.functional
# No tl.dot here, so the interpreter multiplies bf16 right too; it truncates fp32 -> bf16 casts, though,
# so the SwiGLU activation's rounding is checked in bf16 on the GPU only.
PRODUCT_DTYPES = [torch.float32, torch.bfloat16]
CONFIGS = [None, GemvConfig(8, 64, 4, 1), GemvConfig(16, 128, 2, 2)]


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The product in fp32 of the (rounded) operands: what a kernel accumulating in fp32 should give."""
    return F.linear(x.float(), weight.float())


def _weight(k: int, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
# k: a ragged K tail (masked loads) and an even one. cfg1's 64-wide K blocks over K = 2048 take ~5-7 s a dtype in
# the interpreter: slow; the even K runs with the other two configurations and cfg1 on the ragged K by default
@pytest.mark.parametrize("k, cfg", [pytest.param(k, cfg, id=f"{k}-{'None' if cfg is None else f'cfg{i}'}",
                                                 marks=[pytest.mark.slow] if (k, i) == (2048, 1) else [])
                                    for i, cfg in enumerate(CONFIGS) for k in (320, 2048)])
def test_gemv_matches_linear(dtype, cfg, k):
    g = torch.Generator().manual_seed(k)
    n = 72  # not a multiple of the row blocks: clamped rows, masked store
    weight = _weight(k, n, dtype, g)
    x = torch.randn(1, 2 * k, generator=g).to(DEVICE, dtype)[:, :k]  # a view with a row stride, as split halves
    close(gemv(x, weight, config=cfg), _reference(x, weight), dtype)
    with pytest.raises(AssertionError):  # the test can fail: a weight in the wrong order is caught
        close(gemv(x, weight.flip(1).contiguous(), config=cfg), _reference(x, weight), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gemv_silu_is_the_mlp_tail(dtype, cfg):
    g = torch.Generator().manual_seed(1)
    k, n = 384, 40
    weight = _weight(k, n, dtype, g)
    gate, up = torch.randn(1, 2 * k, generator=g).mul(3).to(DEVICE, dtype).split([k, k], dim=-1)
    close(gemv(gate, weight, up=up, config=cfg), _reference(TorchOps.silu_mul(gate, up), weight), dtype)


def test_gemv_rejects_bad_shapes_and_applies_to_one_row():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(torch.zeros(2, 16), w)
    with pytest.raises(ValueError, match="up must be shaped like x"):
        gemv(torch.zeros(1, 16), w, up=torch.zeros(1, 8))
    bf = w.to(torch.bfloat16)
    with torch.inference_mode():
        assert use_gemv(torch.zeros(1, 16, dtype=torch.bfloat16), bf)
        assert not use_gemv(torch.zeros(2, 16, dtype=torch.bfloat16), bf)
        assert use_gemv(torch.zeros(1, 16), w)
        assert not use_gemv(torch.zeros(1, 16, dtype=torch.float64), w.double())
        assert not use_gemv(torch.zeros(1, 16), bf)
    assert not use_gemv(torch.zeros(1, 16, dtype=torch.bfloat16), bf.requires_grad_())  # autograd: reference path


def test_triton_ops_take_gemv_for_one_row_only(monkeypatch):
    import loopline.kernels.fused as fused
    from loopline.kernels.fused import TritonOps

    g = torch.Generator().manual_seed(3)
    model, attn, mlp = one_layer(64, 64, 64, 96, torch.bfloat16, g)  # q/k/v 64 each, MLP 96, bf16
    fast, ref = TritonOps(), TorchOps()
    fast.prepare(model)
    calls = []
    monkeypatch.setattr(fused, "gemv", lambda x, w, **kw: calls.append(w.shape) or gemv(x, w, **kw))
    with torch.inference_mode(), bf16_dot_in_the_interpreter():  # three rows take the skinny GEMM's bf16 tl.dot
        for rows in (1, 3):
            x = torch.randn(rows, 64, generator=g).to(DEVICE, torch.bfloat16)
            for got, want in zip(fast.project_qkv(attn, x), ref.project_qkv(attn, x)):
                close(got, want, torch.bfloat16)
            close(fast.linear(attn.o_proj, x), ref.linear(attn.o_proj, x), torch.bfloat16)
            gate, up = fast.project_gate_up(mlp, x)
            close(fast.swiglu_down(mlp, gate, up), ref.swiglu_down(mlp, *ref.project_gate_up(mlp, x)),
                  torch.bfloat16)
    # one row: packed q/k/v, o_proj, packed gate/up, down with the activation; three rows: none
    assert calls == [(192, 64), (64, 64), (192, 64), (64, 96)]


@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
def test_gemv_needed_flag_skips_the_weight(dtype):
    g = torch.Generator().manual_seed(4)
    weight = _weight(256, 72, dtype, g)
    x = torch.randn(1, 256, generator=g).to(DEVICE, dtype)
    yes, no = (torch.tensor([f], device=DEVICE) for f in (True, False))
    close(gemv(x, weight, needed=yes), _reference(x, weight), dtype)
    assert torch.equal(gemv(x, weight, needed=no), torch.zeros(1, 72, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match="needed must be one bool"):
        gemv(x, weight, needed=torch.ones(2, dtype=torch.bool, device=DEVICE))


def test_gemv_out_dtype_rounds_like_the_operands_first():
    g = torch.Generator().manual_seed(6)
    weight = _weight(256, 72, torch.bfloat16, g)
    x = torch.randn(1, 256, generator=g).to(DEVICE, torch.bfloat16)
    yes, no = (torch.tensor([f], device=DEVICE) for f in (True, False))
    wide = gemv(x, weight, needed=yes, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, gemv(x, weight, needed=yes).float())  # bf16 rounding, then exact in fp32
    assert not torch.equal(wide, _reference(x, weight))  # the test can fail: unrounded sums differ
    assert torch.equal(gemv(x, weight, needed=no, out_dtype=torch.float32), torch.zeros(1, 72, device=DEVICE))
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        gemv(x, weight, out_dtype=torch.int32)


def test_one_row_logits_are_computed_only_when_needed():
    from loopline.kernels.fused import TritonOps

    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(64, 200, bias=False).to(DEVICE, torch.bfloat16)
    head.weight.data = _weight(64, 200, torch.bfloat16, g)
    h = torch.randn(1, 64, generator=g).to(DEVICE, torch.bfloat16)
    with torch.inference_mode():
        want = TorchOps.logits(head, h)
        assert want.dtype == torch.float32
        close(TritonOps().logits(head, h, torch.tensor([True], device=DEVICE)), want, torch.bfloat16)
        assert not TritonOps().logits(head, h, torch.tensor([False], device=DEVICE)).any()
        two = torch.cat([h, h])  # more rows: every row computed, flags or not
        close(TritonOps().logits(head, two, torch.tensor([False, True], device=DEVICE)), want.expand(2, -1),
              torch.bfloat16)


def _norm_case(k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, b = (torch.randn(1, k, generator=g).to(DEVICE, dtype) for _ in range(2))
    wb, wn = ((torch.rand(k, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    return x, b, wb, wn, _weight(k, n, dtype, g)


@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
@pytest.mark.parametrize("k,n", [(64, 40), (48, 7), (256, 130), (2048, 24)])  # ragged K, N past the blocks
def test_norm_gemv_is_add_rms_norm_then_the_product(dtype, k, n):
    """x' and the product of rms_norm(x') against TorchOps; without a branch, x passes through untouched.
    N spans several blocks per program (three programs in the interpreter), some programs one more.
    The interpreter truncates fp32 -> bf16 casts, so there bf16 is checked against the add + RMSNorm
    kernel, which rounds the same way (itself checked against TorchOps in test_fused)."""
    from loopline.kernels.fused import TritonOps

    x, b, wb, wn, weight = _norm_case(k, n, dtype, seed=k + n)
    ref = TorchOps() if dtype == torch.float32 or DEVICE == "cuda" else TritonOps()
    x_ref, normed = ref.add_rms_norm(x, b, wb, wn, 1e-6)
    x_out, y = norm_gemv(x, weight, wn, 1e-6, branch=b, branch_weight=wb)
    close(x_out, x_ref, dtype)
    close(y, _reference(normed, weight), dtype)
    same, y_plain = norm_gemv(x, weight, wn, 1e-6)
    assert same is x
    close(y_plain, _reference(ref.rms_norm(x, wn, 1e-6), weight), dtype)


def test_norm_gemv_rejects_bad_operands():
    x, b, wb, wn, weight = _norm_case(64, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        norm_gemv(torch.zeros(2, 64, device=DEVICE), weight, wn, 1e-6)
    with pytest.raises(ValueError, match="K <= 2048"):
        norm_gemv(torch.zeros(1, 4096, device=DEVICE), torch.zeros(8, 4096, device=DEVICE), None, 1e-6)
    with pytest.raises(ValueError, match="come together"):
        norm_gemv(x, weight, wn, 1e-6, branch=b)
    with pytest.raises(ValueError, match="branch must be"):
        norm_gemv(x, weight, wn, 1e-6, branch=b[:, :32], branch_weight=wb)
    with pytest.raises(ValueError, match="norm_weight must be"):
        norm_gemv(x, weight, wn[:32], 1e-6)
    assert use_norm_gemv(x, weight) and not use_norm_gemv(torch.zeros(2, 64, device=DEVICE), weight)
    assert not use_norm_gemv(torch.zeros(1, 4096, device=DEVICE), torch.zeros(8, 4096, device=DEVICE))


def test_triton_ops_fuse_the_norm_into_one_row_projections(monkeypatch):
    """norm_project_qkv / norm_project_gate_up take norm_gemv at one row (with and without a branch) and the
    reference's add + RMSNorm, then the projection, at three; both agree with TorchOps."""
    import loopline.kernels.fused as fused
    from loopline.kernels.fused import TritonOps

    g = torch.Generator().manual_seed(5)
    model, attn, mlp = one_layer(64, 64, 64, 96, torch.bfloat16, g)  # q/k/v 64 each, MLP 96, bf16
    fast, ref = TritonOps(), TorchOps()
    fast.prepare(model)
    calls = []
    monkeypatch.setattr(fused, "norm_gemv", lambda x, w, *a, **kw: calls.append((w.shape, "branch" in kw and
                                                                                 kw["branch"] is not None))
                        or norm_gemv(x, w, *a, **kw))
    wb, wn = ((torch.rand(64, generator=g) + 0.5).to(DEVICE, torch.bfloat16) for _ in range(2))
    with torch.inference_mode(), bf16_dot_in_the_interpreter():  # three rows: the skinny GEMM's bf16 tl.dot
        for rows in (1, 3):
            x, b = (torch.randn(rows, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
            for branch in (None, b):
                got_x, got = fast.norm_project_qkv(attn, x, branch, None if branch is None else wb, wn, 1e-6)
                want_x, want = ref.norm_project_qkv(attn, x, branch, None if branch is None else wb, wn, 1e-6)
                close(got_x, want_x, torch.bfloat16)
                for a, e in zip(got, want, strict=True):
                    close(a, e, torch.bfloat16)
            got_x, (gate, up) = fast.norm_project_gate_up(mlp, x, b, wb, wn, 1e-6)
            want_x, (gate_r, up_r) = ref.norm_project_gate_up(mlp, x, b, wb, wn, 1e-6)
            close(got_x, want_x, torch.bfloat16)
            close(gate, gate_r, torch.bfloat16)
            close(up, up_r, torch.bfloat16)
    assert calls == [((192, 64), False), ((192, 64), True), ((192, 64), True)]
