"""Cost model of both speculation schemes at concurrency 1, replayed over a measured acceptance sequence.

``matches[i]`` says whether the draft of token ``i`` (the head of token ``i-1``'s loop-``d`` state) equals
the target token ``i`` (``matches[0]``, the first token from the prompt, is unused). With greedy
decoding at a fixed depth the draft depends only on loops ``1..d``, which are the target's own, so a
sequence of target tokens and its per-token matches determine every round exactly.

The cost of a step is a "loop pass": one traversal of the layer stack for every row of the step, as if a
step of a few rows cost what a one-row step costs (memory-bound). :class:`Replay` keeps the rows of every
step so a measured step cost per row count can be applied too (:meth:`Replay.time`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Replay:
    """Steps and tokens of one scheme over one sequence: ``rows[n]`` = how many steps ran ``n`` rows."""

    tokens: int = 0
    rows: Counter = field(default_factory=Counter)
    rounds: int = 0
    accepted: int = 0  # draft tokens accepted (draft_verify)

    @property
    def steps(self) -> int:
        return sum(self.rows.values())

    @property
    def passes_per_token(self) -> float:
        return self.steps / self.tokens

    def time(self, step_cost: Mapping[int, float]) -> float | None:
        """Total cost with ``step_cost[n]`` per step of ``n`` rows; None when a row count has no cost."""
        if any(n not in step_cost for n in self.rows):
            return None
        return sum(step_cost[n] * c for n, c in self.rows.items())


def draft_verify(matches: Sequence[bool], k: int, d: int, loops: int) -> Replay:
    """Draft then verify: a round runs positions ``t..t+k`` at loops ``1..d`` one at a time (``(k+1)*d``
    one-row steps; position ``t+i`` drafts token ``t+i+1``), then loops ``d+1..loops`` for the ``k+1``
    positions at once (``loops-d`` steps of ``k+1`` rows); it commits the accepted drafts plus the
    correction, or the bonus token when all ``k`` are accepted."""
    if not 1 <= d < loops:
        raise ValueError(f"d={d}; allowed: 1..{loops - 1}")
    out, t, n = Replay(), 0, len(matches)
    while t < n - 1:
        accepted = 0
        while accepted < k and t + accepted + 1 < n and matches[t + accepted + 1]:
            accepted += 1
        out.rows[1] += (k + 1) * d
        out.rows[k + 1] += loops - d
        out.rounds += 1
        out.accepted += accepted
        step = min(accepted + 1, n - 1 - t)  # the sequence ends: count only tokens it holds
        out.tokens += step
        t += step
    return out


def plain(num_tokens: int, loops: int) -> Replay:
    """Non-speculative decoding at fixed depth: ``loops`` one-row steps per token."""
    return Replay(tokens=num_tokens, rows=Counter({1: num_tokens * loops}))


def pipeline(matches: Sequence[bool], d: int, loops: int) -> Replay:
    """Depth-pipelined speculation: token ``i+1`` enters at loop 1 right after token ``i``'s loop ``d``
    (its draft); when token ``i``'s last loop disagrees with that draft, the rows behind ``i`` are dropped
    and the corrected token ``i+1`` enters in the next step. Every step runs one loop of every row in
    flight (the dropped ones until the step that exposes the mismatch). No row starts for a token past
    the sequence's end (the engine knows ``max_tokens``), as :mod:`loopline.spec.reference` steps it."""
    if not 1 <= d < loops:
        raise ValueError(f"d={d}; allowed: 1..{loops - 1}")
    intervals: list[tuple[int, int]] = []  # [start, end) steps of every row that ran
    start = 0
    for i in range(len(matches) - 1):
        end = start + loops
        if matches[i + 1]:
            intervals.append((start, end))
            start += d
            continue
        intervals.append((start, end))
        # The wrong draft and the drafts it spawned (rows i+1, i+2, ...; the last row is n-2) run until
        # token i's last loop exposes it.
        intervals.extend((s, end) for j, s in enumerate(range(start + d, end, d), i + 1) if j < len(matches) - 1)
        start = end
    rows = Counter()
    last = max(e for _, e in intervals) if intervals else 0
    per_step = [0] * last
    for s, e in intervals:
        for step in range(s, e):
            per_step[step] += 1
    rows.update(n for n in per_step if n)
    return Replay(tokens=len(matches) - 1, rows=rows, rounds=0, accepted=sum(bool(m) for m in matches[1:]))
