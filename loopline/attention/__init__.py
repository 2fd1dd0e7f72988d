"""Paged attention backends: ``torch`` (reference, any device), ``triton`` (GPU) and ``flashinfer`` (GPU, an extra)."""
from __future__ import annotations

import importlib.util

import torch

from loopline.attention.base import AttentionBackend, PagedAttentionMetadata
from loopline.errors import InvalidRequestError

# FlashAttention names vLLM users pass (any case, '-' or '_'); FlashInfer is a backend here ('flashinfer').
_NOT_PROVIDED = {"flash_attn": "flash_attn", "flashattention": "flash_attn"}


def not_provided_reason(name: str) -> str | None:
    """Why ``name`` (a FlashAttention backend, or FlashInfer spelled otherwise than 'flashinfer') is refused,
    or None for other names."""
    key = str(name).lower().replace("-", "_")
    if key in ("flashinfer", "flash_infer") and name != "flashinfer":
        return f"attention_backend={name!r}: loopline spells it 'flashinfer'"
    package = _NOT_PROVIDED.get(key)
    if package is None:
        return None
    installed = importlib.util.find_spec(package) is not None
    return (f"attention_backend={name!r}: loopline has no {package} backend (the {package} package is "
            f"{'installed' if installed else 'not installed'} here): each decode step's "
            "block tables and sequence lengths are derived on the GPU, inside CUDA graphs, and its planner wants "
            "them on the host. Use 'triton' (the default on CUDA), 'flashinfer' or 'torch'")


def auto_attention_backend(device: torch.device) -> str:
    """What ``attention_backend='auto'`` picks on ``device``.

    Triton on CUDA: measured against FlashInfer on an H100 (docs/benchmarks/h100-2026-12-06.md), the engine with
    FlashInfer ran 0.71x / 0.95x / 0.97x Triton's output rate at concurrency 1 / 32 / 128, its faster prefill
    kernel lost to the host-planned prompt steps."""
    return "triton" if device.type == "cuda" else "torch"


def flashinfer_unavailable_reason(device: torch.device) -> str | None:
    """Why ``attention_backend='flashinfer'`` cannot run on ``device`` here, or None if it can."""
    if device.type != "cuda":
        return (f"attention_backend='flashinfer' needs a CUDA device, got {device.type!r}: "
                "use 'torch' (or 'auto') on this device")
    if importlib.util.find_spec("flashinfer") is None:
        return ("attention_backend='flashinfer' needs the flashinfer package: pip install 'loopline[flashinfer]' "
                "(flashinfer-python==0.7.4)")
    from loopline.attention.triton_backend import triton_available

    if not triton_available():
        return "attention_backend='flashinfer' needs the triton package for its K/V store kernels (pip install 'loopline[triton]')"
    return None


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks by :func:`auto_attention_backend`; an explicit choice never falls back silently."""
    reason = not_provided_reason(name)
    if reason is not None:
        raise InvalidRequestError(reason, param="attention_backend")
    if name == "auto":
        name = auto_attention_backend(device)
    if name == "flashinfer":
        why = flashinfer_unavailable_reason(device)
        if why is not None:
            raise InvalidRequestError(why, param="attention_backend")
        from loopline.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device)
    if name == "torch":
        from loopline.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from loopline.attention.triton_backend import (
            TritonAttentionBackend,
            triton_available,
        )

        if not triton_available():
            raise InvalidRequestError("attention_backend='triton' needs the triton package (pip install 'loopline[triton]')",
                                      param="attention_backend")
        try:
            return TritonAttentionBackend()
        except RuntimeError as e:  # e.g. no CUDA and no TRITON_INTERPRET
            raise InvalidRequestError(f"attention_backend='triton' is unavailable here: {e}", param="attention_backend") from e
    raise InvalidRequestError(f"attention_backend must be 'auto', 'torch', 'triton' or 'flashinfer', got {name!r}", param="attention_backend")


__all__ = ["AttentionBackend", "PagedAttentionMetadata", "auto_attention_backend", "flashinfer_unavailable_reason",
           "get_attention_backend", "not_provided_reason"]
