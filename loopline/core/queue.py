"""Waiting queues: the admission order as a strategy (FCFS or priority)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from loopline.core.request import Request

DEFAULT_MAX_BYPASS = 32  # later arrivals that may overtake a waiting request before it goes first


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
    """Lower ``priority`` first, arrival order among equals, with bounded bypass.

    A request that ``max_bypass`` later arrivals have overtaken is served next
    (oldest first), so a stream of urgent requests cannot starve it forever.
    """

    def __init__(self, max_bypass: int = DEFAULT_MAX_BYPASS) -> None:
        if max_bypass < 1:
            raise ValueError(f"max_bypass must be >= 1, got {max_bypass}")
        self.max_bypass = max_bypass
        self._items: list[Request] = []
        self._bypassed: dict[str, int] = {}

    def _key(self, req: Request) -> tuple[int, int, int]:
        if self._bypassed.get(req.request_id, 0) >= self.max_bypass:
            return (0, 0, req.arrival_seq)  # waited long enough: before every priority
        return (1, req.priority, req.arrival_seq)

    def push(self, req: Request) -> None:
        self._items.append(req)

    def peek(self) -> Request:
        return min(self._items, key=self._key)

    def pop(self) -> Request:
        chosen = self.peek()
        self._items.remove(chosen)
        self._bypassed.pop(chosen.request_id, None)
        for req in self._items:
            if req.arrival_seq < chosen.arrival_seq:
                self._bypassed[req.request_id] = self._bypassed.get(req.request_id, 0) + 1
        return chosen

    def remove(self, req: Request) -> None:
        self._items.remove(req)
        self._bypassed.pop(req.request_id, None)

    def __len__(self) -> int:
        return len(self._items)


def make_queue(policy: str) -> RequestQueue:
    return {"fcfs": FCFSQueue, "priority": PriorityQueue}[policy]()
