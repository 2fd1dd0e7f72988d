"""The depths the lookahead rule fixed, known on the host a step ahead: the coda and sampling run only for
decode rows that may exit (``exit_mode="lookahead"``, docs/lookahead.md, 'What the engine does with the
knowledge').

The rule fixes a token's exit at loop ``n + 2`` after loop ``n``, on the device (``lookahead_rule.py``).
Each step that runs it reads back, for its decode rows, the loop each ran, whether it exited and its
fixed target, on the readback stream after the step (no wait: the host takes a readback only once its
copy is done, and the engine reads every step's results anyway before it plans the step after next).
From the latest readback of a slot the host derives which loop the slot runs in the step it plans and
whether its exit there is known:

* a target fixed after loop ``n`` read back from step ``s`` is known when the step ``s + 2`` that runs
  loop ``n + 2`` is planned, also by the overlapped engine (it reads step ``s`` before planning ``s + 2``);
* a token's loop-2 exit is decided in the step of its loop 1 (loop 0 is its embedding): the synchronous
  engine knows it in time, the overlapped one does not, so that row stays a candidate;
* a token that ran ``max_loops`` loops exits; one whose target is not that loop and whose decision about
  this loop is known not to have fired does not.

A step's *candidates* are its decode rows that may exit: rows of other policies (their exits are decided
on the device), lookahead rows whose exit is known, and lookahead rows about which the host does not know
enough. Only the candidates run the coda (``lm_head``) and sampling, compacted to their count, eagerly
after the step's forward (which in such steps computes no logits: :meth:`compact`). A slot's run count
advances in every step it decodes, so a readback names the run it came from; a slot that changes owner
(a new or resumed request) is forgotten.

Exactness rests on one invariant: a row the host counts out really does not exit. Every
``exit_mode="lookahead"`` engine test replays known depths through this path (tests/worker/
test_lookahead_engine.py), synchronous and overlapped.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.models.lookahead_head import DISTANCE
from loopline.worker.lookahead_rule import NEVER
from loopline.worker.row_kinds import DecodeOut
from loopline.worker.staging import stage
from loopline.worker.step_inputs import KindRows

_FAR = 1 << 40  # a run count no slot reaches


@dataclass
class _Readback:
    """One step's decode rows on their way to the host."""

    slots: np.ndarray  # [B] int64
    runs: np.ndarray  # [B] int64: the run of each row's slot in that step
    epochs: np.ndarray  # [B] int64: the slot's owner epoch then
    host: Tensor  # [3, B] int64 (loop, exited, target), pinned on CUDA
    done: torch.cuda.Event | None  # None: the copy is complete (CPU)


