"""Paged attention backends: ``torch`` (reference, any device) and ``triton`` (GPU)."""
from __future__ import annotations

import importlib.util

import torch

from loopline.attention.base import AttentionBackend, PagedAttentionMetadata
from loopline.errors import InvalidRequestError


# Backend names vLLM users pass (any case, '-' or '_'), and the package each would need.
_NOT_PROVIDED = {"flash_attn": "flash_attn", "flashattention": "flash_attn", "flashinfer": "flashinfer"}


def not_provided_reason(name: str) -> str | None:
    """Why ``name`` (a FlashAttention or FlashInfer backend) is refused, or None for other names."""
    package = _NOT_PROVIDED.get(str(name).lower().replace("-", "_"))
    if package is None:
        return None
    installed = importlib.util.find_spec(package) is not None
    return (f"attention_backend={name!r}: loopline has no {package} backend (the {package} package is "
            f"{'installed' if installed else 'not installed'} here): each decode step's "
            "block tables and sequence lengths are derived on the GPU, inside CUDA graphs, and these libraries "
            "plan every step from page tables on the host. Use 'triton' (the default on CUDA) or 'torch'")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks triton on CUDA and torch elsewhere; an explicit choice never falls back silently."""
    reason = not_provided_reason(name)
    if reason is not None:
        raise InvalidRequestError(reason, param="attention_backend")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from loopline.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from loopline.attention.triton_backend import TritonAttentionBackend, triton_available

        if not triton_available():
            raise InvalidRequestError("attention_backend='triton' needs the triton package (pip install 'loopline[triton]')",
                                      param="attention_backend")
        try:
            return TritonAttentionBackend()
        except RuntimeError as e:  # e.g. no CUDA and no TRITON_INTERPRET
            raise InvalidRequestError(f"attention_backend='triton' is unavailable here: {e}", param="attention_backend") from e
    raise InvalidRequestError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}", param="attention_backend")


__all__ = ["AttentionBackend", "PagedAttentionMetadata", "get_attention_backend", "not_provided_reason"]
