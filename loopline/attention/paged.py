"""Binds a backend, the KV tensors and one step's metadata into the model's ``Attention``."""
from __future__ import annotations

from torch import Tensor

from loopline.attention.base import AttentionBackend, PagedAttentionMetadata
from loopline.models.ops import Rope


class PagedAttention:
    """``attn(layer, q, k, v, rope)`` for one step: rotate, store this step's K/V, then attend.

    NOTE: every row writes before any row reads (per layer), so rows of the same
    request in one step may read each other's fresh KV (chunk wavefronts).
    """

    def __init__(self, backend: AttentionBackend, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata,
                 scale: float) -> None:
        self.backend, self.k_cache, self.v_cache, self.meta, self.scale = backend, k_cache, v_cache, meta, scale

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        return self.backend.rotate_store_attend(kc, vc, q, k, v, rope, self.meta, self.scale)
