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
    def _rows_product(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, k, K, stride_xm, stride_um, BLOCK_K: tl.constexpr,
                      SILU: tl.constexpr, dtype: tl.constexpr, ROWS: tl.constexpr):
        """Adds ``w * row`` (fp32) to the accumulator of each of the ``ROWS`` input rows; the weight tile is
        widened once for all of them (the rows are KBs, the tile what the kernel streams)."""
        wf = w.to(tl.float32)
        acc0 += wf * _row_chunk(x_ptr, u_ptr, k, K, BLOCK_K, SILU, dtype)[None, :]
        if ROWS > 1:
            acc1 += wf * _row_chunk(x_ptr + stride_xm, u_ptr + stride_um, k, K, BLOCK_K, SILU, dtype)[None, :]
        if ROWS > 2:
            acc2 += wf * _row_chunk(x_ptr + 2 * stride_xm, u_ptr + 2 * stride_um, k, K, BLOCK_K, SILU, dtype)[None, :]
        if ROWS > 3:
            acc3 += wf * _row_chunk(x_ptr + 3 * stride_xm, u_ptr + 3 * stride_um, k, K, BLOCK_K, SILU, dtype)[None, :]
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _store_rows(y_ptr, stride_ym, rows, N, v0, v1, v2, v3, ROWS: tl.constexpr):
        """Stores ``v0 .. v{ROWS-1}`` (``[BLOCK_N]`` each) at columns ``rows`` of y's first ``ROWS`` rows."""
        m = rows < N
        tl.store(y_ptr + rows, v0, mask=m)
        if ROWS > 1:
            tl.store(y_ptr + stride_ym + rows, v1, mask=m)
        if ROWS > 2:
            tl.store(y_ptr + 2 * stride_ym + rows, v2, mask=m)
        if ROWS > 3:
            tl.store(y_ptr + 3 * stride_ym + rows, v3, mask=m)

    @triton.jit
    def _gemv_kernel(
        x_ptr, u_ptr, w_ptr, y_ptr, needed_ptr,  # x [ROWS, K] (and up for SILU), W [N, K] (unit last stride), y [ROWS, N]
        N, K, stride_wn, stride_xm, stride_um, stride_ym,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SILU: tl.constexpr,
        PREDICATED: tl.constexpr,  # needed_ptr: ROWS int8 flags; all 0 writes zeros without reading W
        ROWS: tl.constexpr, ROWS_P2: tl.constexpr, PDL: tl.constexpr,
    ):
        dtype = x_ptr.dtype.element_ty  # y is rounded to the operands' dtype, then stored as y's (fp32 logits)
        out_dtype = y_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past N are clamped, not masked: they re-read a valid row, the loads stay unpredicated and
        # wide, and the store drops their results.
        w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        if PDL and not PREDICATED:
            # No earlier kernel writes the weights: the first tile streams in while they finish.
            w = _weight_tile(w_rows, 0, K, BLOCK_K, EVEN_K)
            grid_dependency_wait(PDL)
            acc0, acc1, acc2, acc3 = _rows_product(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, 0, K, stride_xm,
                                                   stride_um, BLOCK_K, SILU, dtype, ROWS)
        else:
            grid_dependency_wait(PDL)
            if PREDICATED:
                flags = tl.load(needed_ptr + tl.arange(0, ROWS_P2), mask=tl.arange(0, ROWS_P2) < ROWS, other=0)
                if tl.max(flags, axis=0) == 0:
                    zero = tl.zeros((BLOCK_N,), dtype=out_dtype)
                    _store_rows(y_ptr, stride_ym, rows, N, zero, zero, zero, zero, ROWS)
                    return
        for k in range(BLOCK_K if PDL and not PREDICATED else 0, K, BLOCK_K):
            w = _weight_tile(w_rows, k, K, BLOCK_K, EVEN_K)
            acc0, acc1, acc2, acc3 = _rows_product(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, k, K, stride_xm,
                                                   stride_um, BLOCK_K, SILU, dtype, ROWS)
        _store_rows(y_ptr, stride_ym, rows, N, tl.sum(acc0, axis=1).to(dtype).to(out_dtype),
                    tl.sum(acc1, axis=1).to(dtype).to(out_dtype), tl.sum(acc2, axis=1).to(dtype).to(out_dtype),
                    tl.sum(acc3, axis=1).to(dtype).to(out_dtype), ROWS)


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
        x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, w_ptr, y_ptr,  # rows [ROWS, K], norm weights [K], W [N, K], y [ROWS, N]
        N, K, stride_wn, stride_m, stride_ym, eps,  # stride_m: x's, b's and x_out's row stride
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BRANCH: tl.constexpr,
        ROWS: tl.constexpr, PDL: tl.constexpr,
    ):
        dtype = y_ptr.dtype.element_ty
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        blocks = tl.cdiv(N, BLOCK_N)
        # No earlier kernel writes the weights: the first block streams in while they finish.
        w = _row_block(w_ptr, pid, blocks, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
        grid_dependency_wait(PDL)
        # Each program normalizes every row once (KBs); program 0 also stores the residual sums.
        x0 = normed_row(x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, K, eps, BLOCK_K, HAS_BRANCH, pid == 0, dtype, 0,
                        tl.constexpr(0))
        x1 = x0
        x2 = x0
        x3 = x0
        if ROWS > 1:
            x1 = normed_row(x_ptr + stride_m, b_ptr + stride_m, wb_ptr, wn_ptr, x_out_ptr + stride_m, K, eps,
                            BLOCK_K, HAS_BRANCH, pid == 0, dtype, 0, tl.constexpr(0))
        if ROWS > 2:
            x2 = normed_row(x_ptr + 2 * stride_m, b_ptr + 2 * stride_m, wb_ptr, wn_ptr, x_out_ptr + 2 * stride_m, K,
                            eps, BLOCK_K, HAS_BRANCH, pid == 0, dtype, 0, tl.constexpr(0))
        if ROWS > 3:
            x3 = normed_row(x_ptr + 3 * stride_m, b_ptr + 3 * stride_m, wb_ptr, wn_ptr, x_out_ptr + 3 * stride_m, K,
                            eps, BLOCK_K, HAS_BRANCH, pid == 0, dtype, 0, tl.constexpr(0))
        block = pid
        for _ in range(pid, blocks, step):
            ahead = _row_block(w_ptr, block + step, blocks, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
            rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
            wf = w.to(tl.float32)
            y0 = tl.sum(wf * x0[None, :], axis=1).to(dtype)
            y1 = y0
            y2 = y0
            y3 = y0
            if ROWS > 1:
                y1 = tl.sum(wf * x1[None, :], axis=1).to(dtype)
            if ROWS > 2:
                y2 = tl.sum(wf * x2[None, :], axis=1).to(dtype)
            if ROWS > 3:
                y3 = tl.sum(wf * x3[None, :], axis=1).to(dtype)
            _store_rows(y_ptr, stride_ym, rows, N, y0, y1, y2, y3, ROWS)
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


MAX_ROWS = 4  # rows a launch of these kernels multiplies; more rows take the tensor-core routes

# Launches for 2..MAX_ROWS rows (each row keeps a [BLOCK_N, BLOCK_K] fp32 accumulator: 16 registers a thread
# a row at 8 warps; ptxas, sm_90, with the activation: 80 / 128 registers at 2 / 4 rows, against 166 / 255 for
# the one-row launch's 4 x 2,048 tiles). Not yet measured against each other (``tools/profile_step.py``).
FEW_ROWS_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=8, num_stages=2)
FEW_ROWS_SHAPE_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (49152, 2048): GemvConfig(block_n=8, block_k=512, num_warps=8, num_stages=2),
}


