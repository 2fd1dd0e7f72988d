"""What crosses between an engine loop and its clients: every command and message, PD's included.

Commands go down (client -> core: :class:`AddCmd`, :class:`AbortCmd`, :class:`CallCmd`,
:class:`ShutdownCmd`, and a prefill/decode worker's :class:`PrefillCmd`, :class:`PieceCmd`,
:class:`AcceptCmd`, :class:`DropCmd`); one :class:`EngineMessage` per loop iteration goes up
(outputs as :class:`OutputDelta`, replies, step records, the :class:`EngineSnapshot`, a prefill
worker's :class:`PieceMsg` / :class:`HandoffMsg`). Everything here pickles: the same messages
cross a thread, a pipe to an engine process or a Ray actor call.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field, fields
from typing import Any

from loopline.engine import LLMEngine, PromptType
from loopline.engine.deltas import OutputDelta
from loopline.engine.handoff import Handoff
from loopline.sampling_params import SamplingParams


# --- what the client reads -------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges published after every iteration of the engine loop (safe to read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens served from it
    num_preemptions: int = 0
    num_unfinished: int = 0  # requests (choices) in the scheduler or held by a pause
    num_generating: int = 0  # requests (choices) in the scheduler that produced a token
    is_paused: bool = False
    weights_state: str = "committed"  # "committed" | "updating" | "partially_updated"
    # loop self-speculation, vLLM's spec_decode counters (EngineStats): rounds, drafts proposed and
    # accepted, and accepted drafts by their position in the round
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def total(cls, snaps: list["EngineSnapshot"]) -> "EngineSnapshot":
        """Several engines' gauges as one (data-parallel replicas, prefill/decode workers): counts
        added up, paused only if every engine is, the weights in the worst state any engine is in."""
        if not snaps:
            return cls()
        counts = {f.name: sum(getattr(s, f.name) for s in snaps) for f in fields(cls) if f.type in ("int", int)}
        width = max(len(s.spec_accepted_per_pos) for s in snaps)
        per_pos = tuple(sum(s.spec_accepted_per_pos[i] for s in snaps if i < len(s.spec_accepted_per_pos))
                        for i in range(width))
        return cls(**counts, is_paused=all(s.is_paused for s in snaps),
                   weights_state=max((s.weights_state for s in snaps), key=_WEIGHTS_STATES.index),
                   spec_accepted_per_pos=per_pos)


_WEIGHTS_STATES = ("committed", "updating", "partially_updated")  # from the best to the worst


@dataclass(frozen=True)
class StepRecord:
    """One engine step as seen by step listeners (rows run, tokens scheduled, wall time)."""

    rows: int
    scheduled_tokens: int
    duration_s: float
    replica: int = 0  # the data-parallel replica that ran it (set by the front end)
    # vLLM's iteration tokens: tokens sampled in the step plus the prompt tokens whose prefill it finished
    iteration_tokens: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """Facts about a built engine that the front end needs (model, lengths, KV pool size)."""

    config: Any  # EngineConfig
    model_config: Any  # OuroConfig
    kv_pages: int
    kv_planes: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the model's request defaults (generation_config)

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        return cls(engine.config, engine.model_config, engine.kv.pool.num_blocks, engine.kv.layout.num_planes,
                   dict(engine.sampling_defaults))


# --- commands (client -> core) -----------------------------------------------------------------
@dataclass
class AddCmd:
    """Requests to add as one command: all are accepted or none (the first error is the reply)."""

    add_id: int
    requests: list[tuple[str, PromptType, SamplingParams]]
    chat_stop: bool


@dataclass
class AbortCmd:
    request_ids: list[str]


@dataclass
class CallCmd:
    """A control verb (``engine/verbs.py``) between steps: ``engine.control_call(name, *args)``, or
    the core's own ``call_<name>`` for a verb the loop serves; ``args`` are positional, defaults
    filled in (``Verb.bind``). ``until_drained``: reply once no request is in flight (pause "wait")."""

    call_id: int
    name: str
    args: tuple = ()
    until_drained: bool = False


@dataclass
class ShutdownCmd:
    """Abort every request, emit their final outputs and stop the loop."""


Command = AddCmd | AbortCmd | CallCmd | ShutdownCmd


# --- messages (core -> client) -----------------------------------------------------------------
@dataclass
class Reply:
    """The outcome of an add (``id``: its add_id) or a call (its call_id)."""

    id: int
    result: Any = None
    error: BaseException | None = None


@dataclass
class EngineMessage:
    """Everything one iteration of the engine loop produced. ``dead``: the loop stopped (the last message)."""

    outputs: list[OutputDelta] = field(default_factory=list)
    failures: list[tuple[str, BaseException]] = field(default_factory=list)  # requests that failed alone
    replies: list[Reply] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)  # the steps run since the last message
    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    dead: BaseException | None = None
    handoffs: list[Any] = field(default_factory=list)  # a prefill worker's PieceMsg / HandoffMsg


# --- prefill/decode workers ------------------------------------------------------------------
@dataclass
class PrefillCmd(AddCmd):
    """An add for a prefill worker: every request names its decode worker and transfer tag."""

    targets: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (decode rank, tag)


@dataclass
class PageReservation:
    """What a decode worker needs to reserve a request's prompt pages (and to look its prefix up in
    its prefix cache): sent with the request's first piece."""

    child_id: str  # the scheduler's id, under which the pages are held
    prompt_token_ids: list[int]
    cache_salt: str | None = None  # the request's own prefix-cache salt


@dataclass
class PieceMsg:
    """Prompt pages ``[first_page, first_page + n)`` of every plane a prefill worker started sending
    (in ``EngineMessage.handoffs``): final KV, sent while the next chunks compute. The first piece of
    a request (``first_page == 0``) carries its ``reservation``."""

    request_id: str
    tag: int
    payload: Any
    shape: tuple[int, ...]
    dtype: Any
    first_page: int
    reservation: PageReservation | None = None


@dataclass
class HandoffMsg:
    """A prefill worker's request leaving it after ``num_pieces`` pieces (in ``EngineMessage.handoffs``)."""

    handoff: Handoff
    num_pieces: int


@dataclass
class PieceCmd:
    """A decode worker receives a piece of a request's pages (from ``src_rank``, with ``tag``)."""

    piece: PieceMsg
    src_rank: int


@dataclass
class AcceptCmd:
    """A decode worker takes over a handed-off request once its ``num_pieces`` pieces arrived
    (``aborted``: the client aborted it meanwhile: it ends as aborted)."""

    handoff: Handoff
    num_pieces: int
    src_rank: int
    aborted: bool = False


@dataclass
class DropCmd:
    """The request whose pieces a decode worker received will not come (it ended on its prefill worker)."""

    request_id: str


@dataclass
class PieceDoneCmd:
    """Inside a decode worker: a piece's receive finished (the transport's thread wakes the loop)."""

    request_id: str
    future: concurrent.futures.Future
    first_page: int
