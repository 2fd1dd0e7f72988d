"""The lookahead exit rule's decision as one Triton kernel (``exit_mode="lookahead"``, docs/lookahead.md).

After the two projections (a GEMM each), the rule in torch is ~40 short ops per step: the head's first
layer from the folded weights, GELU, the output layer, the sigmoid, and the two decisions (about loop 0
and about loop ``n``) with their bounds. Inside a decode step's CUDA graph each is a launch of a few
microseconds, ~8% of a one-row step of Ouro-1.4B on an H200. Here one program per row does all of it:
the head's hidden width fits one block. With ``replay`` it takes the decisions from replayed depths (what
:class:`~loopline.worker.lookahead_rule.ReplayPredictor` gives) and still evaluates the head, so a
benchmark pays what a trained head costs. The result equals the torch rule's to fp32 rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, pdl_options

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are unusable without triton
    triton = None


class HeadWeights(NamedTuple):
    """A head's layers with its standardisation and projection folded in (``HeadPredictor``), fp32."""

    scalars: Tensor  # [3, W]: gate, F, position
    loop_bias: Tensor  # [loops, W]: one-hot loop + bias
    out_w: Tensor  # [W, 1]
    out_b: Tensor  # [1]


class Replay(NamedTuple):
    """Replayed depths (``ReplayPredictor``): per slot its tokens' depths and its last trace index."""

    depths: Tensor  # [slots, max_tokens] int64
    last: Tensor  # [slots] int64


if triton is not None:

    @triton.jit
    def _gelu(x):
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _fix(target, depth, prob, threshold, min_loops, max_loops, n, LOOPS: tl.constexpr):
        ok = (target == 0) & (prob >= threshold) & (depth >= min_loops) & (depth < max_loops) & (n <= LOOPS - 3)
        return tl.where(ok, depth, target)

    @triton.jit
    def _decide_kernel(h_ptr, prev_ptr, stride_h, stride_prev, loop_ptr, gate_ptr, cdf_ptr, pos_ptr, min_ptr,
                       max_ptr, thr_ptr, target_ptr, out_ptr, scal_ptr, bias_ptr, out_w_ptr, out_b_ptr,
                       slots_ptr, tindex_ptr, depths_ptr, last_ptr, stride_depths, probs_ptr, n_rows,
                       inv_log_max_pos, W: tl.constexpr, BLOCK: tl.constexpr, LOOPS: tl.constexpr,
                       REPLAY: tl.constexpr, PROBS: tl.constexpr, PDL: tl.constexpr):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < W
        n = tl.load(loop_ptr + row)
        p = tl.log(1.0 + tl.load(pos_ptr + row).to(tl.float32)) * inv_log_max_pos
        s_gate = tl.load(scal_ptr + c, mask=m, other=0.0)
        s_cdf = tl.load(scal_ptr + W + c, mask=m, other=0.0)
        s_pos = tl.load(scal_ptr + 2 * W + c, mask=m, other=0.0)
        hs = tl.load(h_ptr + row * stride_h + c, mask=m, other=0.0)
        hc = tl.load(h_ptr + row * stride_h + W + c, mask=m, other=0.0)
        ps = tl.load(prev_ptr + row * stride_prev + c, mask=m, other=0.0)
        pc = tl.load(prev_ptr + row * stride_prev + W + c, mask=m, other=0.0)
        bias_n = tl.load(bias_ptr + tl.minimum(n, LOOPS - 1) * W + c, mask=m, other=0.0)
        bias_0 = tl.load(bias_ptr + c, mask=m, other=0.0)
        gate = tl.load(gate_ptr + row).to(tl.float32)
        cdf = tl.load(cdf_ptr + row).to(tl.float32)
        at_n = bias_n + gate * s_gate + cdf * s_cdf + p * s_pos + hs + hc - pc
        at_0 = bias_0 + p * s_pos + ps  # (loop 0: no gate, F 0, no change)
        out_w = tl.load(out_w_ptr + c, mask=m, other=0.0)
        out_b = tl.load(out_b_ptr)
        prob_n = tl.sigmoid(tl.sum(tl.where(m, _gelu(at_n) * out_w, 0.0), 0) + out_b)
        prob_0 = tl.sigmoid(tl.sum(tl.where(m, _gelu(at_0) * out_w, 0.0), 0) + out_b)
        if PROBS:  # the head's probabilities, as HeadPredictor returns them (loop 0's rows first)
            tl.store(probs_ptr + row, prob_0)
            tl.store(probs_ptr + n_rows + row, prob_n)
        if REPLAY:  # decisions from the replayed depths; the head above still ran (its cost), unused
            slot = tl.load(slots_ptr + row)
            ti = tl.load(tindex_ptr + row)
            want = tl.load(depths_ptr + slot * stride_depths + tl.minimum(tl.maximum(ti, 0), tl.load(last_ptr + slot)))
            prob_n = tl.where((want == n + 2) & (ti >= 0), 1.0, 0.0) + 0.0 * prob_n
            prob_0 = tl.where((want == 2) & (ti >= 0), 1.0, 0.0) + 0.0 * prob_0
        threshold = tl.load(thr_ptr + row)
        lo = tl.load(min_ptr + row)
        hi = tl.load(max_ptr + row)
        target = tl.load(target_ptr + row)
        first = tl.where(n == 1, prob_0, -1.0)  # (loop 0's decision is taken in the step of loop 1)
        target = _fix(target, n * 0 + 2, first, threshold, lo, hi, n * 0, LOOPS)
        target = _fix(target, n + 2, prob_n, threshold, lo, hi, n, LOOPS)
        tl.store(out_ptr + row, target)