def use_gemv(x: Tensor, weight: Tensor, max_rows: int = 1) -> bool:
    """Whether :func:`gemv` applies: 1 to ``max_rows`` (at most :data:`MAX_ROWS`) rows, unit stride along K, no
    autograd. fp32 too: with no MMA the kernel is exact to fp32 rounding there, so fp32 engine tests check the
    path as served."""
    return (triton is not None and kernel_operands(x, weight, _DTYPES)
            and 1 <= x.shape[0] <= min(max_rows, MAX_ROWS))


def _check_rows(name: str, x: Tensor, k: int) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name} wants x [R, K] with 1 <= R <= {MAX_ROWS}, K = {k} and unit stride along K, got "
                         f"{tuple(x.shape)}")


def gemv(x: Tensor, weight: Tensor, *, up: Tensor | None = None, needed: Tensor | None = None,
         config: GemvConfig | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """``F.linear(x, weight)`` for ``x`` ``[R, K]`` (1 <= R <= :data:`MAX_ROWS`) and ``weight`` ``[N, K]``; with
    ``up`` given, ``F.linear(silu(x) * up, weight)`` (the MLP's down projection, activation computed on load).

    ``needed``: ``[R]`` bools on the device; where all are False the kernel returns zeros without reading the
    weight (the coda of decode rows whose tokens do not exit this loop); where any is True every row is
    computed. ``out_dtype``: the result's dtype (default ``x``'s), holding ``F.linear(x, weight).to(out_dtype)``:
    rounded to ``x``'s dtype first, so fp32 logits need no conversion launch of their own."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv wants weight [N, K] with unit stride along K, got {tuple(weight.shape)}")
    n, k = weight.shape
    _check_rows("gemv", x, k)
    rows = x.shape[0]
    if up is not None and (up.shape != x.shape or up.stride(1) != 1):
        raise ValueError(f"gemv's up must be shaped like x {tuple(x.shape)} with unit stride, got {tuple(up.shape)}")
    if needed is not None and (needed.numel() != rows or needed.dtype != torch.bool or not needed.is_contiguous()):
        raise ValueError(f"gemv's needed must be {rows} contiguous bool(s), one a row, got {needed.dtype} "
                         f"{tuple(needed.shape)}")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"gemv's out_dtype must be one of {', '.join(map(str, _DTYPES))}, got {out_dtype}")
    if config is None:
        config = (SHAPE_CONFIGS.get((n, k), DEFAULT_CONFIG) if rows == 1
                  else FEW_ROWS_SHAPE_CONFIGS.get((n, k), FEW_ROWS_CONFIG))
    cfg = config
    y = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    u = up if up is not None else x
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, u, weight, y, needed.view(torch.int8) if needed is not None else x,
        n, k, weight.stride(0), x.stride(0), u.stride(0), y.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SILU=up is not None,
        PREDICATED=needed is not None, ROWS=rows, ROWS_P2=triton.next_power_of_2(rows), **pdl_options(x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


class NormGemvLaunch(NamedTuple):
    """A :func:`norm_gemv` launch: weight rows a block, warps, and programs per SM (a fixed grid whose programs
    each walk several blocks)."""
    block_n: int
    num_warps: int
    programs_per_sm: int


# norm_gemv's launch (H200, one-row steps, same call): 4 rows x whole row per block, 4 warps, 5 programs per
# SM (what fits at 96 registers) gave 0.992 ms; 8 warps at 4 per SM 0.999; 3 per SM 1.001, 2 per SM 1.132;
# without the load ahead 1.027. Several rows hold one normalized row each: 8 warps, as many programs per SM as
# ptxas's register counts let reside (sm_90, K = 2,048: 112 / 120 / 138 registers a thread at 2 / 3 / 4 rows;
# not yet measured against other launches).
NORM_LAUNCHES: dict[int, NormGemvLaunch] = {1: NormGemvLaunch(4, 4, 5), 2: NormGemvLaunch(4, 8, 2),
                                            3: NormGemvLaunch(4, 8, 2), 4: NormGemvLaunch(4, 8, 1)}
_NORM_MAX_K = 2048  # whole rows per block: wider ones would not fit a program's registers


def use_norm_gemv(x: Tensor, weight: Tensor, max_rows: int = 1) -> bool:
    """Whether :func:`norm_gemv` applies: :func:`use_gemv`'s 1 to ``max_rows`` rows, contiguous, of at most
    2,048 columns."""
    return use_gemv(x, weight, max_rows) and x.is_contiguous() and x.shape[1] <= _NORM_MAX_K


def norm_gemv(x: Tensor, weight: Tensor, norm_weight: Tensor, eps: float, *, branch: Tensor | None = None,
              branch_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """1 to :data:`MAX_ROWS` rows through the residual add, the RMSNorm and a projection, in one kernel.

    Returns ``(x', y)``: ``x' = x + rms_norm(branch) * branch_weight`` (``x`` itself without ``branch``) and
    ``y = F.linear(rms_norm(x') * norm_weight, weight)``, rounded as :meth:`TorchOps.add_rms_norm` then
    :func:`gemv`."""
    n, k = weight.shape
    if (x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k or not x.is_contiguous()
            or weight.stride(1) != 1 or k > _NORM_MAX_K):
        raise ValueError(f"norm_gemv wants x [R, K] contiguous with 1 <= R <= {MAX_ROWS}, K <= {_NORM_MAX_K} and "
                         f"weight [N, K] with unit stride along K, got {tuple(x.shape)} / {tuple(weight.shape)}")
    if (branch is None) != (branch_weight is None):
        raise ValueError("norm_gemv's branch and branch_weight come together")
    if branch is not None and (branch.shape != x.shape or not branch.is_contiguous() or branch.dtype != x.dtype):
        raise ValueError(f"norm_gemv's branch must be contiguous and shaped like x {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(branch.shape)} {branch.dtype}")
    for name, w in (("norm_weight", norm_weight), ("branch_weight", branch_weight)):
        if w is not None and (w.shape != (k,) or not w.is_contiguous()):
            raise ValueError(f"norm_gemv's {name} must be contiguous [{k}], got {tuple(w.shape)}")
    rows = x.shape[0]
    launch = NORM_LAUNCHES[rows]
    blocks = triton.cdiv(n, launch.block_n)
    # The CPU interpreter gets three programs, so that the tests walk several blocks per program.
    grid = min(blocks, launch.programs_per_sm * cuda_sm_count(x.device) if x.is_cuda else 3)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    x_out = torch.empty_like(x) if branch is not None else x
    block_k = triton.next_power_of_2(k)
    _norm_gemv_kernel[(grid,)](
        x, branch if branch is not None else x, branch_weight if branch_weight is not None else norm_weight,
        norm_weight, x_out, weight, y, n, k, weight.stride(0), k, n, eps,
        BLOCK_N=launch.block_n, BLOCK_K=block_k, EVEN_K=k == block_k, HAS_BRANCH=branch is not None, ROWS=rows,
        **pdl_options(x.device), num_warps=launch.num_warps)
    return x_out, y


__all__ = ["DEFAULT_CONFIG", "FEW_ROWS_CONFIG", "MAX_ROWS", "NORM_LAUNCHES", "SHAPE_CONFIGS", "GemvConfig",
           "NormGemvLaunch", "gemv", "norm_gemv", "use_gemv", "use_norm_gemv"]
