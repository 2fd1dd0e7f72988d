"""A few token rows through the residual add, the RMSNorm and a projection, in one kernel (inference only).

A one-row decode step runs each layer's two norms inside its q/k/v and gate/up
GEMVs (:func:`loopline.kernels.gemv.norm_gemv`), every link of its chain launched
with programmatic dependent launch. A step of 2 to 16 rows runs them as kernels
of their own before cuBLAS GEMMs that have no PDL: per layer four more links
(two norms, the SwiGLU activation, the down projection's split-K reduction),
and an H200 step of 2 rows cost 1.50 ms against 0.93 ms for one row while
reading only one more row of K/V (``docs/benchmarks/h200-2026-12-04-fp8-kv.md``).

This kernel is :func:`norm_gemv`'s fusion for ``M <= MAX_ROWS`` rows with the
product on tensor cores (``tl.dot``, the rows padded to 16 as the MMA's narrow
operand, like :mod:`loopline.kernels.skinny_gemm`). Each program owns
``BLOCK_N`` weight rows over all of K (no split-K, no reduction launch): it
loads its first weight tile before its grid-dependency wait, then computes
every row's RMS statistics (and, with a branch, ``x' = x + rms_norm(b) * w_b``,
stored by program 0), and streams its weight rows against the normed rows,
recomputed chunk by chunk from the inputs (they are KBs and stay in L1/L2; the
weights are MBs). Rounding is :meth:`TorchOps.add_rms_norm`'s then one rounding
of the fp32 product, as ``F.linear``; the statistics are summed in ``BLOCK_K``
chunks, so they may differ from a whole-row sum in the last fp32 bits.

Off by default (``fused.FUSE_MAX_ROWS``, the setting that also moves the SwiGLU activation into
down_proj's skinny kernel, ``skinny_linear(..., up=...)``): unmeasured on a GPU when written.
``tools/profile_step.py --fuse-max-rows 16`` times whole steps with both.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, kernel_operands, pdl_options
from loopline.kernels.gemv import branch_added, check_norm_operands, norm_scaled

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernel is unusable without triton
    triton = None

MAX_ROWS = 16  # token rows a program holds (one MMA tile); more rows are a GEMM cuBLAS does well
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NormGemmConfig(NamedTuple):
    block_n: int  # weight rows per program (>= 16: the MMA's wide operand)
    block_k: int
    num_warps: int
    num_stages: int


# Launch (not tuned on a GPU; ``tools/profile_step.py --norm-gemm-config`` sweeps it): Ouro-1.4B's q/k/v
# (N = 6,144) gets 192 programs and gate/up (11,264) 352 on 132 SMs; 128-column K tiles, 4 stages in flight.
DEFAULT_CONFIG = NormGemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)


if triton is not None:

    @triton.jit
    def _x_chunk(x_ptr, b_ptr, wb_ptr, rows, row_ok, k, K, rb, stride_x, stride_b,
                 BLOCK_K: tl.constexpr, HAS_BRANCH: tl.constexpr, dtype: tl.constexpr):
        """Columns ``k .. k + BLOCK_K`` of ``x'`` (``[BLOCK_M, BLOCK_K]`` in ``dtype``, zeros past M and K):
        ``x + rms_norm(b) * wb`` rounded as the reference with HAS_BRANCH (``rb``: each row's 1 / RMS of b),
        else ``x``."""
        cols = k + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        m = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
        if HAS_BRANCH:
            b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
            wb = tl.load(wb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            x = branch_added(x, b, rb[:, None], wb[None, :], dtype)
        return x

    @triton.jit
    def _inv_rms(x_ptr, b_ptr, wb_ptr, rows, row_ok, K, rb, stride_x, stride_b, eps,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BRANCH: tl.constexpr, dtype: tl.constexpr):
        """Each row's ``1 / RMS`` of ``x'`` (HAS_BRANCH: from ``b`` with ``rb``), in fp32."""
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            v = _x_chunk(x_ptr, b_ptr, wb_ptr, rows, row_ok, k, K, rb, stride_x, stride_b, BLOCK_K, HAS_BRANCH,
                         dtype).to(tl.float32)
            acc += tl.sum(v * v, axis=1)
        return tl.rsqrt(acc / K + eps)

    @triton.jit
    def _w_tile(w_ptrs, offs_k, k, K, EVEN_K: tl.constexpr):
        if EVEN_K:
            return tl.load(w_ptrs + k, eviction_policy="evict_first")  # read once
        return tl.load(w_ptrs + k, mask=(offs_k + k < K)[None, :], other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _normed_chunk(x_ptr, b_ptr, wb_ptr, wn_ptr, rows, row_ok, k, K, rb, rx, stride_x, stride_b,
                      BLOCK_K: tl.constexpr, HAS_BRANCH: tl.constexpr, dtype: tl.constexpr):
        """``rms_norm(x') * wn`` over columns ``k .. k + BLOCK_K``, rounded as the reference, in ``dtype``."""
        x = _x_chunk(x_ptr, b_ptr, wb_ptr, rows, row_ok, k, K, rb, stride_x, stride_b, BLOCK_K, HAS_BRANCH,
                     dtype).to(tl.float32)
        cols = k + tl.arange(0, BLOCK_K)
        wn = tl.load(wn_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        return norm_scaled(x, rx[:, None], wn[None, :], dtype)

    @triton.jit
    def _norm_gemm_kernel(
        x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, w_ptr, y_ptr,  # rows [M, K]; norm weights [K]; W [N, K]; y [M, N]
        M, N, K, stride_x, stride_b, stride_xo, stride_wn, stride_y, eps,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        HAS_BRANCH: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        dtype = y_ptr.dtype.element_ty
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Weight rows past N are clamped, not masked (the loads stay wide); the store drops their results.
        w_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows = rows.to(tl.int64)
        # No earlier kernel writes the weights: the first tile streams in while they finish.
        w = _w_tile(w_ptrs, offs_k, 0, K, EVEN_K)
        grid_dependency_wait(PDL)
        rb = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if HAS_BRANCH:  # 1 / RMS of the branch: x' = x + rms_norm(b) * wb needs it first
            rb = _inv_rms(b_ptr, b_ptr, wb_ptr, rows, row_ok, K, rb, stride_b, stride_b, eps, BLOCK_M, BLOCK_K,
                          False, dtype)
        rx = _inv_rms(x_ptr, b_ptr, wb_ptr, rows, row_ok, K, rb, stride_x, stride_b, eps, BLOCK_M, BLOCK_K,
                      HAS_BRANCH, dtype)
        if HAS_BRANCH and pid == 0:  # x' itself, for the layer's next residual add
            for k in range(0, K, BLOCK_K):
                cols = k + offs_k
                tl.store(x_out_ptr + rows[:, None] * stride_xo + cols[None, :],
                         _x_chunk(x_ptr, b_ptr, wb_ptr, rows, row_ok, k, K, rb, stride_x, stride_b, BLOCK_K,
                                  HAS_BRANCH, dtype),
                         mask=row_ok[:, None] & (cols < K)[None, :])
        # W as the left operand: its rows are the MMA's M, so the K-contiguous tile needs no transpose, and the
        # token rows (padded to 16) are the narrow right operand. The first tile's product is the loop's first
        # step, peeled out of it.
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        xn = _normed_chunk(x_ptr, b_ptr, wb_ptr, wn_ptr, rows, row_ok, 0, K, rb, rx, stride_x, stride_b, BLOCK_K,
                           HAS_BRANCH, dtype)
        acc = tl.dot(w, tl.trans(xn), acc, input_precision=PRECISION)
        for k in range(BLOCK_K, K, BLOCK_K):
            w = _w_tile(w_ptrs, offs_k, k, K, EVEN_K)
            xn = _normed_chunk(x_ptr, b_ptr, wb_ptr, wn_ptr, rows, row_ok, k, K, rb, rx, stride_x, stride_b,
                               BLOCK_K, HAS_BRANCH, dtype)
            acc = tl.dot(w, tl.trans(xn), acc, input_precision=PRECISION)
        ptrs = y_ptr + rows[None, :] * stride_y + offs_n[:, None]
        tl.store(ptrs, acc.to(dtype), mask=row_ok[None, :] & (offs_n < N)[:, None])


def use_norm_gemm(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`norm_gemm` applies: 1 to ``MAX_ROWS`` contiguous rows, unit stride along K, no autograd."""
    return (triton is not None and kernel_operands(x, weight, _DTYPES) and 1 <= x.shape[0] <= MAX_ROWS
            and x.is_contiguous())


def norm_gemm(x: Tensor, weight: Tensor, norm_weight: Tensor, eps: float, *, branch: Tensor | None = None,
              branch_weight: Tensor | None = None, config: NormGemmConfig | None = None) -> tuple[Tensor, Tensor]:
    """``M <= MAX_ROWS`` rows through the residual add, the RMSNorm and a projection, in one kernel.

    Returns ``(x', y)``: ``x' = x + rms_norm(branch) * branch_weight`` (``x`` itself without ``branch``) and
    ``y = F.linear(rms_norm(x') * norm_weight, weight)``, rounded as :meth:`TorchOps.add_rms_norm` then
    ``F.linear`` (fp32 accumulation, one rounding)."""
    m, k = x.shape if x.dim() == 2 else (0, 0)
    n = weight.shape[0]
    if (x.dim() != 2 or not 1 <= m <= MAX_ROWS or not x.is_contiguous() or weight.dim() != 2
            or weight.shape[1] != k or weight.stride(1) != 1):
        raise ValueError(f"norm_gemm wants x [M, K] contiguous with 1 <= M <= {MAX_ROWS} and weight [N, K] with "
                         f"unit stride along K, got {tuple(x.shape)} / {tuple(weight.shape)}")
    check_norm_operands("norm_gemm", x, norm_weight, branch, branch_weight)
    cfg = config or DEFAULT_CONFIG
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    x_out = torch.empty_like(x) if branch is not None else x
    b = branch if branch is not None else x
    _norm_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, b, branch_weight if branch_weight is not None else norm_weight, norm_weight, x_out, weight, y,
        m, n, k, x.stride(0), b.stride(0), x_out.stride(0), weight.stride(0), y.stride(0), eps,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, HAS_BRANCH=branch is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl_options(x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return x_out, y


__all__ = ["DEFAULT_CONFIG", "MAX_ROWS", "NormGemmConfig", "norm_gemm", "use_norm_gemm"]
