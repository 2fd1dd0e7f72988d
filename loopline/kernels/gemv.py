"""One-row matmul ``y = x @ W.T`` with an optional fused prologue (inference only).

At concurrency 1 a decode step multiplies one token row by every weight matrix
of the stack, so the step is the time to stream 2.5 GB of weights plus the
launches between them. cuBLAS reads these shapes at 2.2-3.4 TB/s at one row on
an H200 and needs a separate kernel for every norm and activation. This kernel
is a plain multiply-reduce (no MMA: one row would pad it 16-fold): each
program owns ``BLOCK_N`` weight rows of one K range, accumulates
``w * x`` elementwise in fp32 and reduces once. K may be split across programs;
the last program of a row block to finish (an atomic counter) sums the
partials in split order, so results are the same on every run and no second
kernel is launched.

The prologue computes the input row while loading it, which is free at one
row (the row is KBs, the weights MBs) and saves a launch:

* ``"silu"``: ``x = silu(gate) * up`` (the MLP's down projection);
* ``"add_norm"``: ``x' = x + w_b * norm(b)``, ``input = w_n * norm(x')`` (the
  sandwich-norm residual before a projection); program 0 stores ``x'``.

Rounding follows :class:`loopline.models.ops.TorchOps` exactly.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernel is unusable without triton
    triton = None

_DTYPES = (torch.float16, torch.bfloat16)
_PROLOGUES = {"none": 0, "silu": 1, "add_norm": 2}
_MAX_ROW_BLOCKS = 1 << 16  # split-K counters: one per block of weight rows


if triton is not None:

    @triton.jit
    def _row_rms(ptr, n_cols, eps, BLOCK: tl.constexpr):
        """``rsqrt(mean(x^2) + eps)`` of one row, in fp32, read in BLOCK-sized pieces."""
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, n_cols, BLOCK):
            cols = k + tl.arange(0, BLOCK)
            v = tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            total += v * v
        return tl.rsqrt(tl.sum(total, axis=0) / n_cols + eps)

    @triton.jit
    def _gemv_kernel(
        x_ptr, a_ptr, b_ptr, wb_ptr, wn_ptr, xo_ptr,  # the input row and the prologue's operands ([K] each)
        w_ptr, y_ptr, part_ptr, lock_ptr,  # W [N, K] (unit last stride), y [N], partials [SPLIT_K, N], counters
        N, K, k_per_split, stride_wn, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
        PROLOGUE: tl.constexpr,  # 0 x; 1 silu(x) * a; 2 w_n * norm(x + w_b * norm(b))
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        dtype = y_ptr.dtype.element_ty
        if PROLOGUE == 2:  # both row statistics first: every program needs them for its K range
            rb = _row_rms(b_ptr, K, eps, BLOCK_K)
            total = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                cols = k + tl.arange(0, BLOCK_K)
                m = cols < K
                bn = ((tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32) * rb).to(dtype).to(tl.float32)
                      * tl.load(wb_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(dtype)
                xs = (tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32) + bn.to(tl.float32)).to(dtype)
                if (pid_n == 0) & (pid_k == 0):
                    tl.store(xo_ptr + cols, xs, mask=m)
                xf = xs.to(tl.float32)
                total += xf * xf
            rx = tl.rsqrt(tl.sum(total, axis=0) / K + eps)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past N are clamped, not masked: they re-read a valid row, the loads stay unpredicated and
        # wide, and the store drops their results.
        w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        start = pid_k * k_per_split
        for k in range(start, start + k_per_split, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            m = cols < K
            if EVEN:
                w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + cols[None, :], mask=m[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32)
            if PROLOGUE == 1:  # silu(gate) rounded like F.silu, then the product rounded
                act = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
                x = (act * tl.load(a_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            if PROLOGUE == 2:  # recompute x' for this range (cheaper than a grid-wide wait for program 0)
                bn = ((tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32) * rb).to(dtype).to(tl.float32)
                      * tl.load(wb_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(dtype)
                xs = (x + bn.to(tl.float32)).to(dtype).to(tl.float32)
                x = ((xs * rx).to(dtype).to(tl.float32)
                     * tl.load(wn_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        part = tl.sum(acc, axis=1)
        out_mask = rows < N
        if SPLIT_K == 1:
            tl.store(y_ptr + rows, part.to(dtype), mask=out_mask)
        else:
            tl.store(part_ptr + pid_k * N + rows, part, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT_K - 1:  # the last split of this row block: sum all, in split order
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(part_ptr + s * N + rows, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + rows, total.to(dtype), mask=out_mask)
                tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next launch


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def gemv_config(n: int, k: int) -> GemvConfig:
    """Launch configuration for a one-row product with an ``[n, k]`` weight (a fixed rule)."""
    return GemvConfig(8, 512, 1 if n >= 4096 else 2, 4, 3)


@functools.lru_cache(maxsize=None)
def _locks(device: torch.device) -> Tensor:
    # Split-K counters; each launch leaves its counters at zero again, so one buffer serves every
    # launch on the device's (single) engine stream, CUDA-graph replays included.
    return torch.zeros(_MAX_ROW_BLOCKS, dtype=torch.int32, device=device)


def use_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`gemv` applies: one 16-bit row, unit stride along K, no autograd."""
    if triton is None or x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        return False
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    # Parameters keep requires_grad under inference_mode; only recorded autograd rules the kernel out.
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def gemv(x: Tensor, weight: Tensor, *, up: Tensor | None = None, branch: Tensor | None = None,
         branch_weight: Tensor | None = None, norm_weight: Tensor | None = None, eps: float = 0.0,
         x_out: Tensor | None = None, config: GemvConfig | None = None) -> Tensor:
    """``F.linear(p(x), weight)`` for one row ``x`` ``[1, K]`` and ``weight`` ``[N, K]``, where the prologue ``p`` is

    * the identity by default;
    * ``silu(x) * up`` when ``up`` is given;
    * ``norm_weight * norm(x + branch_weight * norm(branch))`` when ``branch`` is given; the
      residual ``x + branch_weight * norm(branch)`` is written to ``x_out``.
    """
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv wants x [1, K] and weight [N, K] with unit stride along K, got "
                         f"{tuple(x.shape)} / {tuple(weight.shape)}")
    n, k = weight.shape
    cfg = config or gemv_config(n, k)
    prologue = "silu" if up is not None else "add_norm" if branch is not None else "none"
    if prologue == "add_norm" and (branch_weight is None or norm_weight is None or x_out is None):
        raise ValueError("gemv's add_norm prologue needs branch, branch_weight, norm_weight and x_out")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    if grid[0] > _MAX_ROW_BLOCKS:
        raise ValueError(f"gemv: {n} weight rows need more than {_MAX_ROW_BLOCKS} row blocks of {cfg.block_n}")
    part = y if cfg.split_k == 1 else torch.empty((cfg.split_k, n), dtype=torch.float32, device=x.device)
    dummy = x
    _gemv_kernel[grid](
        x, up if up is not None else dummy, branch if branch is not None else dummy,
        branch_weight if branch_weight is not None else dummy, norm_weight if norm_weight is not None else dummy,
        x_out if x_out is not None else dummy, weight, y, part, _locks(x.device),
        n, k, k_per_split, weight.stride(0), eps,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, EVEN=k_per_split * cfg.split_k == k,
        PROLOGUE=_PROLOGUES[prologue], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


__all__ = ["GemvConfig", "gemv", "gemv_config", "use_gemv"]
