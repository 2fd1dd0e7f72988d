"""One-row matmul ``y = x @ W.T``, optionally with the SwiGLU activation fused (inference only).

At concurrency 1 a decode step multiplies one token row by every weight matrix
of the stack, so the step is the time to stream 2.5 GB of weights plus the
launches between them. cuBLAS reads Ouro-1.4B's shapes at 1.4-3.4 TB/s at one
row on an H200 (``tools/bench_gemm.py --gemv``). This kernel is a plain
multiply-reduce (an MMA would pad the one row 16-fold): each program owns
``BLOCK_N`` weight rows, accumulates ``w * x`` elementwise in fp32 over K and
reduces once. It measured 1.06x (gate/up) to 1.52x (o_proj) cuBLAS.

With ``up`` the kernel computes ``silu(gate) * up`` while loading the row
(free at one row: the row is KBs, the weights MBs), so the MLP's down
projection needs no separate activation kernel: 8.6 vs 12.7 us for
``silu_mul`` + cuBLAS. Rounding follows :class:`loopline.models.ops.TorchOps`.

On Hopper the kernel is launched with programmatic dependent launch
(:func:`loopline.kernels.pdl_options`): its programs start while the kernel
before still runs and load their first weight tile, which nothing in the step
writes, before they wait for the input row. A decode step's GEMVs then
overlap the tails of the attention and norm kernels between them.

(Also measured and not kept: splitting K across programs, summed in-kernel by
the last split, never won; fusing the residual add + RMSNorm before q/k/v and
gate/up into the load gained 1.06x / 0.99x, as every program re-reads the row
twice for its statistics first.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, kernel_operands, pdl_options

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernel is unusable without triton
    triton = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if triton is not None:

    @triton.jit
    def _weight_tile(w_rows, k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        cols = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            return tl.load(w_rows + cols[None, :], eviction_policy="evict_first")  # read once
        return tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _row_chunk(x_ptr, u_ptr, k, K, BLOCK_K: tl.constexpr, SILU: tl.constexpr, dtype: tl.constexpr):
        """Columns ``k .. k + BLOCK_K`` of the input row in fp32 (``silu(gate) * up`` with SILU)."""
        cols = k + tl.arange(0, BLOCK_K)
        m = cols < K
        x = tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if SILU:  # silu(gate) rounded like F.silu, then the product rounded, as TorchOps.silu_mul
            act = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
            x = (act * tl.load(u_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        return x

    @triton.jit
    def _gemv_kernel(
        x_ptr, u_ptr, w_ptr, y_ptr, needed_ptr,  # x [K] (and up [K] for SILU), W [N, K] (unit last stride), y [N]
        N, K, stride_wn,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SILU: tl.constexpr,
        PREDICATED: tl.constexpr,  # needed_ptr: one int8 flag; 0 writes zeros without reading W
        PDL: tl.constexpr,
    ):
        dtype = y_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past N are clamped, not masked: they re-read a valid row, the loads stay unpredicated and
        # wide, and the store drops their results.
        w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PDL and not PREDICATED:
            # No earlier kernel writes the weights: the first tile streams in while they finish.
            w = _weight_tile(w_rows, 0, K, BLOCK_K, EVEN_K)
            grid_dependency_wait(PDL)
            acc += w.to(tl.float32) * _row_chunk(x_ptr, u_ptr, 0, K, BLOCK_K, SILU, dtype)[None, :]
        else:
            grid_dependency_wait(PDL)
            if PREDICATED:
                if tl.load(needed_ptr) == 0:
                    tl.store(y_ptr + rows, tl.zeros((BLOCK_N,), dtype=dtype), mask=rows < N)
                    return
        for k in range(BLOCK_K if PDL and not PREDICATED else 0, K, BLOCK_K):
            w = _weight_tile(w_rows, k, K, BLOCK_K, EVEN_K)
            acc += w.to(tl.float32) * _row_chunk(x_ptr, u_ptr, k, K, BLOCK_K, SILU, dtype)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(dtype), mask=rows < N)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Whole decode steps on an H200 (``tools/profile_step.py --rows 1 --gemv-config``, PDL on, CUDA graph replay):
# 4 weight rows x 2,048 columns per program, 8 warps, gave 1.245 ms against 1.357 ms for the 4 x 1,024 launch
# that was best kernel by kernel (``tools/bench_gemm.py --gemv``): with K = 2,048 a program's whole weight
# streams in before it waits for the row. Of twelve launches, 4 warps gave 1.262 ms, 2 or 8 rows 1.28-1.35 ms,
# and 4,096 columns or 16 warps 1.66-2.13 ms; 1 or 2 pipeline stages made no difference.
DEFAULT_CONFIG = GemvConfig(block_n=4, block_k=2048, num_warps=8, num_stages=2)
# Launches for particular weight shapes ``(N, K)``, where whole-step measurements found one better than the default.
SHAPE_CONFIGS: dict[tuple[int, int], GemvConfig] = {}


def use_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`gemv` applies: one row, unit stride along K, no autograd. fp32 too: with no MMA
    the kernel is exact to fp32 rounding there, so fp32 engine tests check the path as served."""
    return triton is not None and kernel_operands(x, weight, _DTYPES) and x.shape[0] == 1


def gemv(x: Tensor, weight: Tensor, *, up: Tensor | None = None, needed: Tensor | None = None,
         config: GemvConfig | None = None) -> Tensor:
    """``F.linear(x, weight)`` for one row ``x`` ``[1, K]`` and ``weight`` ``[N, K]``; with ``up`` given,
    ``F.linear(silu(x) * up, weight)`` (the MLP's down projection, activation computed on load).

    ``needed``: a one-element bool tensor on the device; where it is False the kernel returns zeros
    without reading the weight (the coda of a decode row whose token does not exit this loop)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv wants x [1, K] and weight [N, K] with unit stride along K, got "
                         f"{tuple(x.shape)} / {tuple(weight.shape)}")
    if up is not None and (up.shape != x.shape or up.stride(1) != 1):
        raise ValueError(f"gemv's up must be shaped like x {tuple(x.shape)} with unit stride, got {tuple(up.shape)}")
    if needed is not None and (needed.numel() != 1 or needed.dtype != torch.bool):
        raise ValueError(f"gemv's needed must be one bool, got {needed.dtype} {tuple(needed.shape)}")
    n, k = weight.shape
    cfg = config or SHAPE_CONFIGS.get((n, k), DEFAULT_CONFIG)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, up if up is not None else x, weight, y, needed.view(torch.int8) if needed is not None else x,
        n, k, weight.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SILU=up is not None,
        PREDICATED=needed is not None, **pdl_options(x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


__all__ = ["DEFAULT_CONFIG", "SHAPE_CONFIGS", "GemvConfig", "gemv", "use_gemv"]
