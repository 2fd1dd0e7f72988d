"""Fused Triton kernels for a decoder layer's elementwise math (inference only).

Each replaces several PyTorch kernels: at decode batch sizes a loop of Ouro
runs ~1,400 small kernels eagerly, and launch latency, not bandwidth, bounds
the step. Semantics are ``loopline.models.ops.TorchOps`` (tested against it):
statistics in fp32, results rounded to the activation dtype where the
reference rounds.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, pdl_options
from loopline.kernels.gemv import gemv, norm_gemv, normed_row, silu_mul_rounded, use_gemv, use_norm_gemv
from loopline.kernels.skinny_gemm import MAX_ROWS as _SKINNY_ROWS_LIMIT
from loopline.kernels.skinny_gemm import SplitKPartials, skinny_linear, use_skinny
from loopline.models.ops import TorchOps, rotary_cos_sin

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the ops are unusable without triton
    triton = None


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, b_ptr, wb_ptr, wn_ptr, x_out_ptr, y_ptr,  # rows of [N, H] (b: or SPLITS partials [S, N, H]); weights [H]
        n_cols, eps,
        stride_x, stride_b, stride_bs, stride_xo, stride_y,
        BLOCK: tl.constexpr, HAS_BRANCH: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
    ):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        dtype = y_ptr.dtype.element_ty
        # x' = x + w_b * norm(b), rounded like the reference: norm -> dtype, * w -> dtype, + x -> dtype
        y = normed_row(x_ptr + row * stride_x, b_ptr + row * stride_b, wb_ptr, wn_ptr, x_out_ptr + row * stride_xo,
                       n_cols, eps, BLOCK, HAS_BRANCH, True, dtype, stride_bs, SPLITS)
        tl.store(y_ptr + row * stride_y + cols, y.to(dtype), mask=cols < n_cols)

    @triton.jit
    def _norm_exit_gate_kernel(
        x_ptr, b_ptr, wb_ptr, wn_ptr, wg_ptr, bg_ptr, y_ptr, gate_ptr,  # rows of [N, H]; weights [H]; gate [N] fp32
        n_cols, eps,
        stride_x, stride_b, stride_bs, stride_y,
        BLOCK: tl.constexpr, HAS_BRANCH: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        dtype = y_ptr.dtype.element_ty
        # The residual sum itself is not needed after the loop: only h = norm(x') is stored.
        y = normed_row(x_ptr + row * stride_x, b_ptr + row * stride_b, wb_ptr, wn_ptr, x_ptr, n_cols, eps, BLOCK,
                       HAS_BRANCH, False, dtype, stride_bs, SPLITS)
        tl.store(y_ptr + row * stride_y + cols, y.to(dtype), mask=m)
        logit = tl.sum(y * tl.load(wg_ptr + cols, mask=m, other=0.0).to(tl.float32), axis=0)
        if HAS_BIAS:
            logit += tl.load(bg_ptr).to(tl.float32)
        tl.store(gate_ptr + row, logit)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,  # q/k [N, H, D] with unit last stride; out contiguous
        q_heads, k_heads, stride_qn, stride_qh, stride_kn, stride_kh, stride_cs,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # Axis 2 picks q (0) or k (1): one launch rotates both, read in place from the packed projection.
        n = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF_PAD)  # a head size that is not a power of two: masked past HALF
        if tl.program_id(2) == 0:
            x_ptr, out_ptr, n_heads, stride_n, stride_h = q_ptr, qo_ptr, q_heads, stride_qn, stride_qh
        else:
            x_ptr, out_ptr, n_heads, stride_n, stride_h = k_ptr, ko_ptr, k_heads, stride_kn, stride_kh
        mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]
        dtype = out_ptr.dtype.element_ty
        src = (n * stride_n + heads.to(tl.int64) * stride_h)[:, None]
        base = (n * n_heads + heads.to(tl.int64))[:, None] * (2 * HALF)
        x1 = tl.load(x_ptr + src + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + src + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + n * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]  # halves equal
        s = tl.load(sin_ptr + n * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        # reference: x*cos + rotate_half(x)*sin, each product rounded to dtype, then the sum
        o1 = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + base + d[None, :], o1, mask=mask)
        tl.store(out_ptr + base + HALF + d[None, :], o2, mask=mask)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = out_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, silu_mul_rounded(g, u, dtype), mask=mask)


def _pack(linears: list[torch.nn.Linear]) -> tuple[Tensor, list[int]]:
    """One tensor holding the weights of ``linears`` (stacked rows); each weight becomes a view of it."""
    packed = torch.cat([lin.weight.data for lin in linears])
    sizes, offset = [], 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = packed[offset:offset + rows]
        sizes.append(rows)
        offset += rows
    return packed, sizes


class SkinnyRows(NamedTuple):
    """Per projection, the largest batch (from 2 rows) that takes the skinny split-K kernel (launched with PDL,
    like the one-row GEMVs) instead of cuBLAS; 0: cuBLAS for every batch of more than one row. One row takes
    the GEMV kernels; the down projection keeps its own range (the skinny kernel up to skinny_gemm.MAX_ROWS)."""

    qkv: int = 0  # the packed q/k/v
    gate_up: int = 0  # the packed gate/up
    o: int = 0  # o_proj

    @classmethod
    def parse(cls, text: str) -> SkinnyRows:
        """``"16"`` (every projection) or ``"qkv=16,o=16"`` (the others 0)."""
        if "=" not in text:
            return cls(*[int(text)] * 3)
        fields = dict(part.split("=") for part in text.split(","))
        unknown = set(fields) - set(cls._fields)
        if unknown:
            raise ValueError(f"skinny rows: unknown projection(s) {sorted(unknown)}; allowed: {list(cls._fields)}")
        return cls(**{k: int(v) for k, v in fields.items()})


# q/k/v and o_proj take the skinny kernel up to 16 rows, gate/up keeps cuBLAS (H100, whole decode steps,
# tools/profile_step.py --skinny-max-rows, 1,088-token contexts, one call): 2 / 4 / 8 / 16 rows 1.654 / 1.841 /
# 2.131 / 2.901 ms against 1.750 / 1.950 / 2.205 / 2.996 with cuBLAS for all three and 1.719 / 1.880 / 2.158 /
# 2.936 with the kernel for all three (which an H200 had measured slower than cuBLAS: 2 rows 1.490 vs 1.469 ms,
# 8 rows 1.976 vs 1.901). bench_gemm: the kernel wins o_proj from 2 rows and q/k/v from 4, loses gate/up.
SKINNY_MAX_ROWS = SkinnyRows(qkv=16, o=16)


def _linear(x: Tensor, weight: Tensor, skinny_max_rows: int = 0,
            sum_splits: bool = True) -> Tensor | SplitKPartials:
    """``F.linear(x, weight)``; one row takes the GEMV kernel, which streams the weight faster than cuBLAS, and
    2 to ``skinny_max_rows`` rows the skinny split-K kernel (``sum_splits=False``: its partials unsummed)."""
    if use_gemv(x, weight):
        return gemv(x, weight)
    if 2 <= x.shape[0] <= skinny_max_rows and use_skinny(x, weight):
        return skinny_linear(x, weight, sum_splits=sum_splits)
    return torch.nn.functional.linear(x, weight)


def _norm_warps(rows: int) -> int:
    """Warps per row of the add + RMSNorm kernel. A lone decode row's norm is a latency-bound link of the
    step's chain: 8 warps gave a 1.188 ms one-row async step against 1.202 / 1.205 ms with 4 (H200,
    ``f7d6635``, same call); more rows keep 4 (not measured)."""
    return 8 if rows == 1 else 4


def _row_major(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _branch_operand(branch: Tensor | SplitKPartials) -> tuple[Tensor, int, int, int]:
    """A norm kernel's branch: ``(rows, row stride, split stride, splits)``; 0 splits: a plain tensor."""
    if isinstance(branch, SplitKPartials):
        return branch.parts, branch.parts.stride(1), branch.parts.stride(0), branch.parts.shape[0]
    branch = _row_major(branch)
    return branch, branch.stride(0), 0, 0


