"""The loops of fixed-depth decode rows, counted on the host: which rows of a step start a token and which
may exit, known when the step is planned (docs/model-families.md, 'Cost').

A decode row at fixed iterations (``exit_threshold`` 1.0, no recorded depths, no lookahead head) exits at
exactly its ``max_loops``; nothing the device decides feeds back into its loop. Its slot's loop moves only
on events the host issues itself, in launch order: the step that finishes the request's prompt starts the
first decode token at loop 0 (``DeviceDecodeState.start``), and each step that schedules the row advances
it by one (a ``no_refill`` row waiting for its cohort does not: the host applies the device's cohort rule to
the same counts). So the host counts each such request's loops at launch, with no readback, and the count
is exact in the overlapped engine too: launching step n+1 before reading step n changes no event it counts.
(``lookahead_plan.py`` learns exits from readbacks because the head decides them on the device; a fixed
row's exit is known from its first loop.) A preempted request keeps its count (its slot state is restored
unchanged); a request this runner did not see start decoding (a PD handoff's import), a row of another
policy, or one whose cohort holds such a row, is *unknown*: it may start or exit in any step.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loopline.core.contracts import ScheduledRow
from loopline.models.family import FIXED_DEPTH


class FixedLoops:
    """Per request: the loops its in-flight decode token has run (0: it starts one next), where known."""

    def __init__(self, *, no_refill: bool, per_token_exits: bool) -> None:
        """``per_token_exits``: depths come from recorded traces (``exit_mode="trace"``): no row is fixed."""
        self.no_refill, self.per_token_exits = no_refill, per_token_exits
        self.done: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        """The request finished (or left this runner)."""
        self.done.pop(request_id, None)

    def step(self, decode: list[ScheduledRow], prefill: list[ScheduledRow],
             prefill_loops: Callable[[str], int]) -> tuple[np.ndarray, np.ndarray]:
        """A step with these rows is launched: ``(may_start, may_exit)``, ``[len(decode)]`` bool each (True
        where the row starts a token / exits in this step, or where that is unknown); the counts advance.
        ``prefill_loops(request_id)``: the loops the request's prompt runs."""
        n = len(decode)
        done = np.fromiter((self.done.get(r.request_id, -1) for r in decode), np.int64, n)
        fixed = np.fromiter((not self.per_token_exits and r.exit.threshold >= FIXED_DEPTH and r.exit.lookahead is None
                             for r in decode), bool, n)
        max_loops = np.fromiter((r.exit.max_loops for r in decode), np.int64, n)
        known = fixed & (done >= 0)
        run = np.ones(n, dtype=bool)
        if self.no_refill:  # the device's cohort rule (SlotOps.decode_rows) over the step's rows
            if known.all():
                run = (done > 0) | ~(done > 0).any()
            else:  # a row of unknown loop decides whether the others wait
                known[:] = False
        loop = done + 1
        may_start = ~known | (run & (loop == 1))
        may_exit = ~known | (run & (loop >= max_loops))
        after = np.where(run, np.where(loop >= max_loops, 0, loop), done)
        for r, k, count in zip(decode, known.tolist(), after.tolist()):
            if k:
                self.done[r.request_id] = count
            else:
                self.done.pop(r.request_id, None)
        for r in prefill:  # a prompt that finishes here: its first decode token starts at loop 1
            if r.is_last_chunk and r.loop == prefill_loops(r.request_id):
                self.done[r.request_id] = 0
        return may_start, may_exit
