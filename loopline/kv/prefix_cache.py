"""Prefix cache: full prompt pages keyed by a chained hash of their token ids.

A page covers ``block_size`` prompt positions and stores one block per plane
(all loops' KV of those positions). Keys chain the previous page's key, the
page's token ids, the weight version and the KV layout, so a page is only
reused after the very same prefix under the same weights and layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from loopline.kv.block_pool import BlockPool


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    evictions: int = 0  # pages evicted

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, layout_name: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self.layout_name = layout_name
        self.pages: dict[int, list[int]] = {}  # key -> block per plane
        self._block_key: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    def page_keys(self, token_ids: list[int], salt: object, num_pages: int) -> list[int]:
        keys, prev = [], hash((self.layout_name, salt))
        bs = self.block_size
        for i in range(num_pages):
            prev = hash((prev, tuple(token_ids[i * bs:(i + 1) * bs])))
            keys.append(prev)
        return keys

    def match(self, keys: list[int]) -> list[list[int]]:
        """Blocks (per plane) of the longest cached run of ``keys``, referenced for the caller."""
        found = []
        for key in keys:
            blocks = self.pages.get(key)
            if blocks is None:
                break
            for b in blocks:
                self.pool.ref(b)
            found.append(blocks)
        return found

    def insert(self, key: int, blocks: list[int]) -> None:
        if key in self.pages or any(b in self._block_key for b in blocks):
            return
        self.pages[key] = list(blocks)
        for b in blocks:
            self._block_key[b] = key

    def evict_hook(self, block: int):
        """For ``BlockPool.release``: cached blocks go idle with an evict callback."""
        return self._evict if block in self._block_key else None

    def _evict(self, block: int) -> None:
        key = self._block_key.get(block)
        if key is None:
            return
        self.stats.evictions += 1
        for b in self.pages.pop(key):
            self._block_key.pop(b, None)
            if b != block:
                self.pool.uncache_idle(b)

    def reset(self) -> None:
        """Forgets every page; idle cached blocks become free, referenced ones stay with their owners."""
        for block in list(self._block_key):
            self.pool.uncache_idle(block)
        self.pages.clear()
        self._block_key.clear()

    @property
    def num_pages(self) -> int:
        return len(self.pages)