class LookaheadPlan:
    """Per slot: runs launched, owner epoch, and the latest readback (its run, loop, exit flag, target).
    ``loops``: the model's loops (the rule decides about loops ``2 .. loops - 1``)."""

    def __init__(self, num_slots: int, loops: int, device: torch.device, *, counts_runs: bool = True,
                 delay: int = 0) -> None:
        """``counts_runs`` False (``no_refill``: a waiting slot's row runs without advancing): nothing is read
        back, every row stays a candidate. ``delay``: readbacks are taken that many steps late at the
        earliest (tests: the overlapped engine's lag, on the CPU where every readback is ready at once)."""
        self.loops, self.device, self.counts_runs, self.delay = loops, device, counts_runs, delay
        self.runs = np.zeros(num_slots, dtype=np.int64)
        self.epoch = np.zeros(num_slots, dtype=np.int64)
        self.seen_run = np.full(num_slots, -_FAR, dtype=np.int64)  # the run of the latest readback
        self.seen = np.zeros((3, num_slots), dtype=np.int64)  # its loop, exited flag, target
        self._pending: list[_Readback] = []
        self._stream: torch.cuda.Stream | None = None
        self.decode_rows = self.coda_rows = 0  # decode rows of steps with the rule, and those that ran the coda
        self._step: tuple[KindRows, np.ndarray, np.ndarray] | None = None  # the step being launched: rows, runs, epochs

    def forget(self, slot: int) -> None:
        """``slot`` has a new owner: nothing known of it (readbacks in flight for it are dropped)."""
        self.epoch[slot] += 1
        self.seen_run[slot] = -_FAR

    # --- planning ----------------------------------------------------------------------
    def launch(self, part: KindRows) -> None:
        """A step is launched with decode rows ``part`` (the decode kind's plan): each row's slot runs once more."""
        self._absorb()
        slots = part.host[0]
        runs = self.runs[slots] + 1
        self.runs[slots] = runs
        self._step = (part, runs, self.epoch[slots].copy())

    def candidates(self) -> np.ndarray:
        """Indices of the launched step's decode rows that may exit."""
        assert self._step is not None
        part, runs, _ = self._step
        slots, min_loops, max_loops, _, threshold = part.host
        maybe = ~self._stays(slots, runs, min_loops, max_loops) | (threshold >= NEVER)
        return np.flatnonzero(maybe)

    def _stays(self, slots: np.ndarray, runs: np.ndarray, min_loops: np.ndarray, max_loops: np.ndarray) -> np.ndarray:
        """Rows known not to exit in this run (for lookahead rows; the caller keeps other rows)."""
        r0 = self.seen_run[slots]
        loop0, exited0, target0 = self.seen[:, slots]
        ahead = runs - r0  # 1 (synchronous) or 2 (overlapped) when the readback is fresh
        # the run at which the token read back exits, where known
        exit_run = np.where(exited0 == 1, r0, np.where(target0 > 0, r0 + target0 - loop0, r0 + max_loops - loop0))
        same = runs <= exit_run  # still that token
        loop = np.where(same, loop0 + ahead, runs - exit_run)  # the loop this run runs
        known = np.where(same, loop0, -1)  # decisions known through this loop (after a new token: none)
        target = np.where(same & (exited0 == 0), target0, 0)
        exits = ((target > 0) & (loop == target)) | (loop >= max_loops)
        # a decision about this loop (taken after loop - 2) counts only where the rule lets it; unknown past `known`
        decidable = (loop >= min_loops) & (loop >= DISTANCE) & (loop < max_loops) & (loop <= self.loops - 1)
        open_ = (target == 0) & decidable & (loop - DISTANCE > known)
        fresh = (ahead >= 1) & (ahead <= DISTANCE) & (loop <= max_loops)
        return fresh & ~exits & ~open_

    # --- readback ----------------------------------------------------------------------
    def record(self, dec: DecodeOut) -> None:
        """Starts the readback of the launched step's decode rows (after its forward, before its sampling)."""
        assert self._step is not None and dec.target is not None
        if not self.counts_runs:
            return
        part, runs, epochs = self._step
        packed = torch.stack([dec.loops, (dec.exit & dec.run).long(), dec.target])  # fresh: graph outputs get reused
        done = None
        if packed.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(packed.device)
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(packed.device))
            with torch.cuda.stream(self._stream):
                host.copy_(packed, non_blocking=True)
                packed.record_stream(self._stream)
                done = torch.cuda.Event()
                done.record(self._stream)
        else:
            host = packed
        self._pending.append(_Readback(part.host[0], runs, epochs, host, done))

    def _absorb(self) -> None:
        """Takes every readback whose copy is done, oldest first (never waits)."""
        while len(self._pending) > self.delay and (self._pending[0].done is None or self._pending[0].done.query()):
            rb = self._pending.pop(0)
            ok = rb.epochs == self.epoch[rb.slots]
            slots = rb.slots[ok]
            self.seen_run[slots] = rb.runs[ok]
            self.seen[:, slots] = rb.host.numpy()[:, ok]

    # --- the compacted coda -------------------------------------------------------------
    def compact(self, dec: DecodeOut, head: Callable[[Tensor, Tensor], Tensor]) -> Compacted:
        """After a step that ran the rule (``dec.logits`` None): its readback started, and its candidates with
        their logits (``head(hidden, exit)`` -> fp32 logits)."""
        self.record(dec)
        rows = self.candidates()
        self.decode_rows += dec.exit.shape[0]
        self.coda_rows += len(rows)
        if len(rows) == dec.exit.shape[0]:  # every row may exit: no gather
            return Compacted(dec._replace(logits=head(dec.hidden, dec.exit)), None, None)
        if not len(rows):
            return Compacted(None, [], None)
        (idx,) = stage(self.device, rows.astype(np.int64))
        exit = dec.exit[idx]
        return Compacted(DecodeOut(exit, head(dec.hidden[idx], exit), dec.slots[idx], dec.loops[idx], dec.run[idx],
                                   dec.token_index[idx]), rows.tolist(), idx)

    @staticmethod
    def tokens(c: Compacted, sampled: Tensor | None, zeros: Tensor) -> Tensor:
        """The decode rows' sampled tokens from the candidates' ``sampled``; the others' are read from ``zeros``
        (int64 ``[num_rows]``, never written: a standing buffer, so a step where no row exits pays no fill)."""
        if c.rows is None:
            assert sampled is not None
            return sampled
        return zeros.index_copy(0, c.index, sampled) if c.rows else zeros


class Compacted(NamedTuple):
    """A step's decode rows that may exit, as sampling takes them."""

    dec: DecodeOut | None  # their outputs and logits (None: no row may exit)
    rows: list[int] | None  # their indices among the step's decode rows (None: every row, in order)
    index: Tensor | None  # the same on the device (None: every row)