class TritonOps(TorchOps):
    """Fused inference kernels; falls back to the reference for autograd.

    ``prepare`` packs each layer's q/k/v and gate/up weights into one tensor and
    points the parameters at views of it, so one GEMM replaces three (two): the
    parameters keep their names, shapes, values and addresses for in-place
    weight updates.

    ``skinny_max_rows``: per projection (:class:`SkinnyRows`; an int: all three) the largest batch that takes
    the skinny kernel (default :data:`SKINNY_MAX_ROWS`). Two instances with different values compare the
    routes in one process.

    ``split_sums_in_norm``: where the skinny kernel splits K for ``o_proj`` and ``down_proj`` (2-16 and 2-64
    rows), the add + RMSNorm kernel that reads the projection as its branch sums the partials as it loads them,
    instead of a reduction kernel of their own (two launches a layer fewer; the same bits). On by default:
    whole H200 steps of 2 / 4 / 8 / 16 rows took 0.997x / 0.980x / 0.988x / 0.991x the time of the reduction
    kernel's (``tools/profile_step.py --no-split-sums-in-norm`` gives the old route).
    """

    name = "triton"

    def __init__(self, skinny_max_rows: int | SkinnyRows | None = None, split_sums_in_norm: bool = True) -> None:
        if triton is None:
            raise RuntimeError("TritonOps needs the triton package")
        rows = SKINNY_MAX_ROWS if skinny_max_rows is None else skinny_max_rows
        if isinstance(rows, int):
            rows = SkinnyRows(rows, rows, rows)
        for name, value in zip(SkinnyRows._fields, rows):
            if not 0 <= value <= _SKINNY_ROWS_LIMIT:
                raise ValueError(f"skinny_max_rows ({name}) must be in 0..{_SKINNY_ROWS_LIMIT}, got {value}")
        self.skinny_rows = SkinnyRows(*rows)
        self.split_sums_in_norm = split_sums_in_norm
        self._packed: dict[int, tuple[Tensor, list[int]]] = {}
        self._rope: tuple[tuple, Tensor] | None = None  # ((head_dim, theta, dtype, device), [P, 2, D] cos/sin)

    def prepare(self, model: torch.nn.Module) -> None:
        self._packed = {}
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self._packed[id(a)] = _pack([a.q_proj, a.k_proj, a.v_proj])
            self._packed[id(m)] = _pack([m.gate_proj, m.up_proj])
        # RoPE's cos/sin of every position, computed once (by the reference's function: the same values):
        # a step then gathers its rows in one launch instead of computing them in ~9.
        c, w = model.config, model.lm_head.weight
        key = (c.head_dim, c.rope_theta, w.dtype, w.device)
        positions = torch.arange(c.max_position_embeddings, device=w.device)
        self._rope = key, torch.stack(rotary_cos_sin(positions, c.head_dim, c.rope_theta, w.dtype), dim=1)

    def release(self, model: torch.nn.Module) -> None:
        self._packed = {}
        self._rope = None

    @property
    def skinny_max_rows(self) -> int:
        """The largest batch any projection routes to the skinny kernel."""
        return max(self.skinny_rows)

    def packed_weights(self, module: torch.nn.Module) -> tuple[Tensor, list[int]] | None:
        """``module``'s (a layer's attention or MLP) packed weight and its parts' row counts, or ``None``."""
        return self._packed.get(id(module))

    @property
    def num_packed(self) -> int:
        """How many modules run their projections from a packed weight (0 before ``prepare``, after ``release``)."""
        return len(self._packed)

    @property
    def has_rope_table(self) -> bool:
        """Whether ``cos_sin`` answers from the table ``prepare`` computed (``release`` drops it)."""
        return self._rope is not None

    def cos_sin(self, positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        # Positions are below max_position_embeddings: the engine caps max_model_len there.
        if self._rope is None or self._rope[0] != (head_dim, theta, dtype, positions.device):
            return rotary_cos_sin(positions, head_dim, theta, dtype)
        rows = self._rope[1][positions]  # [N, 2, D]
        return rows[:, 0], rows[:, 1]

    def _packed_linear(self, module: torch.nn.Module, x: Tensor, skinny_rows: int) -> tuple[Tensor, ...] | None:
        packed = self._packed.get(id(module))
        if packed is None or x.requires_grad:
            return None
        weight, sizes = packed
        return _linear(x, weight, skinny_rows).split(sizes, dim=-1)

    def _norm_packed(self, module: torch.nn.Module, x: Tensor, branch: Tensor | None, branch_weight: Tensor | None,
                     weight: Tensor, eps: float) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        """One row: the add + RMSNorm rides the packed projection's kernel (one launch instead of two)."""
        packed = self._packed.get(id(module))
        if packed is None or not use_norm_gemv(x, packed[0]):
            return None
        if branch is not None and not use_norm_gemv(branch, packed[0]):
            return None
        x_out, y = norm_gemv(x, packed[0], weight, eps, branch=branch, branch_weight=branch_weight)
        return x_out, y.split(packed[1], dim=-1)

    def norm_project_qkv(self, attn: torch.nn.Module, x: Tensor, branch: Tensor | None,  # type: ignore[override]
                         branch_weight: Tensor | None, weight: Tensor, eps: float):
        return (self._norm_packed(attn, x, branch, branch_weight, weight, eps)
                or super().norm_project_qkv(attn, x, branch, branch_weight, weight, eps))

    def norm_project_gate_up(self, mlp: torch.nn.Module, x: Tensor, branch: Tensor,  # type: ignore[override]
                             branch_weight: Tensor, weight: Tensor, eps: float):
        return (self._norm_packed(mlp, x, branch, branch_weight, weight, eps)
                or super().norm_project_gate_up(mlp, x, branch, branch_weight, weight, eps))

    def project_qkv(self, attn: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        return self._packed_linear(attn, x, self.skinny_rows.qkv) or TorchOps.project_qkv(attn, x)

    def project_gate_up(self, mlp: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return self._packed_linear(mlp, x, self.skinny_rows.gate_up) or TorchOps.project_gate_up(mlp, x)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        if x.requires_grad:
            return TorchOps.rms_norm(x, weight, eps)
        x = _row_major(x)
        y = torch.empty_like(x)
        n, h = x.shape
        _add_rms_norm_kernel[(n,)](x, x, weight, weight, x, y, h, eps, x.stride(0), x.stride(0), 0, x.stride(0),
                                   y.stride(0), BLOCK=triton.next_power_of_2(h), HAS_BRANCH=False, SPLITS=0,
                                   **pdl_options(x.device), num_warps=_norm_warps(n))
        return y

    def add_rms_norm(self, x: Tensor, branch: Tensor | SplitKPartials,  # type: ignore[override]
                     branch_weight: Tensor, next_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        if x.requires_grad or branch.requires_grad:
            return super().add_rms_norm(x, branch, branch_weight, next_weight, eps)
        x = _row_major(x)
        b, stride_b, stride_bs, splits = _branch_operand(branch)
        x_out, y = torch.empty_like(x), torch.empty_like(x)
        n, h = x.shape
        _add_rms_norm_kernel[(n,)](x, b, branch_weight, next_weight, x_out, y, h, eps, x.stride(0),
                                   stride_b, stride_bs, x_out.stride(0), y.stride(0),
                                   BLOCK=triton.next_power_of_2(h), HAS_BRANCH=True, SPLITS=splits,
                                   **pdl_options(x.device), num_warps=_norm_warps(n))
        return x_out, y

    def norm_exit_gate(self, gate: torch.nn.Linear, x: Tensor,  # type: ignore[override]
                       branch: Tensor | SplitKPartials | None, branch_weight: Tensor | None, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
        # One launch for the loop's last add + norm and the gate: a link less in a decode step's chain (the
        # gate alone, a kernel of its own, had replaced casts, a cuBLAS fp32 GEMV and its split-K reduce).
        if (x.requires_grad or (branch is not None and branch.requires_grad)
                or (gate.weight.requires_grad and torch.is_grad_enabled())):
            return super().norm_exit_gate(gate, x, branch, branch_weight, weight, eps)
        x = _row_major(x)
        b, stride_b, stride_bs, splits = _branch_operand(x if branch is None else branch)
        n, h = x.shape
        y = torch.empty_like(x)
        logits = torch.empty(n, dtype=torch.float32, device=x.device)
        if n == 0:
            return y, logits
        _norm_exit_gate_kernel[(n,)](
            x, b, weight if branch_weight is None else branch_weight, weight, gate.weight,
            gate.weight if gate.bias is None else gate.bias, y, logits, h, eps, x.stride(0), stride_b, stride_bs,
            y.stride(0), BLOCK=triton.next_power_of_2(h), HAS_BRANCH=branch is not None, SPLITS=splits,
            HAS_BIAS=gate.bias is not None, **pdl_options(x.device), num_warps=_norm_warps(n))
        return y, logits

    def rotary(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        if q.requires_grad or k.requires_grad:
            return TorchOps.rotary(q, k, cos, sin)
        q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
        n, hq, d = q.shape
        hk = k.shape[1]
        q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
        k_out = torch.empty((n, hk, d), dtype=k.dtype, device=k.device)
        block_h = min(triton.next_power_of_2(max(hq, hk)), 16)
        _rotary_kernel[(n, triton.cdiv(max(hq, hk), block_h), 2)](
            q, k, q_out, k_out, cos, sin, hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_H=block_h)
        return q_out, k_out

    def linear(self, module: torch.nn.Linear, x: Tensor) -> Tensor | SplitKPartials:  # type: ignore[override]
        # (o_proj: its result is the layer's branch, read only by add_rms_norm)
        if module.bias is not None:
            return module(x)
        return _linear(x, module.weight, self.skinny_rows.o, sum_splits=not self.split_sums_in_norm)

    def logits(self, lm_head: torch.nn.Linear, h: Tensor, needed: Tensor | None = None) -> Tensor:  # type: ignore[override]
        # One decode row: the 200 MB vocabulary projection is read only when the row's token exits.
        if needed is not None and lm_head.bias is None and use_gemv(h, lm_head.weight):
            return gemv(h, lm_head.weight, needed=needed, out_dtype=torch.float32)
        return TorchOps.logits(lm_head, h)

    def swiglu_down(self, mlp: torch.nn.Module, gate: Tensor,  # type: ignore[override]
                    up: Tensor) -> Tensor | SplitKPartials:
        down = mlp.down_proj
        if down.bias is None and use_gemv(gate, down.weight):  # one row: the activation rides the load
            return gemv(gate, down.weight, up=up)
        # Decode-sized batches (up to skinny_gemm.MAX_ROWS rows, whatever skinny_max_rows): a split-K kernel
        # streams down_proj's wide-K weight faster than cuBLAS.
        act = self.silu_mul(gate, up)
        if down.bias is None and use_skinny(act, down.weight):
            return skinny_linear(act, down.weight, sum_splits=not self.split_sums_in_norm)
        return down(act)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        if gate.requires_grad or up.requires_grad:
            return TorchOps.silu_mul(gate, up)
        gate, up = _row_major(gate), _row_major(up)
        out = torch.empty_like(gate)
        n, cols = gate.shape
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(cols, block))](gate, up, out, cols, gate.stride(0), up.stride(0),
                                                        out.stride(0), BLOCK=block)
        return out
