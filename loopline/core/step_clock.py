"""What a speculating step costs in this engine, measured (docs/speculation.md, "When it pays"). Host-side only.

Speculation pays when the tokens it commits are worth more plain decoding steps than its steps cost. What a
step costs depends on the model, the GPU and the host: on Ouro-1.4B shapes a pipelining step at one request
costs ~1.6 plain steps (memory-bound weights), on the bundled demo model ~3 (a step's time is the host's,
and a pipelining step does more of it). A model fitted on one cannot know the other, so the engine times
its own steps: :class:`StepClock` keeps the wall time of its decode steps by how many requests they hold,
plain steps apart from steps with speculating rows, and gives what a speculating request's step costs in
plain steps of the same batch:

    cost = 1 + (C / S) * (t_spec / t_plain - 1)

at ``C`` requests a step, ``S`` of them speculating: the request's own step, plus its share of what the
step's extra time costs the whole batch (every request could have run a plain step in it). With one
request pipelining beside seven plain ones, a step three times as dear costs that request 17 plain steps.

A step's wall time is what the engine's ``step()`` took: scheduling and launching it, and reading the step
before (the overlapped engine waits for that one there). So a step is timed only when the step before it
was of the same kind (the same requests a step, speculating or not) and neither holds a prompt's chunk.
"""
from __future__ import annotations

from collections.abc import Sequence

from loopline.core.contracts import ScheduledRow


class _Mean:
    """A running mean: every sample weighed alike at first, then each new one at ``WEIGHT``; a sample far from
    the mean (a collection pause, a compile) counts as at most ``CLIP`` times it, or a ``CLIP``-th of it."""

    WEIGHT, CLIP = 0.1, 4.0

    def __init__(self) -> None:
        self.n, self.mean = 0, 0.0

    def add(self, x: float) -> None:
        if self.n:
            x = min(max(x, self.mean / self.CLIP), self.mean * self.CLIP)
        self.n += 1
        self.mean += max(1.0 / self.n, self.WEIGHT) * (x - self.mean)


class StepClock:
    """Wall time of decode steps by requests a step: plain steps, and steps with speculating rows (with the
    share of their requests that speculate). See the module docstring."""

    #: samples a mean needs before it is used
    MIN_SAMPLES = 8

    def __init__(self, max_requests: int | None = None) -> None:
        self.max_requests = max_requests  # the most requests a step holds (max_num_seqs; None: no bound)
        self._plain: dict[int, _Mean] = {}
        self._spec: dict[int, _Mean] = {}
        self._share: dict[int, _Mean] = {}  # speculating requests over requests, in steps with speculating rows
        self._last: tuple[int, bool] | None = None

    def record(self, rows: Sequence[ScheduledRow], seconds: float) -> None:
        """One engine step: its rows and the wall time it took."""
        if not rows or any(r.is_prefill for r in rows):
            self._last = None
            return
        requests = {r.request_id for r in rows}
        speculating = {r.request_id for r in rows if r.spec is not None}
        kind = (len(requests), bool(speculating))
        if kind == self._last:
            c = len(requests)
            if speculating:
                self._spec.setdefault(c, _Mean()).add(seconds)
                self._share.setdefault(c, _Mean()).add(len(speculating) / c)
            else:
                self._plain.setdefault(c, _Mean()).add(seconds)
        self._last = kind

    def plain_seconds(self, running: int) -> float | None:
        """A plain step's time at ``running`` requests: measured at that count, else at the nearest count below
        it down to half of it (fewer requests: a cheaper step, so the cost below errs dear); ``None`` if none."""
        for c in range(running, (running + 1) // 2 - 1, -1):
            m = self._plain.get(c)
            if m is not None and m.n >= self.MIN_SAMPLES:
                return m.mean
        return None

    def has_baseline(self, running: int) -> bool:
        """Whether a plain step's time at ``running`` requests (at most ``max_requests``: the rest wait) is known
        (:meth:`plain_seconds`)."""
        return self.plain_seconds(min(running, self.max_requests or running)) is not None

    def step_cost(self, running: int) -> float | None:
        """A speculating request's step in plain steps of the batch, ``1 + (C/S)(t_spec/t_plain - 1)``; ``None``
        until both means at ``running`` requests are known."""
        plain, spec = self.plain_seconds(running), self._spec.get(running)
        if plain is None or spec is None or spec.n < self.MIN_SAMPLES:
            return None
        return 1.0 + max(spec.mean / plain - 1.0, 0.0) / self._share[running].mean


__all__ = ["StepClock"]
