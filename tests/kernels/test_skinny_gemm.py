"""The split-K skinny GEMM against F.linear, its launch with programmatic dependent launch, and the decode-batch
projections of TritonOps that take it (CPU interpreter or GPU)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, bf16_dot_in_the_interpreter, close, one_layer

import loopline.kernels.fused as fused
from loopline.kernels import skinny_gemm
from loopline.kernels.fused import TritonOps
from loopline.kernels.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear
from loopline.models.ops import TorchOps

# bf16 on the CPU too: the interpreter's tl.dot is given bf16 operands as numbers (bf16_dot_in_the_interpreter).
PRODUCT_DTYPES = [torch.float32, torch.bfloat16]
# A split K (the default rule at K = 512: partials and the reduce run), one program per column block, and a
# ragged third split that runs past K.
CONFIGS = [None, SkinnyConfig(64, 128, 1, 4, 2), SkinnyConfig(32, 128, 3, 4, 2)]


def _operands(rows: int, dtype: torch.dtype, k: int = 512, n: int = 96, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dtype)[:, :k]  # a strided view, as split halves are
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, weight


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
def test_skinny_linear_matches_linear(rows, dtype):
    x, weight = _operands(rows, dtype)
    want = torch.nn.functional.linear(x, weight)
    assert skinny_config(*weight.shape).split_k > 1  # the rule splits this K: partials and the reduce run
    with bf16_dot_in_the_interpreter():
        for cfg in CONFIGS:
            close(skinny_linear(x, weight, cfg), want, dtype)
        with pytest.raises(AssertionError):  # the test can fail: a transposed-order weight is caught
            close(skinny_linear(x, weight.flip(1).contiguous()), want, dtype)


@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
def test_pdl_launch_gives_the_same_bits(monkeypatch, dtype):
    """With PDL the first weight tile's product is peeled out of the K loop (loaded before the wait): the same
    sums in the same order as without. On the CPU the interpreter cannot run the grid dependency instructions,
    so the wait is a recorder: every program of both kernels passes it (the order of the wait and the loads in
    the compiled kernel is tests/kernels/test_pdl.py's). On the GPU: PDL as launched (on Hopper) against
    LOOPLINE_PDL=0."""
    x, weight = _operands(7, dtype)
    waits = []
    with bf16_dot_in_the_interpreter():
        monkeypatch.setenv("LOOPLINE_PDL", "0")
        plain = [skinny_linear(x, weight, cfg) for cfg in CONFIGS]
        monkeypatch.delenv("LOOPLINE_PDL")
        if DEVICE != "cuda":
            assert skinny_gemm.pdl_options(x.device) == {"PDL": False, "launch_pdl": False}  # as the CPU launches
            monkeypatch.setattr(skinny_gemm, "pdl_options", lambda device: {"PDL": True, "launch_pdl": True})
            monkeypatch.setattr(skinny_gemm, "grid_dependency_wait", lambda pdl: waits.append(bool(pdl)))
        early = [skinny_linear(x, weight, cfg) for cfg in CONFIGS]
    for cfg, a, b in zip(CONFIGS, plain, early, strict=True):
        assert torch.equal(a, b), cfg
    close(early[0], torch.nn.functional.linear(x, weight), dtype)
    if DEVICE != "cuda":
        n, k = weight.shape
        programs = 0
        for cfg in CONFIGS:
            cfg = cfg or skinny_config(n, k)
            programs += -(-n // cfg.block_n) * cfg.split_k + (7 * -(-n // 1024) if cfg.split_k > 1 else 0)
        assert waits == [True] * programs


# ~4 s a dtype: one in the default run
@pytest.mark.parametrize("dtype", [PRODUCT_DTYPES[0], pytest.param(PRODUCT_DTYPES[1], marks=pytest.mark.slow)])
def test_triton_ops_give_decode_batches_projections_to_the_skinny_kernel(monkeypatch, dtype):
    """2 to skinny_max_rows rows: packed q/k/v (also behind the layer's add + RMSNorm), o_proj and packed gate/up
    take the skinny kernel, as down_proj does, and equal TorchOps. Hidden 96 (K past the last 128-column tile:
    masked), q/k/v 160 rows (a clamped column block), down_proj K = 512 (split K, the reduce). More rows, or
    skinny_max_rows=0, take cuBLAS for all but down_proj (skinny up to 64 rows); each projection keeps its own
    limit (SkinnyRows); one row takes the GEMVs (test_gemv.py)."""
    assert fused.SKINNY_MAX_ROWS == fused.SkinnyRows(qkv=16, o=16)  # the measured default (see fused.py)
    g = torch.Generator().manual_seed(7)
    hidden, inter = 96, 512
    model, attn, mlp = one_layer(hidden, 96, 32, inter, dtype, g)
    mixed_rows = fused.SkinnyRows(qkv=16, gate_up=0, o=3)
    # (products summed by their reduction kernel, so they compare as tensors: the default hands a split-K
    # product to the norm that reads it, test_split_sums_in_the_norm_give_the_same_bits)
    ref, fast, off, mixed = (TorchOps(), TritonOps(skinny_max_rows=16, split_sums_in_norm=False),
                             TritonOps(0, split_sums_in_norm=False), TritonOps(mixed_rows, split_sums_in_norm=False))
    assert fast.skinny_max_rows == 16 and off.skinny_max_rows == 0 and mixed.skinny_rows == mixed_rows
    calls = []
    monkeypatch.setattr(fused, "skinny_linear", lambda x, w, **kw: calls.append((x.shape[0], tuple(w.shape)))
                        or skinny_linear(x, w, **kw))
    qkv, o, gate_up, down = (160, hidden), (hidden, 96), (2 * inter, hidden), (hidden, inter)
    wn = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
    with torch.inference_mode(), bf16_dot_in_the_interpreter():  # how the engine runs the model
        for rows in (2, 3, 8, 16, 17):
            x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
            for ops, limits in ((fast, fused.SkinnyRows(16, 16, 16)), (off, fused.SkinnyRows()), (mixed, mixed_rows)):
                ops.prepare(model)
                calls.clear()
                for got, want in zip(ops.project_qkv(attn, x), ref.project_qkv(attn, x), strict=True):
                    close(got, want, dtype)
                got_x, got = ops.norm_project_qkv(attn, x, None, None, wn, 1e-6)
                want_x, want = ref.norm_project_qkv(attn, x, None, None, wn, 1e-6)
                assert got_x is x
                for a, e in zip(got, want, strict=True):
                    close(a, e, dtype)
                close(ops.linear(attn.o_proj, x), ref.linear(attn.o_proj, x), dtype)
                gate, up = ops.project_gate_up(mlp, x)
                gate_r, up_r = ref.project_gate_up(mlp, x)
                close(gate, gate_r, dtype)
                close(up, up_r, dtype)
                close(ops.swiglu_down(mlp, gate, up), ref.swiglu_down(mlp, gate_r, up_r), dtype)
                ops.release(model)
                routes = ((qkv, limits.qkv), (qkv, limits.qkv), (o, limits.o), (gate_up, limits.gate_up))
                taken = [(rows, w) for w, limit in routes if 2 <= rows <= limit]
                assert calls == taken + [(rows, down)], (rows, limits)
        big = torch.randn(skinny_gemm.MAX_ROWS + 1, hidden, device=DEVICE, dtype=dtype)
        assert not skinny_gemm.use_skinny(big, attn.o_proj.weight)
        assert not skinny_gemm.use_skinny(x.double(), attn.o_proj.weight.double())
    assert not skinny_gemm.use_skinny(x, attn.o_proj.weight)  # autograd recording: the differentiable path
    with pytest.raises(ValueError, match="skinny_max_rows"):
        TritonOps(skinny_max_rows=skinny_gemm.MAX_ROWS + 1)
    with pytest.raises(ValueError, match=r"skinny_max_rows \(o\) must be in 0\.\.64"):
        TritonOps(fused.SkinnyRows(o=skinny_gemm.MAX_ROWS + 1))
    assert fused.SkinnyRows.parse("8") == fused.SkinnyRows(8, 8, 8)
    assert fused.SkinnyRows.parse("qkv=16,o=4") == fused.SkinnyRows(qkv=16, gate_up=0, o=4)
    with pytest.raises(ValueError, match="unknown projection"):
        fused.SkinnyRows.parse("down=4")


@pytest.mark.parametrize("dtype", PRODUCT_DTYPES)
def test_split_sums_in_the_norm_give_the_same_bits(dtype):
    """``TritonOps()`` (``split_sums_in_norm=True``, the default): o_proj and down_proj return their split-K partials unsummed and
    the add + RMSNorm (and the loop's last norm with the exit gate) sums them on load: the same bits as the
    reduction kernel then the norm. o_proj and down_proj have K = 512 here (two splits)."""
    g = torch.Generator().manual_seed(11)
    hidden, inter = 96, 512
    model, attn, mlp = one_layer(hidden, 512, 32, inter, dtype, g)
    plain, folded = TritonOps(skinny_max_rows=16, split_sums_in_norm=False), TritonOps(skinny_max_rows=16)
    gate_lin = torch.nn.Linear(hidden, 1).to(DEVICE, dtype)
    wb, wn = ((1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype) for _ in range(2))
    with torch.inference_mode(), bf16_dot_in_the_interpreter():
        for rows in (2, 5, 16, 17):
            res = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
            o_in = torch.randn(rows, 512, generator=g).to(DEVICE, dtype)
            gate, up = (torch.randn(rows, inter, generator=g).to(DEVICE, dtype) for _ in range(2))
            want_o, got_o = plain.linear(attn.o_proj, o_in), folded.linear(attn.o_proj, o_in)
            want_d, got_d = plain.swiglu_down(mlp, gate, up), folded.swiglu_down(mlp, gate, up)
            # 17 rows: o_proj takes cuBLAS (a tensor); down_proj the skinny kernel up to 64 rows
            assert isinstance(got_o, skinny_gemm.SplitKPartials) == (rows <= 16)
            assert isinstance(got_d, skinny_gemm.SplitKPartials) and got_d.shape == (rows, hidden)
            for a, b in zip(plain.add_rms_norm(res, want_o, wb, wn, 1e-6),
                            folded.add_rms_norm(res, got_o, wb, wn, 1e-6), strict=True):
                assert torch.equal(a, b), rows
            for a, b in zip(plain.norm_exit_gate(gate_lin, res, want_d, wb, wn, 1e-6),
                            folded.norm_exit_gate(gate_lin, res, got_d, wb, wn, 1e-6), strict=True):
                assert torch.equal(a, b), rows
            reference = TorchOps().add_rms_norm(res, torch.nn.functional.linear(o_in, attn.o_proj.weight), wb, wn,
                                                1e-6)
            close(plain.add_rms_norm(res, want_o, wb, wn, 1e-6)[1], reference[1], dtype)
        # the test can fail: a split left out is caught
        parts = folded.linear(attn.o_proj, o_in[:16]).parts
        short = skinny_gemm.SplitKPartials(parts[:1])
        assert not torch.equal(folded.add_rms_norm(res[:16], short, wb, wn, 1e-6)[1],
                               plain.add_rms_norm(res[:16], plain.linear(attn.o_proj, o_in[:16]), wb, wn, 1e-6)[1])
