"""Waiting queues: the admission order as a strategy (FCFS or priority)."""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod

from loopline.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def push(self, req: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, req: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._items: list[Request] = []

    def push(self, req: Request) -> None:
        # Arrival order, also for preempted requests coming back (they resume first).
        i = len(self._items)
        while i > 0 and self._items[i - 1].arrival_seq > req.arrival_seq:
            i -= 1
        self._items.insert(i, req)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)


class PriorityQueue(RequestQueue):
    """Lower ``priority`` first; equal priorities keep arrival order (stable)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._removed: set[str] = set()

    def push(self, req: Request) -> None:
        self._removed.discard(req.request_id)
        heapq.heappush(self._heap, (req.priority, req.arrival_seq, req))

    def _prune(self) -> None:
        while self._heap and self._heap[0][2].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2].request_id)

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._prune()
        return heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        self._removed.add(req.request_id)

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)


def make_queue(policy: str) -> RequestQueue:
    return {"fcfs": FCFSQueue, "priority": PriorityQueue}[policy]()
