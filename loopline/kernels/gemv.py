"""One-row matmul ``y = x @ W.T``, optionally with the SwiGLU activation or the add + RMSNorm fused (inference only).

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

:func:`norm_gemv` is the same product with the layer's residual add + RMSNorm
in front (q/k/v and gate/up at one row), on a fixed grid of programs that each
walk several row blocks: a program computes the norm once, after its wait, and
keeps the next block's weight load in flight while it reduces the current one.
It replaced 48 of a step's 49 norm launches: 0.992 against 1.063 ms per one-row
step (H200; ``tools/profile_step.py --rows 1 --async-scheduling``). An earlier
try put the norm into this kernel's many-wave grid, where every program of
every wave paid the two row reductions after its wait: 1.297 against 1.227 ms.

(Also measured and not kept: splitting K across programs, summed in-kernel by
the last split, never won. The row kernel for ``o_proj`` (no norm; 1.011 vs
1.001 ms) and for ``down_proj`` (whole 5,632-column rows, 1.012-1.024 vs
0.992 ms), two blocks ahead (1.064-1.143 ms), L2 prefetch instructions for the
later waves' rows (1.18-1.34 vs 1.06 ms).)

(Nor a few-row form, 1 to 8 token rows per launch with each row's products kept apart, to bring the
fused norms and activation to 2-8-row steps (H200, 2026-12-04, one call): kernel by kernel it lost to
cuBLAS from 2 rows on q/k/v and gate/up (10.8 / 19.1 vs 9.3 / 13.2 us; 4 rows 16.6 / 28.7 us), the
elementwise fp32 products growing with the rows, and whole steps (``tools/profile_step.py``) tied at 2
rows (1.456 vs 1.461 ms) and lost from 3 (3 / 4 / 8 rows: 2.490 / 2.411 / 4.003 vs 1.602 / 1.642 /
1.843 ms). Its one-row case, a 3-D tile of one row, was slower than this kernel too.)

(Nor the add + RMSNorm fused into tensor-core q/k/v and gate/up products for 2-16 rows, plus the SiLU
computed on load in ``down_proj`` (H100, 2026-12-06; the code is in git at 12bff1d): whole steps took
2.485 / 2.737 / 3.100 ms against 1.728 / 1.920 / 2.175 at 2 / 4 / 8 rows, the best launch of five
(32 x 256, 4 warps, 3 stages) 2.366 / 2.689 ms at 4 / 8 rows, and end to end the README command ran at
0.70x / 0.73x the default's output rate at C = 2 / 8.)

(Nor, a third time, these two kernels taking 1-4 rows themselves, each row its own fp32 products on the one
widened weight tile, the norms and the activation fused, the vocabulary projection skipped unless a row
exits (H200, 2026-12-06 (session 30); the code is in git at 18fdb2d / c3e6539): whole steps at 2 / 3 / 4 rows took 1.625 /
3.318 / 3.254 ms against 1.388-1.400 / 1.520 / 1.534; the best of four launches 1.553 / - / 2.128, and the
products alone without the norms 1.577 / - / 2.605. Kernel by kernel at 2 rows (PDL off), the GEMV read
the step's weights in 1,126 us where the skinny kernel, cuBLAS, the SiLU kernel and cuBLAS's lm_head took
915 us.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopline.kernels import cuda_sm_count, grid_dependency_wait, kernel_operands, pdl_options

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

    # TorchOps' SwiGLU rounding, which the one-row GEMV and the activation kernel (kernels/fused.py) both apply:
    # one definition, so the two paths round alike by construction.

    @triton.jit
    def silu_mul_rounded(g, u, dtype: tl.constexpr):
        """``silu(g) * u`` from fp32 ``g``, ``u`` as :meth:`TorchOps.silu_mul` rounds it (the activation as F.silu
        rounds it, then the product), in ``dtype``."""
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (act * u).to(dtype)

    @triton.jit
    def _row_chunk(x_ptr, u_ptr, k, K, BLOCK_K: tl.constexpr, SILU: tl.constexpr, dtype: tl.constexpr):
        """Columns ``k .. k + BLOCK_K`` of the input row in fp32 (``silu(gate) * up`` with SILU)."""
        cols = k + tl.arange(0, BLOCK_K)
        m = cols < K
        x = tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if SILU:
            x = silu_mul_rounded(x, tl.load(u_ptr + cols, mask=m, other=0.0).to(tl.float32), dtype).to(tl.float32)
        return x

    @triton.jit
    def _gemv_kernel(
        x_ptr, u_ptr, w_ptr, y_ptr, needed_ptr,  # x [K] (and up [K] for SILU), W [N, K] (unit last stride), y [N]
        N, K, stride_wn,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SILU: tl.constexpr,
        PREDICATED: tl.constexpr,  # needed_ptr: one int8 flag; 0 writes zeros without reading W
        PDL: tl.constexpr,
    ):
        dtype = x_ptr.dtype.element_ty  # y is rounded to the operands' dtype, then stored as y's (fp32 logits)
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
                    tl.store(y_ptr + rows, tl.zeros((BLOCK_N,), dtype=y_ptr.dtype.element_ty), mask=rows < N)
                    return
        for k in range(BLOCK_K if PDL and not PREDICATED else 0, K, BLOCK_K):
            w = _weight_tile(w_rows, k, K, BLOCK_K, EVEN_K)
            acc += w.to(tl.float32) * _row_chunk(x_ptr, u_ptr, k, K, BLOCK_K, SILU, dtype)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(dtype).to(y_ptr.dtype.element_ty), mask=rows < N)


    @triton.jit
    def normed_row(x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, K, eps, BLOCK_K: tl.constexpr,
                   HAS_BRANCH: tl.constexpr, WRITE_X, dtype: tl.constexpr, stride_bs, SPLITS: tl.constexpr):
        """``rms_norm(x') * wn`` in fp32, with ``x' = x + rms_norm(b) * wb`` (HAS_BRANCH; stored to ``x_out``
        where WRITE_X) or ``x`` itself, rounded as :meth:`TorchOps.add_rms_norm`. The add + RMSNorm kernel
        (``kernels/fused.py``) computes its rows with it too, so the two paths round alike by construction.
        SPLITS > 0: ``b`` is that many split-K partial rows ``stride_bs`` apart (``skinny_gemm.SplitKPartials``),
        summed in split order and rounded to ``dtype`` as the split-K reduction kernel stores them."""
        cols = tl.arange(0, BLOCK_K)
        m = cols < K
        x = tl.load(x_ptr + cols, mask=m, other=0.0)
        if HAS_BRANCH:
            if SPLITS == 0:
                b = tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
            else:
                b = tl.zeros((BLOCK_K,), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    b += tl.load(b_ptr + s * stride_bs + cols, mask=m, other=0.0)
                b = b.to(dtype).to(tl.float32)
            rb = tl.rsqrt(tl.sum(b * b, axis=0) / K + eps)
            wb = tl.load(wb_ptr + cols, mask=m, other=0.0).to(tl.float32)
            bn = ((b * rb).to(dtype).to(tl.float32) * wb).to(dtype)
            x = (x.to(tl.float32) + bn.to(tl.float32)).to(dtype)
            if WRITE_X:
                tl.store(x_out_ptr + cols, x, mask=m)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        wn = tl.load(wn_ptr + cols, mask=m, other=0.0).to(tl.float32)
        return ((xf * r).to(dtype).to(tl.float32) * wn).to(dtype).to(tl.float32)

    @triton.jit
    def _row_block(w_ptr, block, blocks, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):
        """Whole weight rows ``block * BLOCK_N ..`` (clamped to N - 1, like :func:`_gemv_kernel`); a block
        from ``blocks`` on reads nothing (the load ahead past a program's last block)."""
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        live = (rows < blocks * BLOCK_N)[:, None]
        cols = tl.arange(0, BLOCK_K)
        ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + cols[None, :]
        if EVEN_K:
            return tl.load(ptrs, mask=live, other=0.0, eviction_policy="evict_first")  # read once
        return tl.load(ptrs, mask=live & (cols < K)[None, :], other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _norm_gemv_kernel(
        x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, w_ptr, y_ptr,  # rows [K], norm weights [K], W [N, K], y [N]
        N, K, stride_wn, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BRANCH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        dtype = y_ptr.dtype.element_ty
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        blocks = tl.cdiv(N, BLOCK_N)
        # No earlier kernel writes the weights: the first block streams in while they finish.
        w = _row_block(w_ptr, pid, blocks, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
        grid_dependency_wait(PDL)
        xv = normed_row(x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, K, eps, BLOCK_K, HAS_BRANCH, pid == 0, dtype, 0,
                        tl.constexpr(0))
        block = pid
        for _ in range(pid, blocks, step):
            ahead = _row_block(w_ptr, block + step, blocks, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
            rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * xv[None, :], axis=1).to(dtype), mask=rows < N)
            w = ahead
            block += step
else:  # pragma: no cover
    # imported by kernels/fused.py, whose kernels are unusable without triton too
    normed_row = silu_mul_rounded = None


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
SHAPE_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # Ouro's coda (lm_head, 49,152 x 2,048: 12,288 programs at the default): fewer, longer programs win, as
    # the step reads it at every loop (predicated: most loops only write zeros). One-row steps at 1,024 keys
    # (one call): 64 rows x 512 columns 0.930 ms, 32 x 512 at 4 warps 0.931, 32 x 1,024 0.933, 16 x 2,048
    # 0.936; earlier (1,088 keys) 16 x 2,048 0.971 against 0.975 at the default and 0.973 at 8 rows.
    (49152, 2048): GemvConfig(block_n=64, block_k=512, num_warps=8, num_stages=2),
}


def use_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`gemv` applies: one row, unit stride along K, no autograd. fp32 too: with no MMA
    the kernel is exact to fp32 rounding there, so fp32 engine tests check the path as served."""
    return triton is not None and kernel_operands(x, weight, _DTYPES) and x.shape[0] == 1


def gemv(x: Tensor, weight: Tensor, *, up: Tensor | None = None, needed: Tensor | None = None,
         config: GemvConfig | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """``F.linear(x, weight)`` for one row ``x`` ``[1, K]`` and ``weight`` ``[N, K]``; with ``up`` given,
    ``F.linear(silu(x) * up, weight)`` (the MLP's down projection, activation computed on load).

    ``needed``: a one-element bool tensor on the device; where it is False the kernel returns zeros
    without reading the weight (the coda of a decode row whose token does not exit this loop).
    ``out_dtype``: the result's dtype (default ``x``'s), holding ``F.linear(x, weight).to(out_dtype)``:
    rounded to ``x``'s dtype first, so fp32 logits need no conversion launch of their own."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv wants x [1, K] and weight [N, K] with unit stride along K, got "
                         f"{tuple(x.shape)} / {tuple(weight.shape)}")
    if up is not None and (up.shape != x.shape or up.stride(1) != 1):
        raise ValueError(f"gemv's up must be shaped like x {tuple(x.shape)} with unit stride, got {tuple(up.shape)}")
    if needed is not None and (needed.numel() != 1 or needed.dtype != torch.bool):
        raise ValueError(f"gemv's needed must be one bool, got {needed.dtype} {tuple(needed.shape)}")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"gemv's out_dtype must be one of {', '.join(map(str, _DTYPES))}, got {out_dtype}")
    n, k = weight.shape
    cfg = config or SHAPE_CONFIGS.get((n, k), DEFAULT_CONFIG)
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, up if up is not None else x, weight, y, needed.view(torch.int8) if needed is not None else x,
        n, k, weight.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SILU=up is not None,
        PREDICATED=needed is not None, **pdl_options(x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


# norm_gemv's launch (H200, one-row steps, same call): 4 rows x whole row per block, 4 warps, 5 programs per
# SM (what fits at 96 registers) gave 0.992 ms; 8 warps at 4 per SM 0.999; 3 per SM 1.001, 2 per SM 1.132;
# without the load ahead 1.027.
_NORM_BLOCK_N, _NORM_WARPS, _NORM_PROGRAMS_PER_SM = 4, 4, 5
_NORM_MAX_K = 2048  # whole rows per block: wider ones would not fit a program's registers


def use_norm_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`norm_gemv` applies: :func:`use_gemv`'s one row, contiguous, of at most 2,048 columns."""
    return use_gemv(x, weight) and x.is_contiguous() and x.shape[1] <= _NORM_MAX_K


def norm_gemv(x: Tensor, weight: Tensor, norm_weight: Tensor, eps: float, *, branch: Tensor | None = None,
              branch_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One row through the residual add, the RMSNorm and a projection, in one kernel.

    Returns ``(x', y)``: ``x' = x + rms_norm(branch) * branch_weight`` (``x`` itself without ``branch``) and
    ``y = F.linear(rms_norm(x') * norm_weight, weight)``, rounded as :meth:`TorchOps.add_rms_norm` then
    :func:`gemv`."""
    n, k = weight.shape
    if x.shape != (1, k) or not x.is_contiguous() or weight.stride(1) != 1 or k > _NORM_MAX_K:
        raise ValueError(f"norm_gemv wants x [1, K] contiguous with K <= {_NORM_MAX_K} and weight [N, K] with "
                         f"unit stride along K, got {tuple(x.shape)} / {tuple(weight.shape)}")
    if (branch is None) != (branch_weight is None):
        raise ValueError("norm_gemv's branch and branch_weight come together")
    if branch is not None and (branch.shape != x.shape or not branch.is_contiguous() or branch.dtype != x.dtype):
        raise ValueError(f"norm_gemv's branch must be contiguous and shaped like x {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(branch.shape)} {branch.dtype}")
    for name, w in (("norm_weight", norm_weight), ("branch_weight", branch_weight)):
        if w is not None and (w.shape != (k,) or not w.is_contiguous()):
            raise ValueError(f"norm_gemv's {name} must be contiguous [{k}], got {tuple(w.shape)}")
    blocks = triton.cdiv(n, _NORM_BLOCK_N)
    # The CPU interpreter gets three programs, so that the tests walk several blocks per program.
    grid = min(blocks, _NORM_PROGRAMS_PER_SM * cuda_sm_count(x.device) if x.is_cuda else 3)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    x_out = torch.empty_like(x) if branch is not None else x
    block_k = triton.next_power_of_2(k)
    _norm_gemv_kernel[(grid,)](
        x, branch if branch is not None else x, branch_weight if branch_weight is not None else norm_weight,
        norm_weight, x_out, weight, y, n, k, weight.stride(0), eps,
        BLOCK_N=_NORM_BLOCK_N, BLOCK_K=block_k, EVEN_K=k == block_k, HAS_BRANCH=branch is not None,
        **pdl_options(x.device), num_warps=_NORM_WARPS)
    return x_out, y


__all__ = ["DEFAULT_CONFIG", "SHAPE_CONFIGS", "GemvConfig", "gemv", "norm_gemv", "use_gemv", "use_norm_gemv"]
