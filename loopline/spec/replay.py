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
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


class AcceptanceReplay:
    """Accepts the draft at position ``j`` of a round with probability ``probs[j]`` (the last entry for later
    positions)."""

    def __init__(self, probs: Sequence[float], seed: int = 0) -> None:
        if not probs or any(not 0.0 <= p <= 1.0 for p in probs):
            raise ValueError(f"acceptance probabilities must be in [0, 1], got {list(probs)}")
        self.probs = [float(p) for p in probs]
        self.seed = int(seed)
        # (positions, per_position, device) -> (offsets, probabilities): made once, since a tensor built from a
        # list on a GPU is a host-to-device copy, which waits for the stream's queued work every step
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}

    def uniform(self, slots: Tensor, index: Tensor) -> Tensor:
        """A deterministic uniform in [0, 1) per ``(slot, completion index)`` (``slots`` broadcast to ``index``).
        ``TritonSlotOps.pipe_accept`` computes the same hash in its kernel (``_replay_agrees``)."""
        h = (index * 1_000_003 + slots * 7_919 + self.seed * 104_729 + 12_345) & 0xFFFFFFFF
        for _ in range(2):  # (an integer mix: neighbouring indices get unrelated draws)
            h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h = h ^ (h >> 16)
        return h.double() / 2.0 ** 32

    def threshold(self, position: int = 0) -> int:
        """The draw's acceptance as an integer bound: ``uniform < p`` exactly when the draw's 32-bit hash is
        below ``ceil(p * 2**32)`` (a kernel compares integers, with no float rounding of ``p``)."""
        return math.ceil(self.probs[min(position, len(self.probs) - 1)] * 2.0 ** 32)

    def accepted(self, slots: Tensor, first: Tensor, positions: int, per_position: bool = True) -> Tensor:
        """``[M, positions]`` bool: the verdicts of drafts for completion indices ``first + j`` of ``slots``."""
        key = (positions, per_position, slots.device)
        if key not in self._tables:
            p = [self.probs[min(k, len(self.probs) - 1)] if per_position else self.probs[0] for k in range(positions)]
            self._tables[key] = (torch.arange(positions, device=slots.device),
                                 torch.tensor(p, dtype=torch.float64, device=slots.device))
        j, p = self._tables[key]
        return self.uniform(slots[:, None], first[:, None] + j[None, :]) < p[None, :]
