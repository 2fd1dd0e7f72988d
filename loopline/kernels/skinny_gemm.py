"""Skinny matmul ``y = x @ W.T`` for decode-sized batches (inference only).

At decode a projection multiplies a few token rows by a whole weight matrix, so
its time is the time to stream the weight once. For Ouro's down projection
(K = 5632 >> N = 2048) cuBLAS reaches ~2.0-2.1 TB/s at 1-64 rows on an H200
(``tools/bench_gemm.py``): its grid over N alone is too small for the GPU, and
its split-K kernel adds a reduction. This kernel owns ``BLOCK_N`` weight rows
per program, reads them in K-contiguous tiles, and splits K so the grid fills
the GPU; every token row lives in the program. Accumulation is fp32 with one
rounding; split-K partials are summed in a fixed order by a second kernel, so
results are the same on every run (no atomics).

:class:`loopline.kernels.fused.TritonOps` takes it for the down projection at
2-64 rows and for each other projection at 2 to its ``fused.SKINNY_MAX_ROWS``
rows (q/k/v and o_proj: 16, gate/up: none; one row takes ``loopline.kernels.gemv``, more rows cuBLAS).

On Hopper both kernels are launched with programmatic dependent launch
(:func:`loopline.kernels.pdl_options`), as the one-row GEMV is: a program
loads its first weight tile, which nothing in a step writes, before it waits
for the kernels before it, and reads the token rows after the wait; the
split-K reduction waits first thing. The first tile's product is the K loop's
first step, peeled out of it, so the sums and their order are those of the
launch without PDL (the same MMA instructions in the sm_90 PTX; the launch
without PDL compiles to the instructions it did before PDL was added). In that
PTX the loop's pipeline issues its loads of the next tiles once the first tile
and the rows are in shared memory; what that costs against the early first
tile is unmeasured (``tools/bench_gemm.py --pdl``, ``tools/profile_step.py``).

(Computing the SwiGLU activation while loading the rows, to drop the separate
``silu_mul`` kernel, measured slower: 15.95 vs 13.10 us at 32 rows, since every
program along N recomputes it.)
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

MAX_ROWS = 64  # token rows one program holds; more rows are a GEMM cuBLAS does well
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if triton is not None:

    @triton.jit
    def _tile(ptrs, offs_k, k, K, EVEN_K: tl.constexpr, WEIGHT: tl.constexpr):
        """The tile at ``ptrs`` (columns ``offs_k + k``), zeros past K; the weight's is read once, so it is
        evicted first (it keeps out of the rows' way in L2)."""
        if EVEN_K:
            if WEIGHT:
                return tl.load(ptrs, eviction_policy="evict_first")
            return tl.load(ptrs)
        k_mask = offs_k[None, :] + k < K
        if WEIGHT:
            return tl.load(ptrs, mask=k_mask, other=0.0, eviction_policy="evict_first")
        return tl.load(ptrs, mask=k_mask, other=0.0)

    @triton.jit
    def _skinny_kernel(
        x_ptr, w_ptr, out_ptr,  # x [M, K] (unit last stride), W [N, K] (unit last stride), out [SPLIT_K, M, N]
        M, N, K, k_per_split,
        stride_xm, stride_wn, stride_os, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding); ignored for 16-bit operands
        PDL: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        # Out-of-range rows are clamped, not masked: they re-read a valid (cached) row, the loads stay
        # unpredicated and wide, and the store drops their results.
        rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
        rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
        offs_k = pid_k.to(tl.int64) * k_per_split + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PDL:
            # No earlier kernel writes the weights: the first tile streams in while they finish. The rows
            # are read after the wait. The product is the loop's first step (same order, same bits).
            w = _tile(w_ptrs, offs_k, 0, K, EVEN_K, True)
            grid_dependency_wait(PDL)
            x = _tile(x_ptrs, offs_k, 0, K, EVEN_K, False)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        for k in range(BLOCK_K if PDL else 0, k_per_split, BLOCK_K):
            w = _tile(w_ptrs, offs_k, k, K, EVEN_K, True)
            x = _tile(x_ptrs, offs_k, k, K, EVEN_K, False)
            # W as the left operand: its rows are the MMA's M, so the K-contiguous tile needs no
            # transpose, and the token rows (padded to 16) are the narrow right operand.
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        ptrs = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))

    @triton.jit
    def _split_k_reduce_kernel(ws_ptr, y_ptr, N, stride_ws, stride_wm, stride_ym,
                               SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        grid_dependency_wait(PDL)  # every input is the partials the kernel before wrote
        # Partials summed in split order, one rounding at the end: the same bits on every run.
        m = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + s * stride_ws + m * stride_wm + cols, mask=mask, other=0.0)
        tl.store(y_ptr + m * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


class SplitKPartials(NamedTuple):
    """A product whose split-K partial sums are not yet added (:func:`skinny_linear` with ``sum_splits=False``):
    ``parts`` ``[S, M, N]`` fp32. Their sum in split order, rounded to the operands' dtype, is the product, as the
    reduction kernel stores it; the add + RMSNorm kernels that read a layer's branch (``kernels/fused.py``) sum it
    so as they load it (rounded to their rows' dtype, the same in the engine), a launch less."""

    parts: Tensor

    @property
    def requires_grad(self) -> bool:
        return False  # inference only (use_skinny)

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def skinny_config(n: int, k: int, num_sms: int = 132, elem_bytes: int = 2) -> SkinnyConfig:
    """Launch configuration for an ``[m <= MAX_ROWS, k] x [n, k]^T`` product (a fixed rule, no autotuning).

    From ``tools/bench_gemm.py --sweep`` on an H200 (Ouro-1.4B's down projection, 32 and 64 rows): 64 weight
    rows x 128 columns per step, 5 stages deep; K is split while the doubled grid still fits about one
    program per SM and each split keeps at least two K blocks. fp32 operands (tests; the engine
    serves 16-bit weights) get 2 stages so 64 rows still fit in shared memory.

    The rule does not look at M. At 2-16 rows it gives Ouro-1.4B's q/k/v (N = 6,144) 96 programs and no
    split on 132 SMs, gate/up (11,264) 176 programs, o_proj and down_proj (2,048) four K splits of 32
    programs. Filling the SMs for q/k/v (32-row blocks, or two K splits) was considered and, unmeasured,
    not adopted: 96 programs already keep 4 x 16 KB of weight each in flight, ~6 MB, more than the ~4 MB
    that ~4.3 TB/s at a ~1 us memory latency asks for (an estimate, not a measurement); and either change
    gives 192 programs, 60 SMs running two and 72 one, the split also a reduction launch more.
    ``tools/bench_gemm.py --sweep --rows 2,4,8,16`` times those tiles against this rule.
    """
    block_n, block_k = 64, 128
    programs, split_k = triton.cdiv(n, block_n), 1
    while 2 * programs * split_k <= num_sms and k // (2 * split_k) >= 2 * block_k:
        split_k *= 2
    return SkinnyConfig(block_n, block_k, split_k, num_warps=4, num_stages=5 if elem_bytes <= 2 else 2)


def use_skinny(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`skinny_linear` applies: a decode-sized batch, no autograd. fp32 too (products in
    IEEE fp32, not TF32), as for :func:`loopline.kernels.gemv.use_gemv`: fp32 engine tests then check
    the path as served."""
    return triton is not None and kernel_operands(x, weight, _DTYPES) and 1 <= x.shape[0] <= MAX_ROWS


def skinny_linear(x: Tensor, weight: Tensor, config: SkinnyConfig | None = None, *,
                  sum_splits: bool = True) -> Tensor | SplitKPartials:
    """``F.linear(x, weight)`` for ``x`` ``[M <= MAX_ROWS, K]`` (rows may be strided) and ``weight`` ``[N, K]``.

    Both need unit stride along K; :func:`use_skinny` says whether the engine should call it. With
    ``sum_splits=False`` a launch that splits K returns its partials unsummed (:class:`SplitKPartials`).
    """
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(f"skinny_linear wants x [M, K] and weight [N, K] with unit stride along K, got "
                         f"{tuple(x.shape)} / {tuple(weight.shape)}")
    cfg = config or skinny_config(n, k, _sm_count(x.device), x.element_size())
    pdl = pdl_options(x.device)
    # Each split covers a whole number of K blocks; a tail split may run past K and read masked zeros.
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    even_k = k_per_split * cfg.split_k == k
    if cfg.split_k == 1:
        out = y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        stride_os, stride_om = 0, y.stride(0)
    else:
        out = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        stride_os, stride_om = out.stride(0), out.stride(1)
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, weight, out, m, n, k, k_per_split, x.stride(0), weight.stride(0), stride_os, stride_om,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=even_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        if not sum_splits:
            return SplitKPartials(out)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block = 1024
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](out, y, n, out.stride(0), out.stride(1), y.stride(0),
                                                           SPLIT_K=cfg.split_k, BLOCK=block, **pdl)
    return y


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any grid works; use the H200's so tests take the GPU's path
    return cuda_sm_count(device)


__all__ = ["MAX_ROWS", "SkinnyConfig", "SplitKPartials", "skinny_config", "skinny_linear", "use_skinny"]
