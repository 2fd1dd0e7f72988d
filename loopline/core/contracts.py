"""The typed contract of one engine step (docs/design.md, 'Architecture').

``Scheduler.schedule() -> SchedulerOutput -> ModelRunner.launch() -> handle.get()
-> RunnerOutput -> Scheduler.update(...)``. Host-side plain data only.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExitParams:
    """A row's exit rule: exit after loop r when r == max_loops, or when
    threshold < 1 and r >= min_loops and F_r >= threshold.

    ``lookahead`` (the ``exit_mode="lookahead"`` policy; its rows have threshold 1.0): the head's
    probability threshold. After loop n (0: the embedding) with ``min_loops <= n + 2 < max_loops`` and
    no exit fixed yet, a prediction at or above it fixes the token's exit at loop ``n + 2``
    (docs/lookahead.md). None: the row does not use the head."""

    min_loops: int
    max_loops: int
    threshold: float
    lookahead: float | None = None


@dataclass
class NewRequestData:
    """What the runner must know about a request admitted this step."""

    request_id: str
    prompt_token_ids: list[int]
    block_tables: list[list[int]]  # [plane] -> physical blocks
    seed: int
    params: object  # SamplingParams (effective)
    prompt_exit: ExitParams  # exit rule of prompt positions (first token, prompt logprobs)
    num_cached_tokens: int = 0  # leading prompt positions whose KV came from the prefix cache
    slot: int = -1  # decode slot (per-slot state lives on the device)


@dataclass(frozen=True)
class SpecStep:
    """Where a speculating request's row sits in its draft-then-verify round (docs/speculation.md).

    A draft step runs round position ``index`` (0..K) at ``loop`` (1..d) as one query; a verify step
    (``index == -1``) runs all ``queries = K + 1`` positions at ``loop`` (d+1..max_loops). ``K`` is the round's
    own (``Request.spec_k``: at most ``num_speculative_tokens``). ``draft_end``:
    the step ends a position's draft loops, whose head proposes the next position's token; ``last``: the
    round's final verify step, which accepts and commits. The device knows the round's start position."""

    index: int
    loop: int
    queries: int
    draft_end: bool = False
    last: bool = False


@dataclass(frozen=True)
class PipeLane:
    """A pipelining request's row (docs/speculation.md, scheme 2): lane ``lane`` of its slot's lane ring,
    one query. The device knows which token, position and loop each lane holds (a rejection changes
    them), so every step schedules all of a request's lanes; an empty lane runs on scratch. Lane 0's row
    carries the tokens the step committed."""

    lane: int
    queries: int = 1
    last: bool = False  # (a draft-then-verify round's end: never, here)


@dataclass
class ScheduledRow:
    """One unit of work at one loop: a prefill chunk or a decode token.

    A decode row names only its slot and exit rule: the device decode state knows the slot's
    loop, position and token (its ``start``/``end``/``loop``/``plane`` are placeholders)."""

    request_id: str
    is_prefill: bool
    start: int  # prefill: positions [start, end)
    end: int
    loop: int  # prefill: 1-based loop this row runs
    plane: int
    input_token_ids: list[int] | None  # prefill: set when loop == 1 (prelude)
    slot: int = -1  # decode slot
    is_last_chunk: bool = False  # prefill: holds the last prompt position
    exit: ExitParams | None = None  # decode rows
    seq: int = -1  # the request's arrival number: a row's results never reach a later request of the same id
    spec: SpecStep | PipeLane | None = None  # a speculating request's row (decode rows of the others: None)

    @property
    def num_tokens(self) -> int:
        if self.spec is not None:
            return self.spec.queries
        return self.end - self.start if self.is_prefill else 1


@dataclass
class ResumedRequestData:
    """A preempted request back on the device: restore its snapshot into these blocks and slot."""

    request_id: str
    block_tables: list[list[int]]
    slot: int
    num_cached_pages: int = 0  # leading pages (per plane) the prefix cache already holds: not restored


@dataclass
class SchedulerOutput:
    """One step's work. The runner applies, in order: finished, preempted
    (snapshot to CPU, before any block is reused), resumed, new requests,
    block-table growth, then runs ``rows``."""

    rows: list[ScheduledRow]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    resumed_requests: list[ResumedRequestData] = field(default_factory=list)
    block_updates: dict[str, list[list[int]]] = field(default_factory=dict)  # request -> blocks appended per plane

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows

    def without(self, request_ids: set[str]) -> "SchedulerOutput":
        """This step with those requests' rows and admissions left out (they were failed); the
        scheduler already freed their KV, so nothing else about them remains to apply."""
        return SchedulerOutput(
            rows=[r for r in self.rows if r.request_id not in request_ids],
            new_requests=[n for n in self.new_requests if n.request_id not in request_ids],
            finished_request_ids=self.finished_request_ids,
            preempted_request_ids=[r for r in self.preempted_request_ids if r not in request_ids],
            resumed_requests=[r for r in self.resumed_requests if r.request_id not in request_ids],
            block_updates={k: v for k, v in self.block_updates.items() if k not in request_ids})


@dataclass
class SampledToken:
    token_id: int
    exit_depth: int
    logprob: float | None = None  # of the sampled token (logprobs_mode)
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # top-k (id, logprob)


@dataclass
class RunnerOutput:
    """Per row (same order as ``SchedulerOutput.rows``): did its token exit, what was sampled."""

    exited: list[bool]  # decode: token exited this step; prefill: prompt finished
    sampled: list[SampledToken | None]
    # request_id -> [(position p, {token: logprob} top-k incl. the actual next prompt token, rank)] for prompt logprobs
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[tuple[int, float]]]]] = field(default_factory=dict)
    # request_id -> why its row's result could not be read (its ``sampled`` is None): that request
    # fails alone, the step's other rows are booked as usual
    failed: dict[str, Exception] = field(default_factory=dict)
    # step row -> the tokens a speculative round committed after ``sampled[row]`` (its first), in order
    more: dict[int, list[SampledToken]] = field(default_factory=dict)
    # step row -> (drafts judged, accepted) in this step: a pipelining request's lanes (on lane 0's row)
    spec_verdicts: dict[int, tuple[int, int]] = field(default_factory=dict)
