"""The startup heap kept out of Python's cyclic garbage collector while an engine serves.

A built engine leaves ~190,000 long-lived objects (torch, transformers, the model, its buffers and
graphs). The collector's oldest generation scans all of them whenever enough new objects have
survived, which while serving means a pause in the step loop: 56 ms a full collection on a 2-vCPU
host with the tiny test model, a step loop of 128 rows there paused once for 62 ms in 256 steps
(docs/design.md, "The startup heap"). ``gc.freeze`` moves every object alive at that moment to a
permanent generation the collector never scans, as a serving engine's startup state is meant to live
for the whole process; reference counting still frees them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


_frozen = False  # whether this module froze the heap (a process that never asked keeps its collector as is)


def freeze_startup_heap() -> None:
    """Collects what is garbage now, then freezes every object left (for a process that owns its engine
    until it exits: the engine process)."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = True


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """:func:`freeze_startup_heap` for the block only: on exit the frozen objects rejoin the collector, so
    an engine built before the block and dropped after it (``loopline bench`` builds one per variant) can
    still be collected, cycles included. A heap frozen before the block (by the application, a test
    harness) is left as it is: nothing is frozen or unfrozen."""
    global _frozen
    if gc.get_freeze_count():
        yield
        return
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
        _frozen = False


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """For a block that drops long-lived state (``sleep`` frees the KV pool and the CUDA graphs): where
    the heap is frozen, its objects rejoin the collector for the block, so that what the block drops is
    collected, cycles included, and the heap is frozen again after it. Elsewhere nothing happens."""
    if not _frozen:
        yield
        return
    gc.unfreeze()
    try:
        yield
    finally:
        freeze_startup_heap()
