"""Both speculation schemes in one engine (``speculative_config.scheme="auto"``, docs/speculation.md).

A step's speculating rows come as the runner's row kinds order them: draft-then-verify rounds' rows
(``SpecStep``), then pipelining lanes (``PipeLane``). :class:`BothRounds` gives the runner scheme 1's
interface over the two: each part of the step goes to its scheme, and the target rows of both come back
as one :class:`VerifyPart` (rounds' first), which the sampler samples at once and ``accept`` splits again.
The drafts' head is shared (same model, draft depth and adapter)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from loopline.core.contracts import PipeLane, ScheduledRow
from loopline.spec.replay import AcceptanceReplay
from loopline.worker.pipe_rows import PipeRounds
from loopline.worker.sampler import SamplingTensors
from loopline.worker.spec_rows import SpecRounds, VerifyPart
from loopline.worker.staging import concat


@dataclass
class _BothPart(VerifyPart):
    """A step's target rows of both schemes: rounds' rows, then lanes'."""

    parts: tuple[VerifyPart | None, VerifyPart | None] = (None, None)


class BothRounds:
    """Scheme 1's rounds and scheme 2's lanes side by side (module docstring)."""

    def __init__(self, rounds: SpecRounds, lanes: PipeRounds) -> None:
        assert rounds.head is lanes.head, "one drafts' head"
        self.rounds, self.lanes, self.head = rounds, lanes, rounds.head

    @property
    def replay(self) -> AcceptanceReplay | None:
        return self.rounds.replay

    @replay.setter
    def replay(self, replay: AcceptanceReplay | None) -> None:
        self.rounds.replay = self.lanes.replay = replay

    @staticmethod
    def _split(rows: list[ScheduledRow]) -> int:
        """Where the lanes start among a step's speculating rows."""
        return next((i for i, r in enumerate(rows) if isinstance(r.spec, PipeLane)), len(rows))

    def draft(self, rows: list[ScheduledRow]) -> None:
        m = self._split(rows)
        self.rounds.draft(rows[:m])
        self.lanes.draft(rows[m:])

    def verify_part(self, rows: list[ScheduledRow], row0: int) -> VerifyPart | None:
        m = self._split(rows)
        a, b = self.rounds.verify_part(rows[:m], row0), self.lanes.verify_part(rows[m:], row0 + m)
        parts = [p for p in (a, b) if p is not None]
        if not parts:
            return None
        return _BothPart([i for p in parts for i in p.row_idx], [st for p in parts for st in p.states],
                         *(concat([getattr(p, f) for p in parts]) for f in ("slots", "logits", "token_index", "depth")),
                         parts=(a, b))

    def target_history(self, tensors: SamplingTensors, part: VerifyPart) -> None:
        assert isinstance(part, _BothPart), "a part of verify_part's"
        a, b = part.parts
        if a is not None:  # (the rounds' rows come first)
            self.rounds.target_history(tensors, a)
        if b is not None:
            self.lanes.target_history(tensors, b)

    def accept(self, part: VerifyPart, target: Tensor) -> Tensor:
        assert isinstance(part, _BothPart), "a part of verify_part's"
        a, b = part.parts
        n = len(a.row_idx) if a is not None else 0
        committed = [] if a is None else [self.rounds.accept(a, target[:n])]
        if b is not None:
            committed.append(self.lanes.accept(b, target[n:]))
            part.verdicts = concat([b.verdicts.new_zeros(n), b.verdicts] if n else [b.verdicts])  # (rounds: none)
        return concat(committed)
