"""Depth-aware KV manager: block tables per plane, admission accounting.

Pure host-side bookkeeping (no tensors). A request of T tokens owns
``planes * ceil(T / block_size)`` blocks: one block table per plane.
With full reservation (the default) a request's blocks for its whole
``prompt + max_tokens`` are taken at admission, so an admitted request can
always finish.
"""
from __future__ import annotations

from dataclasses import dataclass

from loopline.kv.block_pool import BlockPool
from loopline.kv.layout import KVLayout


@dataclass
class KVAllocation:
    block_tables: list[list[int]]  # [plane][logical block] -> physical block
    num_tokens: int  # capacity in tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.layout = layout
        self._allocs: dict[str, KVAllocation] = {}

    # --- accounting -----------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return self.layout.num_planes * -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """Could this many tokens fit an otherwise empty pool?"""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def can_allocate(self, num_tokens: int, reserve_blocks: int = 0) -> bool:
        return self.blocks_needed(num_tokens) + reserve_blocks <= self.pool.num_free

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
    def allocate(self, request_id: str, num_tokens: int) -> KVAllocation:
        assert request_id not in self._allocs, request_id
        per_plane = -(-num_tokens // self.block_size)
        blocks = self.pool.allocate(per_plane * self.layout.num_planes)
        tables = [blocks[p * per_plane:(p + 1) * per_plane] for p in range(self.layout.num_planes)]
        alloc = KVAllocation(tables, per_plane * self.block_size)
        self._allocs[request_id] = alloc
        return alloc

    def free(self, request_id: str) -> None:
        alloc = self._allocs.pop(request_id, None)
        if alloc is not None:
            for table in alloc.block_tables:
                self.pool.release(table)

    def get(self, request_id: str) -> KVAllocation:
        return self._allocs[request_id]

    def owns(self, request_id: str) -> bool:
        return request_id in self._allocs
