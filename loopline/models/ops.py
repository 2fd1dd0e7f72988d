"""The elementwise math of a decoder layer as one small interface.

``TorchOps`` is the reference (plain PyTorch, differentiable): the model's
semantics. Faster implementations (``loopline.kernels.fused.TritonOps``)
fuse the same math into fewer kernels for inference on the GPU and are
tested against it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def upcast(t: Tensor) -> Tensor:
    """``t`` in fp32 for the statistics and products taken in fp32; float64 stays float64, so a
    float64 model computes in float64 throughout (finite-difference gradient checks)."""
    return t if t.dtype == torch.float64 else t.float()


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin ``[N, head_dim]`` for rotate-half RoPE, angles in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class TorchOps:
    name = "torch"

    def prepare(self, model: torch.nn.Module) -> None:
        """Called once the model's weights sit on their device (again, after a sleep)."""

    def release(self, model: torch.nn.Module) -> None:
        """Called before the model's weights leave the device."""

    @staticmethod
    def project_qkv(attn: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q_proj(x), k_proj(x), v_proj(x)`` of an attention module: ``[N, q]``, ``[N, kv]``, ``[N, kv]``."""
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    @staticmethod
    def linear(module: torch.nn.Linear, x: Tensor) -> Tensor:
        """``module(x)``: a projection with no packing (the attention output's ``o_proj``)."""
        return module(x)

    @staticmethod
    def exit_gate(gate: torch.nn.Linear, h: Tensor) -> Tensor:
        """fp32 exit-gate logits ``[N]`` of ``h`` ``[N, hidden]``: the product taken in fp32."""
        bias = None if gate.bias is None else upcast(gate.bias)
        # Training runs under bf16 autocast, which would round the product to bf16; inference never does.
        fp32 = (torch.autocast(h.device.type, enabled=False) if torch.is_autocast_enabled(h.device.type)
                else contextlib.nullcontext())
        with fp32:
            return F.linear(upcast(h), upcast(gate.weight), bias).squeeze(-1)

    def norm_exit_gate(self, gate: torch.nn.Linear, x: Tensor, branch: Tensor | None, branch_weight: Tensor | None,
                       weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """The loop's end: ``h = norm(x + norm(branch))`` (``x`` without a branch) and its fp32 exit-gate
        logits. Returns ``(h, logits [N])``."""
        _, h = self._add_norm(x, branch, branch_weight, weight, eps)
        return h, self.exit_gate(gate, h)

    @staticmethod
    def logits(lm_head: torch.nn.Linear, h: Tensor, needed: Tensor | None = None) -> Tensor:
        """fp32 ``lm_head(h)`` ``[M, vocab]``. ``needed`` (``[M]`` bool) marks the rows whose logits are
        used; an implementation may return zeros for the others instead of computing them."""
        return upcast(lm_head(h))

    @staticmethod
    def project_gate_up(mlp: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
        """``gate_proj(x), up_proj(x)`` of a SwiGLU MLP."""
        return mlp.gate_proj(x), mlp.up_proj(x)

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``weight * (x * rsqrt(mean(x^2) + eps))``: statistics in fp32, cast back before the weight."""
        dtype = x.dtype
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def add_rms_norm(self, x: Tensor, branch: Tensor, branch_weight: Tensor, next_weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        """Sandwich-norm residual: ``x' = x + norm(branch)``; returns ``(x', norm'(x'))``."""
        x = x + self.rms_norm(branch, branch_weight, eps)
        return x, self.rms_norm(x, next_weight, eps)

    def norm_project_qkv(self, attn: torch.nn.Module, x: Tensor, branch: Tensor | None,
                         branch_weight: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """The norm in front of q/k/v and the projection: ``x' = x + norm(branch)`` (``x`` without a
        branch), then ``project_qkv(norm'(x'))``. Returns ``(x', (q, k, v))``."""
        x, normed = self._add_norm(x, branch, branch_weight, weight, eps)
        return x, self.project_qkv(attn, normed)

    def norm_project_gate_up(self, mlp: torch.nn.Module, x: Tensor, branch: Tensor, branch_weight: Tensor,
                             weight: Tensor, eps: float) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``x' = x + norm(branch)``, then ``project_gate_up(norm'(x'))``. Returns ``(x', (gate, up))``."""
        x, normed = self.add_rms_norm(x, branch, branch_weight, weight, eps)
        return x, self.project_gate_up(mlp, normed)

    def _add_norm(self, x: Tensor, branch: Tensor | None, branch_weight: Tensor | None, weight: Tensor,
                  eps: float) -> tuple[Tensor, Tensor]:
        if branch is None:
            return x, self.rms_norm(x, weight, eps)
        return self.add_rms_norm(x, branch, branch_weight, weight, eps)

    @staticmethod
    def cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """RoPE's cos/sin ``[N, head_dim]`` at ``positions`` (:func:`rotary_cos_sin`)."""
        return rotary_cos_sin(positions, head_dim, theta, dtype)

    @staticmethod
    def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate-half RoPE on ``[N, heads, D]`` q and k; cos/sin ``[N, D]``."""
        def rot(x: Tensor) -> Tensor:
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            return x * cos[:, None, :] + rotated * sin[:, None, :]

        return rot(q), rot(k)

    @staticmethod
    def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def swiglu_down(self, mlp: torch.nn.Module, gate: Tensor, up: Tensor) -> Tensor:
        """The MLP's output ``down_proj(silu(gate) * up)``."""
        return mlp.down_proj(self.silu_mul(gate, up))


TORCH_OPS = TorchOps()


# eq=False: identity hash. A field-wise __hash__ over tensors is meaningless, and torch 2.11's dynamo hashes
# the object half-built while tracing its __init__ (AttributeError on `cos` under torch.compile).
@dataclass(frozen=True, eq=False)
class Rope:
    """Rotary position embedding of one step's rows: ``cos``/``sin`` ``[N, head_dim]``, applied by ``ops``.

    Attention objects receive q and k before rotation together with a ``Rope``, so a backend
    may rotate while storing K/V (one kernel) instead of after a separate pass.
    """

    cos: Tensor
    sin: Tensor
    ops: TorchOps = TORCH_OPS

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated ``(q, k)`` for ``[N, heads, D]`` q and ``[N, kv_heads, D]`` k."""
        return self.ops.rotary(q, k, self.cos, self.sin)
