"""Shared setup of the Triton kernel tests: the GPU when there is one, else Triton's CPU interpreter.

Import it before triton or any loopline kernel module: Triton reads ``TRITON_INTERPRET``
when a kernel is decorated. CPU cases are fp32 only (the interpreter mis-computes
``tl.dot`` on bf16 operands); bf16 runs on the GPU, or on the CPU inside
:func:`bf16_dot_in_the_interpreter`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal within fp32 rounding for fp32, within bf16 rounding otherwise."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@contextlib.contextmanager
def bf16_dot_in_the_interpreter():
    """Inside, Triton's CPU interpreter multiplies bf16 ``tl.dot`` operands as numbers: it holds bf16 as the
    raw 16 bits (numpy has no bf16) and would multiply those. The operands are widened to fp32 first, which
    is exact, like a tensor core's bf16 products, so the products and their fp32 sums are what the GPU
    computes up to summation order. Nothing changes on the GPU."""
    if DEVICE == "cuda":
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot = InterpreterBuilder.create_dot

    def widened(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        return TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, *rest):
        return dot(self, widened(a), widened(b), *rest)

    InterpreterBuilder.create_dot = create_dot
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = dot


def fused_decode_for_every_split_count(**backend_args):
    """A Triton attention backend whose fused decode kernel also serves launches without splits (by default it
    serves split launches only; the CPU never splits). ``backend_args`` go to ``TritonAttentionBackend``."""
    from loopline.attention.triton_backend import SplitRule, TritonAttentionBackend

    return TritonAttentionBackend(split_rule=SplitRule(fused_decode_min_splits=1), **backend_args)


def triton_backends(attention):
    """An engine's Triton kernels on ``DEVICE`` (``select_backends("triton", "triton")``), attending by ``attention``."""
    from loopline.worker.backends import select_backends

    return dataclasses.replace(select_backends("triton", "triton", torch.device(DEVICE)), attention=attention)


@contextlib.contextmanager
def spy_on_kernel(name: str, launches: list):
    """Records each launch of the backend module's kernel ``name`` (its grid) in ``launches``."""
    import loopline.attention.triton_backend as tb

    kernel = getattr(tb, name)

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    setattr(tb, name, Spy())
    try:
        yield
    finally:
        setattr(tb, name, kernel)


@contextlib.contextmanager
def spy_on_kernel_options(name: str, options: list):
    """Records the launch options (``num_warps``, ``maxnreg``, ...: the keyword arguments that are not the
    kernel's own parameters) of each launch of the backend module's kernel ``name`` in ``options``."""
    import loopline.attention.triton_backend as tb

    kernel = getattr(tb, name)
    params = set(kernel.arg_names)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options.append({k: v for k, v in kwargs.items() if k not in params})
                return kernel[grid](*args, **kwargs)
            return launch

    setattr(tb, name, Spy())
    try:
        yield
    finally:
        setattr(tb, name, kernel)


def one_layer(hidden: int, q: int, kv: int, inter: int, dtype: torch.dtype, g: torch.Generator):
    """``(model, attn, mlp)``: one layer's bias-free projections and what TritonOps.prepare reads besides the
    layers (RoPE's shape, the activation dtype via lm_head)."""
    attn, mlp = torch.nn.Module(), torch.nn.Module()
    shapes = {"q_proj": (attn, hidden, q), "k_proj": (attn, hidden, kv), "v_proj": (attn, hidden, kv),
              "o_proj": (attn, q, hidden), "gate_proj": (mlp, hidden, inter), "up_proj": (mlp, hidden, inter),
              "down_proj": (mlp, inter, hidden)}
    for name, (mod, k, n) in shapes.items():
        lin = torch.nn.Linear(k, n, bias=False).to(DEVICE, dtype)  # requires grad, as the engine's parameters do
        lin.weight.data = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
        setattr(mod, name, lin)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = [torch.nn.Module()]
    model.model.layers[0].self_attn, model.model.layers[0].mlp = attn, mlp
    model.config = SimpleNamespace(head_dim=16, rope_theta=10000.0, max_position_embeddings=32)
    model.lm_head = attn.o_proj
    return model, attn, mlp
