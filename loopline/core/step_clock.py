"""Whether speculation pays in this engine, measured (docs/speculation.md, "When it pays"). Host-side only.

The adaptive stop prices a speculating step with a cost model fitted on Ouro-1.4B shapes, where a step's
time is its bytes'. On another model or host that can be far off: on the bundled demo model a step's time
is the host's, a pipelining step cost ~3 plain steps where the model says 1.75, and the adaptive pipeline
ran at 0.58-0.75x plain decoding (an H100). What a request's own payoff cannot see either: a speculating
request's extra step time is paid by every request in its step.

So the engine measures what it is there for, throughput. :class:`StepClock` keeps, by requests a step, the
output tokens a decode step committed and its wall time, for plain steps and for steps with speculating rows
apart. Where the latter commit fewer tokens a second than plain steps of as many requests (below ``MARGIN``
of them), speculation costs throughput there, and the engine turns it off (:meth:`StepClock.pays`); the
verdict is forgotten after ``FORGET_STEPS`` plain steps at that count, so the next requests try again.

Steps where only some requests speculate count too. Their rate can be below that of steps where all do (a
speculating step's fixed costs, the host's work for its rows and its launches, are shared by its speculating
requests: the pipeline at four requests on a CPU ran about even with one pipelining, 1.25x plain decoding
with all four), which ``MARGIN`` leaves room for; but a batch where the cost model keeps a few requests
speculating is what lost most (the demo model at eight requests on an H100: 0.52-0.66x plain decoding, its
steps with lanes three times a plain one's), and only these steps show it.

A step's wall time is what the engine's ``step()`` took: scheduling and launching it, and reading the step
before (the overlapped engine waits for that one there, and books its tokens). So a step counts only when the
step before it was of the same kind (as many requests, speculating or not) and neither held a prompt's chunk.
"""
from __future__ import annotations

from collections.abc import Sequence

from loopline.core.contracts import ScheduledRow


class _Rate:
    """Tokens over seconds, both running means: every step weighed alike at first, then each new one at
    ``WEIGHT``; a step far slower than the mean (a collection pause, a compile) counts as ``CLIP`` times it."""

    WEIGHT, CLIP = 0.05, 4.0

    def __init__(self) -> None:
        self.n, self.tokens, self.seconds = 0, 0.0, 0.0

    def add(self, tokens: float, seconds: float) -> None:
        if self.n:
            seconds = min(seconds, self.seconds * self.CLIP)
        self.n += 1
        w = max(1.0 / self.n, self.WEIGHT)
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class StepClock:
    """Output tokens a second of decode steps by requests a step, plain steps and steps with speculating rows
    apart. See the module docstring."""

    #: steps a rate needs before it is used: a pipelining request commits 0..L tokens a step, a plain one a token
    #: every few steps, so their rates need a few dozen steps
    MIN_STEPS = 32
    #: plain steps at a count after which what speculating steps measured there is forgotten
    FORGET_STEPS = 4096
    #: speculation pays unless its steps commit below this share of plain steps' rate: steps with only some
    #: requests speculating, and a pipelining request's first steps (its first token exits after R loops), count
    MARGIN = 0.9
    #: a speculating request stops below this share (its stop is for good: a noisy moment must not end it)
    STOP_MARGIN = 0.8

    def __init__(self, max_requests: int | None = None) -> None:
        self.max_requests = max_requests  # the most requests a step holds (max_num_seqs; None: no bound)
        self._plain: dict[int, _Rate] = {}
        self._spec: dict[int, _Rate] = {}
        self._plain_since: dict[int, int] = {}  # plain steps at a count since its last speculating one
        self._last: tuple[int, bool] | None = None
        self._recent = 0  # requests in the last decode step

    def record(self, rows: Sequence[ScheduledRow], seconds: float, tokens: int) -> None:
        """One engine step: its rows, the wall time it took and the output tokens it booked."""
        if not rows or any(r.is_prefill for r in rows):
            self._last = None
            return
        c = len({r.request_id for r in rows})
        self._recent = c
        kind = (c, any(r.spec is not None for r in rows))
        if kind == self._last:
            (self._spec if kind[1] else self._plain).setdefault(c, _Rate()).add(tokens, seconds)
            self._plain_since[c] = 0 if kind[1] else self._plain_since.get(c, 0) + 1
            if self._plain_since[c] > self.FORGET_STEPS:
                self._spec.pop(c, None)
        self._last = kind

    def _known(self, rates: dict[int, _Rate], c: int) -> _Rate | None:
        r = rates.get(c)
        return r if r is not None and r.n >= self.MIN_STEPS else None

    def plain_rate(self, running: int) -> float | None:
        """Plain steps' tokens a second at ``running`` requests, else at the nearest count below it down to half of
        it (fewer requests commit fewer tokens a step, so the comparison errs towards plain decoding); ``None``
        if none is known."""
        for c in range(running, (running + 1) // 2 - 1, -1):
            r = self._known(self._plain, c)
            if r is not None:
                return r.per_second
        return None

    def spec_rate(self, running: int) -> float | None:
        """Steps with speculating rows: tokens a second at ``running`` requests (``None``: not yet known)."""
        r = self._known(self._spec, running)
        return None if r is None else r.per_second

    def joining(self, running: int) -> int:
        """The requests a step will hold with a request added while ``running`` others run or wait: at least as many
        as the last decode step held (requests added at once see fewer before them than they will run with), at
        most ``max_requests`` (the rest wait)."""
        return min(max(running + 1, self._recent), self.max_requests or running + 1)

    def has_baseline(self, running: int) -> bool:
        """Whether plain steps' rate is known at ``running`` requests, down to half of it, or at any count above
        (requests added at once see fewer before them than they will run with)."""
        return any(c >= (running + 1) // 2 and self._known(self._plain, c) for c in self._plain)

    def pays(self, running: int, margin: float = MARGIN) -> bool | None:
        """Whether steps with speculating rows commit at least ``margin`` times as many tokens a second as plain
        steps at ``running`` requests (``None``: not both known)."""
        plain, spec = self.plain_rate(running), self.spec_rate(running)
        return None if plain is None or spec is None else spec >= margin * plain

    def why_not(self, running: int, margin: float = STOP_MARGIN) -> str | None:
        """Why a speculating request stops at ``running`` requests (``None``: speculation pays there within
        ``margin``, or that is not known)."""
        if self.pays(running, margin) is not False:
            return None
        return (f"steps with speculating rows commit {self.spec_rate(running):.0f} tokens/s at {running} requests "
                f"a step, plain steps {self.plain_rate(running):.0f}")


__all__ = ["StepClock"]
