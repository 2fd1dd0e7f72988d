"""Binds a backend, the KV tensors and one step's metadata into the model's ``Attention``."""
from __future__ import annotations

from torch import Tensor

from loopline.attention.base import AttentionBackend, PagedAttentionMetadata
from loopline.models.ops import Rope


class PagedAttention:
    """``attn(layer, q, k, v, rope)`` for one step: rotate, store this step's K/V, then attend.

    ``k_scale``/``v_scale``: ``[num_layers, num_kv_heads]`` fp32, the scales of FP8 caches (None otherwise);
    each layer's call gets its row.

    NOTE: every row writes before any row reads (per layer), so rows of the same
    request in one step may read each other's fresh KV (chunk wavefronts).
    """

    def __init__(self, backend: AttentionBackend, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata,
                 scale: float, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
        self.backend, self.k_cache, self.v_cache, self.meta, self.scale = backend, k_cache, v_cache, meta, scale
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None and s.shape != (k_cache.shape[0], k_cache.shape[-2]):
                raise ValueError(f"{name} must be [num_layers, num_kv_heads] = "
                                 f"{[k_cache.shape[0], k_cache.shape[-2]]}, got {list(s.shape)}")
        self.k_scale, self.v_scale = k_scale, v_scale

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if self.k_scale is None and self.v_scale is None:
            # no scale keywords: backends overriding rotate_store_attend without them keep working
            return self.backend.rotate_store_attend(kc, vc, q, k, v, rope, self.meta, self.scale)
        return self.backend.rotate_store_attend(
            kc, vc, q, k, v, rope, self.meta, self.scale,
            k_scale=None if self.k_scale is None else self.k_scale[layer],
            v_scale=None if self.v_scale is None else self.v_scale[layer])
