"""A pool of physical KV pages (blocks), host-side bookkeeping only."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids ``0..num_blocks-1``; every block is owned by one user at a time."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")  # caller checks first
        return [self._free.popleft() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
