"""Depth-aware KV manager: block tables per plane, admission accounting, prefix cache.

Pure host-side bookkeeping (no tensors). A request of T tokens owns
``planes * ceil(T / block_size)`` blocks: one block table per plane. With
full reservation (the default) blocks for the whole ``prompt + max_tokens``
are taken at admission; with incremental allocation they grow with the
sequence (the scheduler reserves the growth unless preemption is on).
"""
from __future__ import annotations

from dataclasses import dataclass

from loopline.kv.block_pool import BlockPool
from loopline.kv.layout import KVLayout
from loopline.kv.prefix_cache import PrefixCache


@dataclass
class KVAllocation:
    block_tables: list[list[int]]  # [plane][logical block] -> physical block
    num_cached_tokens: int = 0  # leading prompt tokens served by the prefix cache

    @property
    def num_logical_blocks(self) -> int:
        return len(self.block_tables[0])

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.block_tables)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout, enable_prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.layout = layout
        self._allocs: dict[str, KVAllocation] = {}
        # NOTE: `shared` keeps only each prompt token's final KV, but a new prompt's
        # depth-major prefill needs loop-r KV of its prefix at every loop r, which
        # no cached page holds: nothing is reusable soundly, so caching is off there.
        self.prefix_cache = PrefixCache(self.pool, block_size, layout.name) if (
            enable_prefix_caching and layout.name == "last_exited") else None

    # --- accounting -----------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks per plane covering ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.layout.num_planes * self.blocks_for(num_tokens)

    def fits_ever(self, num_tokens: int) -> bool:
        """Could this many tokens fit an otherwise empty pool?"""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def growth_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks still missing for the request to hold ``num_tokens`` positions."""
        alloc = self._allocs[request_id]
        return self.layout.num_planes * max(0, self.blocks_for(num_tokens) - alloc.num_logical_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    # --- ownership ------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, prompt_ids: list[int] | None = None, salt: object = None,
                 keep_free: int = 0) -> KVAllocation | None:
        """Blocks for positions ``0..num_tokens-1``, reusing cached prompt pages; ``None`` if
        fewer than ``keep_free`` blocks would stay available."""
        assert request_id not in self._allocs, request_id
        cache = self.prefix_cache
        cached: list[list[int]] = []
        if cache is not None and prompt_ids:
            cached = cache.match(self._prompt_page_keys(prompt_ids, salt))
        per_plane = self.blocks_for(num_tokens)
        new = (per_plane - len(cached)) * self.layout.num_planes
        if new + keep_free > self.pool.num_free:
            for blocks in cached:
                self.pool.release(blocks, self._hook)
            return None
        if cache is not None and prompt_ids:
            cache.stats.queries += len(prompt_ids)
            cache.stats.hits += len(cached) * self.block_size
        fresh = self.pool.allocate(new)
        extra = per_plane - len(cached)
        tables = [[page[p] for page in cached] + fresh[p * extra:(p + 1) * extra] for p in range(self.layout.num_planes)]
        alloc = KVAllocation(tables, len(cached) * self.block_size)
        self._allocs[request_id] = alloc
        return alloc

    def grow(self, request_id: str, num_tokens: int, keep_free: int = 0) -> list[list[int]] | None:
        """Extends the request to ``num_tokens`` positions; returns the new blocks per plane, or None if
        fewer than ``keep_free`` blocks would stay available."""
        need = self.growth_blocks(request_id, num_tokens)
        if need == 0:
            return [[] for _ in range(self.layout.num_planes)]
        if need + keep_free > self.pool.num_free:
            return None
        fresh = self.pool.allocate(need)
        per = need // self.layout.num_planes
        alloc = self._allocs[request_id]
        added = [fresh[p * per:(p + 1) * per] for p in range(self.layout.num_planes)]
        for table, blocks in zip(alloc.block_tables, added):
            table.extend(blocks)
        return added

    def _prompt_page_keys(self, prompt_ids: list[int], salt: object) -> list:
        """Prefix-cache keys of the prompt's pages a request may take from the cache: the full pages
        before its last token, which is always computed (its hidden state is sampled from)."""
        return self.prefix_cache.page_keys(prompt_ids, salt, (len(prompt_ids) - 1) // self.block_size)

    def share_cached_prefix(self, request_id: str, prompt_ids: list[int], salt: object) -> None:
        """Swaps the request's own leading prompt pages for cached pages of the same prefix that were
        registered after its pages were allocated (a handed-off request reserves its pages when its
        first piece arrives, maybe before an earlier request with its prefix was cached): its own
        copies are freed, the cached ones shared. Only for pages whose KV is final and identical."""
        cache = self.prefix_cache
        if cache is None or not prompt_ids:
            return
        alloc = self._allocs[request_id]
        have = alloc.num_cached_tokens // self.block_size
        # (chained keys: page i's key names the whole prefix up to it)
        found = cache.match(self._prompt_page_keys(prompt_ids, salt)[have:])
        for i, blocks in enumerate(found, start=have):
            own = [table[i] for table in alloc.block_tables]
            for table, block in zip(alloc.block_tables, blocks):
                table[i] = block
            self.pool.release(own, self._hook)
        alloc.num_cached_tokens = (have + len(found)) * self.block_size
        cache.stats.hits += len(found) * self.block_size

    def cache_prompt(self, request_id: str, prompt_ids: list[int], salt: object) -> None:
        """Registers the request's full prompt pages (their KV is complete at every loop)."""
        cache = self.prefix_cache
        if cache is None:
            return
        alloc = self._allocs[request_id]
        num_pages = len(prompt_ids) // self.block_size
        for i, key in enumerate(cache.page_keys(prompt_ids, salt, num_pages)):
            cache.insert(key, [table[i] for table in alloc.block_tables])

    def free(self, request_id: str) -> None:
        alloc = self._allocs.pop(request_id, None)
        if alloc is not None:
            for table in alloc.block_tables:
                self.pool.release(table, self._hook)

    def reset_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    def _hook(self, block: int):
        return self.prefix_cache.evict_hook(block) if self.prefix_cache is not None else None

    def get(self, request_id: str) -> KVAllocation:
        return self._allocs[request_id]

    def owns(self, request_id: str) -> bool:
        return request_id in self._allocs
