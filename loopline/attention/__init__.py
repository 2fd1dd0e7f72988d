"""Paged attention backends: ``torch`` (reference, any device) and ``triton`` (GPU)."""
from __future__ import annotations

import torch

from loopline.attention.base import AttentionBackend, PagedAttentionMetadata
from loopline.errors import InvalidRequestError


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks triton on CUDA and torch elsewhere; an explicit choice never falls back silently."""
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


__all__ = ["AttentionBackend", "PagedAttentionMetadata", "get_attention_backend"]
