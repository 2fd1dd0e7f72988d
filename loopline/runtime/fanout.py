"""One control call answered by several engines: the answers combined by the verb's rule.

The front ends over several engine loops -- ``distributed.dp.DPClient`` (data-parallel replicas)
and ``distributed.pd.PDClient`` (prefill and decode workers) -- send a verb
(``engine/verbs.py``) to each of their live engines and answer once. :class:`Gather` collects the
replies as they come (on any thread) and, once every engine answered, gives the outcome: the first
error in engine order (``name_error`` may name the engine in it), else the answers combined with
the verb's :class:`~loopline.engine.verbs.Combine` rule (:func:`combine`). :func:`fan_out` does
the whole round over engine clients whose ``call`` returns a future.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from loopline.engine.verbs import Combine, Verb
from loopline.errors import EngineDeadError, EngineStateError
from loopline.runtime.client import settle

logger = logging.getLogger("loopline.fanout")

__all__ = ["Outcome", "Gather", "combine", "fan_out"]


def combine(verb: Verb, answers: Sequence[tuple[str, Any]], engines: str) -> Any:
    """The one answer of ``verb`` from each engine's ``(label, answer)``, in engine order. ``engines``
    names them all in a disagreement error (``"data-parallel replicas"``)."""
    values = [a for _, a in answers]
    rule = verb.combine
    if rule is Combine.NONE:
        return None
    if rule is Combine.ALL:
        return all(values)
    if rule is Combine.UNION:
        return sorted({x for v in values for x in v})
    assert rule is Combine.SAME, rule
    first = values[0]
    if any(v != first for v in values):
        raise EngineStateError(f"the {engines} disagree on {verb.name}: "
                               + ", ".join(f"{label}: {a!r}" for label, a in answers))
    return first


@dataclass(frozen=True)
class Outcome:
    """A fanned-out call's one answer: its result, or its error."""

    result: Any = None
    error: BaseException | None = None


class Gather:
    """The replies of one call from the engines ``keys`` (in engine order), recorded from any thread.

    ``label(key)`` names an engine in combined errors and logs (``"replica 1"``);
    ``name_error(key, error)`` is the error the call raises when that engine's call failed.
    """

    def __init__(self, verb: Verb, keys: Sequence[Hashable], *, engines: str,
                 label: Callable[[Any], str] = str,
                 name_error: Callable[[Any, BaseException], BaseException] | None = None) -> None:
        self.verb, self.keys, self.engines, self.label = verb, list(keys), engines, label
        self.name_error = name_error or (lambda key, error: error)
        self._replies: dict[Hashable, tuple[Any, BaseException | None]] = {}
        self._lock = threading.Lock()

    def reply(self, key: Hashable, result: Any = None, error: BaseException | None = None) -> Outcome | None:
        """Records ``key``'s reply; returns the outcome once every engine answered (``None`` before,
        and for a key that is not waited for or already answered)."""
        with self._lock:
            if key not in self.keys or key in self._replies:
                return None
            self._replies[key] = (result, error)
            if len(self._replies) < len(self.keys):
                return None
        return self._outcome()

    def _outcome(self) -> Outcome:
        replies = [(key, *self._replies[key]) for key in self.keys]
        failed = [(key, error) for key, _, error in replies if error is not None]
        if failed:
            if len(failed) < len(replies):
                logger.warning("%s failed on %s (of the %s) and succeeded on the others", self.verb.name,
                               ", ".join(self.label(key) for key, _ in failed), self.engines)
            key, error = failed[0]
            return Outcome(error=self.name_error(key, error))
        try:
            return Outcome(combine(self.verb, [(self.label(key), result) for key, result, _ in replies], self.engines))
        except EngineStateError as e:
            return Outcome(error=e)


def fan_out(verb: Verb, args: tuple, until_drained: bool, clients: Sequence[tuple[Hashable, Any]], *,
            engines: str, label: Callable[[Any], str] = str,
            name_error: Callable[[Any, BaseException], BaseException] | None = None) -> concurrent.futures.Future:
    """Sends ``verb`` to every ``(key, client)`` (``client.call(name, args, until_drained)`` returns a
    future) and returns a future of the one outcome (see :class:`Gather`)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if not clients:
        future.set_exception(EngineDeadError(f"none of the {engines} is left to answer {verb.name}"))
        return future
    gather = Gather(verb, [key for key, _ in clients], engines=engines, label=label, name_error=name_error)

    def settled(key: Hashable, part: concurrent.futures.Future) -> None:
        error = part.exception()
        outcome = gather.reply(key, None if error is not None else part.result(), error)
        if outcome is not None:
            settle(future, outcome.result, outcome.error)

    for key, client in clients:
        client.call(verb.name, args, until_drained).add_done_callback(lambda part, key=key: settled(key, part))
    return future

