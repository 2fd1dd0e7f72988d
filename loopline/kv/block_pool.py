"""A pool of physical KV pages (blocks) with reference counts. Host-side only.

A block is *free*, *in use* (reference count > 0) or *cached-idle*: it holds
a prefix-cache page nobody references; such blocks are reused in LRU order
only when no free block is left.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        # block -> eviction callback, in LRU order (oldest first)
        self._idle: OrderedDict[int, Callable[[int], None]] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise MemoryError(f"asked for {count} KV blocks, {self.num_free} available")  # callers check first
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, evict = self._idle.popitem(last=False)
                evict(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def ref(self, block: int) -> None:
        """Takes a reference on an in-use or cached-idle block."""
        if self._refs[block] == 0:
            self._idle.pop(block)
        self._refs[block] += 1

    def release(self, blocks: list[int], cached: Callable[[int], Callable[[int], None] | None] = lambda b: None) -> None:
        """Drops one reference per block; unreferenced blocks go idle if ``cached(b)`` gives an evict hook, else free."""
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, block
            if self._refs[block] == 0:
                evict = cached(block)
                if evict is None:
                    self._free.append(block)
                else:
                    self._idle[block] = evict

    def uncache_idle(self, block: int) -> None:
        """An idle cached block stops being cached: it becomes free."""
        if block in self._idle:
            del self._idle[block]
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]
