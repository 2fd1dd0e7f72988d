"""Replayed acceptance for cost measurements on random weights (``tools/spec_speed.py --replay-acceptance``).

Random weights accept no draft, so a speculative run on real model shapes measures only its worst case. A
:class:`AcceptanceReplay` installed on the engine's speculative rounds (``runner.spec.replay``) replaces the
comparison of each draft with its target by a draw: the draft for completion index ``i`` of the request in
decode slot ``s`` is accepted with probability ``p_j`` (``j``: the draft's position in its round for draft
then verify; the pipeline uses ``p_0`` for every lane). The draw is a hash of ``(seed, s, i)``, so a lane
judged in several steps gets the same verdict each time. The engine then does the work that acceptance
pattern costs -- the same steps, rows, commits, rollbacks and entries -- but the committed tokens are the
targets' and the drafts' K/V is kept as if they had matched: outputs are meaningless. A measurement hook,
never installed by the engine itself; tables made with it say the acceptance is replayed.

**Re-drafting** (the pipeline's ``redraft``) judges a lane at every loop past the draft loop, not once at its
exit: where the head's token at loop ``l`` differs from the one at loop ``l - 1`` (the lane's current draft),
the lanes behind it are dropped (a change at the exit loop is a rejected draft). With ``loop_changes`` the
replay draws those changes: loop ``l`` of completion index ``i`` changes with probability ``q_l`` (the list's
entry for loop ``l``, from loop 2 on; the last entry for deeper loops), each ``(slot, i, l)`` its own draw, the
loops independent of one another. Without it a replay stands for drafts judged at their exit only, and the
engine turns re-drafting off.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


class AcceptanceReplay:
    """Accepts the draft at position ``j`` of a round with probability ``probs[j]`` (the last entry for later
    positions)."""

    #: loops a change table covers (:meth:`change_bounds`); deeper loops take its last entry
    MAX_LOOPS = 64

    def __init__(self, probs: Sequence[float], seed: int = 0, loop_changes: Sequence[float] | None = None) -> None:
        if not probs or any(not 0.0 <= p <= 1.0 for p in probs):
            raise ValueError(f"acceptance probabilities must be in [0, 1], got {list(probs)}")
        if loop_changes is not None and (not loop_changes or any(not 0.0 <= q <= 1.0 for q in loop_changes)):
            raise ValueError(f"loop_changes must be probabilities in [0, 1] (loops 2, 3, ...), got {loop_changes}")
        self.probs = [float(p) for p in probs]
        self.seed = int(seed)
        self.loop_changes = None if loop_changes is None else [float(q) for q in loop_changes]
        # (positions, per_position, device) -> (offsets, probabilities): made once, since a tensor built from a
        # list on a GPU is a host-to-device copy, which waits for the stream's queued work every step
        self._tables: dict[tuple, Tensor | tuple[Tensor, Tensor]] = {}

    @property
    def redrafts(self) -> bool:
        """Whether the replay stands for re-drafting (it draws the loops' changes)."""
        return self.loop_changes is not None

    def hash(self, slots: Tensor, index: Tensor, salt: Tensor | int = 0) -> Tensor:
        """A deterministic 32-bit integer (int64) per ``(slot, completion index, salt)``, broadcast; ``salt``: 0
        for a draft's verdict, the loop for a re-drafting change. ``TritonSlotOps.pipe_accept`` computes the
        same hash in its kernel (``_replay_hash``)."""
        h = (index * 1_000_003 + slots * 7_919 + salt * 15_485_863 + self.seed * 104_729 + 12_345) & 0xFFFFFFFF
        for _ in range(2):  # (an integer mix: neighbouring indices get unrelated draws)
            h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return h ^ (h >> 16)

    def uniform(self, slots: Tensor, index: Tensor, salt: Tensor | int = 0) -> Tensor:
        """:meth:`hash` as a uniform in [0, 1)."""
        return self.hash(slots, index, salt).double() / 2.0 ** 32

    def threshold(self, position: int = 0) -> int:
        """The draw's acceptance as an integer bound: ``uniform < p`` exactly when the draw's 32-bit hash is
        below ``ceil(p * 2**32)`` (a kernel compares integers, with no float rounding of ``p``)."""
        return _bound(self.probs[min(position, len(self.probs) - 1)])

    def change_bounds(self, device: torch.device) -> Tensor:
        """``[MAX_LOOPS]`` int64: loop ``l``'s change probability as :meth:`threshold`'s integer bound (0 for loops
        0 and 1: a change is against the loop before)."""
        key = ("changes", device)
        if key not in self._tables:
            assert self.loop_changes is not None, "a replay without loop_changes draws no changes"
            q = self.loop_changes
            bounds = [0, 0] + [_bound(q[min(l - 2, len(q) - 1)]) for l in range(2, self.MAX_LOOPS)]
            self._tables[key] = torch.tensor(bounds, dtype=torch.long, device=device)
        return self._tables[key]

    def changed(self, slots: Tensor, index: Tensor, loop: Tensor, depth: int) -> Tensor:
        """Whether the head's token at ``loop`` differs from the one at the loop before, for completion indices
        ``index`` of ``slots`` (broadcast); never at or before the draft loop ``depth`` (no draft to change)."""
        bounds = self.change_bounds(loop.device)
        return (self.hash(slots, index, loop) < bounds[loop.clamp(max=self.MAX_LOOPS - 1)]) & (loop > depth)

    def accepted(self, slots: Tensor, first: Tensor, positions: int, per_position: bool = True) -> Tensor:
        """``[M, positions]`` bool: the verdicts of drafts for completion indices ``first + j`` of ``slots``."""
        key = (positions, per_position, slots.device)
        if key not in self._tables:
            p = [self.probs[min(k, len(self.probs) - 1)] if per_position else self.probs[0] for k in range(positions)]
            self._tables[key] = (torch.arange(positions, device=slots.device),
                                 torch.tensor(p, dtype=torch.float64, device=slots.device))
        j, p = self._tables[key]
        return self.uniform(slots[:, None], first[:, None] + j[None, :]) < p[None, :]


def _bound(p: float) -> int:
    return math.ceil(p * 2.0 ** 32)