def available() -> bool:
    """Whether :func:`decide` can run (triton is installed; CUDA, or the CPU interpreter in tests)."""
    return triton is not None


def _column(x: Tensor | int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A per-row column ``[B]`` of ``dtype`` (a scalar broadcast; a tensor as it is, when it already is one)."""
    if isinstance(x, Tensor):
        x = x.to(dtype)
        return x if x.dim() else x.expand(like.shape[0])
    return torch.full(like.shape, x, dtype=dtype, device=like.device)


def decide(head: HeadWeights, loops: int, log_max_position: float, loop: Tensor, gate: Tensor, cdf: Tensor,
           h_proj: Tensor, prev: Tensor, positions: Tensor, min_loops: Tensor | int, max_loops: Tensor | int,
           threshold: Tensor, target: Tensor, slots: Tensor, token_index: Tensor,
           replay: Replay | None = None, probs: Tensor | None = None) -> Tensor:
    """The rows' targets after loop ``loop`` ``[B]`` (``LookaheadRule.decide``'s result), one launch. ``h_proj``
    and ``prev`` ``[B, 2W]`` fp32: the loop's output and input through the head's projection. ``probs`` (``[2B]``
    fp32, tests): receives the head's probabilities, about loop 0 and then about ``loop``."""
    b, w = loop.shape[0], head.scalars.shape[1]
    out = torch.empty(b, dtype=torch.int64, device=loop.device)
    if b == 0:
        return out
    i64 = torch.int64
    rp = replay if replay is not None else Replay(out, out)  # (unread without REPLAY)
    _decide_kernel[(b,)](h_proj, prev, h_proj.stride(0), prev.stride(0), loop.to(i64).contiguous(),
                         gate.float().contiguous(), cdf.float().contiguous(), positions.contiguous(),
                         _column(min_loops, loop, i64).contiguous(), _column(max_loops, loop, i64).contiguous(),
                         threshold.float().contiguous(), target.to(i64).contiguous(), out, head.scalars,
                         head.loop_bias, head.out_w, head.out_b, slots.to(i64).contiguous(),
                         token_index.to(i64).contiguous(), rp.depths, rp.last, rp.depths.stride(0),
                         probs if probs is not None else out, b, 1.0 / log_max_position, W=w,
                         BLOCK=triton.next_power_of_2(w), LOOPS=loops, REPLAY=replay is not None,
                         PROBS=probs is not None, **pdl_options(loop.device), num_warps=1)
    return out


__all__ = ["HeadWeights", "Replay", "available", "decide"]
