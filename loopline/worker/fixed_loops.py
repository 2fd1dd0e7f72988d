"""The loops of decode rows whose exit loop is known in advance, counted on the host: which rows of a step
start a token and which may exit, known when the step is planned (docs/model-families.md, 'Cost').

A row at fixed iterations (``exit_threshold`` 1.0, no lookahead head) exits at exactly its ``max_loops``; a
row replaying recorded depths (``exit_mode="trace"``) exits token ``k`` at ``exit_depths[k]`` (the last
repeating). Nothing the device decides feeds back into such a row's loop: its slot's loop moves only on
events the host issues itself, in launch order. The step that finishes the request's prompt starts decode
token 1 at loop 0 (``DeviceDecodeState.start``), and each step that schedules the row advances it by one
(a ``no_refill`` row waiting for its cohort does not: the host applies the device's cohort rule to the same
counts) until the known exit loop. So the host counts each such request's loops and tokens at launch, with
no readback, and the count is exact in the overlapped engine too: launching step n+1 before reading step n
changes no event it counts. (``lookahead_plan.py`` learns exits from readbacks because the head decides them
on the device.) A preempted request keeps its count (its slot state is restored unchanged); a request this
runner did not see start decoding (a PD handoff's import), a row of another policy, or one whose
``no_refill`` cohort holds such a row, is *unknown*: it may start or exit in any step.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loopline.core.contracts import ScheduledRow
from loopline.models.family import FIXED_DEPTH


class FixedLoops:
    """Per request whose exit loops are known: the loops its in-flight decode token has run (0: it starts one
    next) and that token's index in the completion."""

    def __init__(self, *, no_refill: bool, depths: Callable[[str], list[int] | None] | None = None) -> None:
        """``depths(request_id)``: the recorded depths of ``exit_mode="trace"`` (given: every row replays
        them, as the device does; None for a request: unknown). Without it a row is known at fixed
        iterations."""
        self.no_refill, self.depths = no_refill, depths
        self.done: dict[str, tuple[int, int]] = {}

    @classmethod
    def for_requests(cls, requests: dict, *, no_refill: bool, per_token_exits: bool) -> FixedLoops:
        """The count a runner's loop keeps over its ``requests`` (id -> ``RequestState``); with
        ``per_token_exits`` (``exit_mode="trace"``) every row replays its request's recorded depths."""
        return cls(no_refill=no_refill,
                   depths=(lambda rid: requests[rid].params.exit_depths) if per_token_exits else None)

    def forget(self, request_id: str) -> None:
        """The request finished (or left this runner)."""
        self.done.pop(request_id, None)

    def _exit_loop(self, row: ScheduledRow, token: int) -> int:
        """The loop at which the row's token ``token`` exits (0: not known)."""
        if self.depths is not None:
            trace = self.depths(row.request_id)
            return trace[min(token, len(trace) - 1)] if trace else 0
        fixed = row.exit.threshold >= FIXED_DEPTH and row.exit.lookahead is None
        return row.exit.max_loops if fixed else 0

    def step(self, decode: list[ScheduledRow], prefill: list[ScheduledRow],
             prefill_loops: Callable[[str], int]) -> tuple[np.ndarray, np.ndarray]:
        """A step with these rows is launched: ``(may_start, may_exit)``, ``[len(decode)]`` bool each (True
        where the row starts a token / exits in this step, or where that is unknown); the counts advance.
        ``prefill_loops(request_id)``: the loops the request's prompt runs."""
        n = len(decode)
        state = [self.done.get(r.request_id) for r in decode]
        done = np.fromiter((-1 if s is None else s[0] for s in state), np.int64, n)
        token = np.fromiter((0 if s is None else s[1] for s in state), np.int64, n)
        exit_at = np.fromiter((0 if s is None else self._exit_loop(r, s[1]) for r, s in zip(decode, state)), np.int64, n)
        known = exit_at > 0
        run = np.ones(n, dtype=bool)
        if self.no_refill:  # the device's cohort rule (SlotOps.decode_rows) over the step's rows
            if known.all():
                run = (done > 0) | ~(done > 0).any()
            else:  # a row of unknown loop decides whether the others wait
                known[:] = False
        loop = done + 1
        ends = run & (loop >= exit_at)
        may_start = ~known | (run & (loop == 1))
        may_exit = ~known | ends
        after = np.where(run, np.where(ends, 0, loop), done)
        for r, k, count, t in zip(decode, known.tolist(), after.tolist(), (token + ends).tolist()):
            if k:
                self.done[r.request_id] = (count, t)
            else:
                self.done.pop(r.request_id, None)
        for r in prefill:  # a prompt that finishes here: its decode token 1 starts at loop 1
            if r.is_last_chunk and r.loop == prefill_loops(r.request_id):
                self.done[r.request_id] = (0, 1)
        return may_start, may_exit
