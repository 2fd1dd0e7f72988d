"""Which data-parallel replica gets a new request: by load, with prefix affinity.

A :class:`Router` is a strategy object the data-parallel client (``dp.DPClient``)
asks once per request. It sees only numbers (:class:`ReplicaLoad`, one per
replica) and the prompt's token ids, so it is tested without processes.

:class:`LoadAffinityRouter` (the default):

* **load**: a replica's score is its requests in flight (sent by the front end
  and not finished) plus twice the requests its scheduler reports waiting for
  admission, plus ``kv_weight`` times the fraction of its KV pool in use. The
  lowest score wins; ties rotate, so an idle pool spreads requests evenly.
* **prefix affinity**: the prompt's first ``affinity_pages`` full pages of
  ``page_size`` tokens are hashed as a chain (page j's key covers pages 0..j,
  as the engine's prefix cache keys them); a prompt whose longest known key was
  last sent to replica r goes to r again, so r's prefix cache serves those
  pages -- unless r is **overloaded**: its score exceeds the lowest by more than
  ``max_imbalance``, or its KV use is at least ``kv_high``. Then the least
  loaded replica takes it and the keys move there.
* a replica that is not ``alive`` is never chosen; its keys are forgotten.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from loopline.errors import EngineDeadError, InvalidRequestError


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows about one replica when it routes a request."""

    alive: bool
    in_flight: int = 0  # requests routed here that have not finished (the front end's own count)
    num_waiting: int = 0  # from the replica's latest EngineSnapshot
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


class Router(ABC):
    """Picks a replica for each new request."""

    @abstractmethod
    def choose(self, prompt_token_ids: Sequence[int] | None, loads: Sequence[ReplicaLoad]) -> int:
        """The index of the replica that serves a request with this prompt (``None``: ids unknown).
        Raises ``EngineDeadError`` when no replica is alive."""

    def replica_died(self, index: int) -> None:
        """Called once when replica ``index`` stopped for good."""


class LoadAffinityRouter(Router):
    """Least loaded replica, or the replica that last served the prompt's prefix while it is not overloaded."""

    def __init__(self, page_size: int = 16, affinity_pages: int = 8, max_imbalance: float = 4.0,
                 kv_high: float = 0.9, kv_weight: float = 8.0, capacity: int = 65536) -> None:
        for name, value, low in (("page_size", page_size, 1), ("affinity_pages", affinity_pages, 0),
                                 ("capacity", capacity, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
        if max_imbalance < 0:
            raise InvalidRequestError(f"max_imbalance must be >= 0, got {max_imbalance}", param="max_imbalance")
        if not 0.0 < kv_high <= 1.0:
            raise InvalidRequestError(f"kv_high must be in (0, 1], got {kv_high}", param="kv_high")
        self.page_size, self.affinity_pages = page_size, affinity_pages
        self.max_imbalance, self.kv_high, self.kv_weight = max_imbalance, kv_high, kv_weight
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica (least recently used first)
        self._next = 0  # where the rotating tie-break starts

    def score(self, load: ReplicaLoad) -> float:
        return load.in_flight + 2 * load.num_waiting + self.kv_weight * load.kv_usage

    def choose(self, prompt_token_ids: Sequence[int] | None, loads: Sequence[ReplicaLoad]) -> int:
        live = [i for i, load in enumerate(loads) if load.alive]
        if not live:
            raise EngineDeadError("no data-parallel replica is alive")
        scores = {i: self.score(loads[i]) for i in live}
        lowest = min(scores.values())
        keys = self.prefix_keys(prompt_token_ids)
        chosen = None
        for key in reversed(keys):  # the longest prefix this router has routed before
            owner = self._owner.get(key)
            if owner is not None:
                if owner in scores and not self._overloaded(loads[owner], scores[owner], lowest):
                    chosen = owner
                break
        if chosen is None:
            n = len(loads)
            ties = [i for i in live if scores[i] == lowest]
            chosen = min(ties, key=lambda i: (i - self._next) % n)
            self._next = (chosen + 1) % n
        for key in keys:
            self._owner[key] = chosen
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return chosen

    def _overloaded(self, load: ReplicaLoad, score: float, lowest: float) -> bool:
        return score - lowest > self.max_imbalance or load.kv_usage >= self.kv_high

    def prefix_keys(self, prompt_token_ids: Sequence[int] | None) -> list[int]:
        """Chained hashes of the prompt's first full pages (page j's key covers pages 0..j)."""
        if not prompt_token_ids:
            return []
        pages = min(self.affinity_pages, len(prompt_token_ids) // self.page_size)
        keys, key = [], 0
        for j in range(pages):
            key = hash((key, tuple(prompt_token_ids[j * self.page_size:(j + 1) * self.page_size])))
            keys.append(key)
        return keys

    def replica_died(self, index: int) -> None:
        for key in [k for k, owner in self._owner.items() if owner == index]:
            del self._owner[key]
