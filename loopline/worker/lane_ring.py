"""The depth pipeline's per-slot lane state (:class:`LaneRing`) and its step op after sampling
(:func:`accept_lanes`, the torch reference of ``TritonSlotOps.pipe_accept``; docs/speculation.md, scheme 2).

A pipelining request keeps up to ``L`` tokens in flight, one per lane of its slot's ring
(``loopline.worker.pipe_rows`` describes the lanes and the rows they run). After each step's sampler,
:func:`accept_lanes` judges every lane against its predecessor's target, commits the leading run of
exited, accepted lanes, shifts the ring past it and lets empty lanes enter. Written in torch it is ~150
small launches a step, all outside the step's graph; the kernel does it in one.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor


class CommittedState(Protocol):
    """What :func:`accept_lanes` moves past a slot's commits: the decode state's per-slot fields
    (``DeviceDecodeState``, which imports this module)."""

    token: Tensor  # [S] int64, the token fed at loop 1: the last committed one
    pos: Tensor  # [S] int64, its position
    token_index: Tensor  # [S] int64, the completion index of the next token


class LaneRing:
    """The lanes of every slot (module docstring): ``[num_slots, L]`` each, ``hidden`` ``[num_slots, L, H]``."""

    #: how many of a request's stop ids (EOS unless ignore_eos, stop_token_ids) the ring holds: no lane enters
    #: behind a token among them. Only speed depends on it: a lane entered behind a stop token the ring does
    #: not hold computes a token the host discards.
    STOP_WIDTH = 16

    def __init__(self, num_slots: int, lanes: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.lanes, self.device = lanes, device
        i64 = {"dtype": torch.long, "device": device}
        self.lane_ids = torch.arange(lanes, **i64)  # (made once: every step's shift and index read it)
        self.valid = torch.zeros(num_slots, lanes, dtype=torch.bool, device=device)
        self.token = torch.zeros(num_slots, lanes, **i64)  # the lane's input token
        self.loop = torch.zeros(num_slots, lanes, **i64)  # loops run
        self.exit_loop = torch.zeros(num_slots, lanes, **i64)  # 0: still looping
        self.draft = torch.zeros(num_slots, lanes, **i64)  # proposed at loop d for the next lane
        self.hidden = torch.zeros(num_slots, lanes, hidden_size, dtype=dtype, device=device)
        self.survival = torch.ones(num_slots, lanes, dtype=torch.float32, device=device)
        # the lane proposed a draft for a token within max_tokens: a round of one draft, counted when it commits
        self.drafted = torch.zeros(num_slots, lanes, dtype=torch.bool, device=device)
        self.limit = torch.zeros(num_slots, **i64)  # the request's max_tokens: no lane behind lane 0 computes past it
        self.stop = torch.full((num_slots, self.STOP_WIDTH), -1, **i64)  # -1: none

    def clear(self, slot: int, max_tokens: int, stop_ids: tuple[int, ...] | None) -> None:
        """Nothing in flight: the slot's next pipelining step starts lane 0 from its committed token."""
        self.valid[slot] = False
        self.limit[slot] = max_tokens
        ids = list(stop_ids or ())[:self.STOP_WIDTH]
        self.stop[slot] = torch.tensor(ids + [-1] * (self.STOP_WIDTH - len(ids)), dtype=torch.long)

    def state(self, slots: Tensor) -> tuple[Tensor, ...]:
        return (self.valid[slots], self.token[slots], self.loop[slots], self.exit_loop[slots], self.draft[slots],
                self.hidden[slots], self.survival[slots], self.drafted[slots])

    def store(self, slots: Tensor, state: tuple[Tensor, ...]) -> None:
        for dst, src in zip((self.valid, self.token, self.loop, self.exit_loop, self.draft, self.hidden,
                             self.survival, self.drafted), state):
            dst[slots] = src


def shifter(by: Tensor, lane_ids: Tensor) -> Callable[[Tensor, object], Tensor]:
    """``shift(t, fill)``: ``t`` ``[M, L, ...]`` moved ``by`` ``[M]`` lanes towards lane 0, ``fill`` entering at
    the end (``lane_ids``: ``arange(L)``). The source index is computed once for every field the ring moves
    (each op here is a launch outside the step's graph, every pipelining step)."""
    lanes = lane_ids.shape[0]
    src = lane_ids[None, :] + by[:, None]
    inside, idx = src < lanes, src.clamp(max=lanes - 1)
    inside3, idx3 = inside[:, :, None], idx[:, :, None]

    def shift(t: Tensor, fill) -> Tensor:
        if t.dim() == 2:
            return torch.where(inside, t.gather(1, idx), fill)
        return torch.where(inside3, t.gather(1, idx3.expand_as(t)), fill)

    return shift


def accept_lanes(ring: LaneRing, ds: CommittedState, slots: Tensor, target: Tensor, depth: int,
                 agrees: Tensor | None = None, redraft: bool = False, drafts: bool = False) -> tuple[Tensor, Tensor]:
    """The verdicts, commits and entries of pipelining ``slots`` ``[M]``; ``target`` ``[M * L]``: each lane's
    token from its head this step (its target where it exited); ``depth``: the draft loop ``d``; ``agrees``
    ``[M, L]``: the verdicts to use instead of comparing each lane's draft with its token this step (replayed
    acceptance, a measurement hook: ``SlotOps.pipe_accept``); ``redraft``: a lane still looping past loop ``d``
    re-drafts (its token is its draft now, and the lane behind must hold it); ``drafts``: this step's drafts are
    their lanes' tokens (no draft adapter): a lane that ran loop ``d`` and still loops drafts its token (else
    ``pipe_store_draft`` stored the drafts before). Moves the slots' decode state past the committed tokens.
    Returns the committed mask ``[M * L]`` (a leading run of each slot's lanes) and each lane's draft
    verdict ``[M * L]`` int64 (0: it drafted none or did not commit, 1: rejected, 2: accepted)."""
    L = ring.lanes
    lane_ids = ring.lane_ids
    valid, token, loop, exit_loop, draft, hidden, survival, drafted = ring.state(slots)
    y = target.view(-1, L)
    exited = valid & (exit_loop > 0)
    # a lane behind an exited one (or one that re-drafts) must hold its token; from the first that does not,
    # drop every lane
    follows = torch.ones_like(valid)
    redrafts = valid & (exit_loop == 0) & (loop > depth) & redraft
    if agrees is None:
        agrees = y == draft
        follows[:, 1:] = token[:, 1:] == y[:, :-1]
    else:  # (lane j's draft is for completion index token_index + j + 1)
        follows[:, 1:] = agrees[:, :-1]
    judged = valid & torch.cat([torch.zeros_like(exited[:, :1]), (exited | redrafts)[:, :-1]], dim=1)
    behind = (judged & ~follows).long().cumsum(dim=1)
    valid = valid & (behind == 0)
    draft = torch.where(redrafts & valid, y, draft)  # (a lane's head token is its draft now: it feeds the next)
    if drafts:  # a lane at the draft loop drafts its token; a draft within max_tokens is a round of one draft
        due = valid & (exit_loop == 0) & (loop == depth)
        draft = torch.where(due, y, draft)
        room = (ds.token_index[slots][:, None] + lane_ids + 1) < ring.limit[slots][:, None]
        drafted = drafted | (due & room)
    # the leading run of exited lanes that hold their predecessor's target commits
    committed = (valid & exited & follows).long().cumprod(dim=1).bool()
    # NOTE: a draft's verdict counts when its lane commits, not when the lane behind it is judged: a lane
    # that exits before its predecessor judges its successor against a target that may yet be dropped
    verdicts = torch.where(committed & drafted, 1 + agrees.long(), 0).flatten()
    c = committed.long().sum(dim=1)  # [M]
    last = y.gather(1, (c - 1).clamp(min=0)[:, None]).squeeze(1)
    ds.token[slots] = torch.where(c > 0, last, ds.token[slots])
    ds.pos[slots] = ds.pos[slots] + c
    ds.token_index[slots] = ds.token_index[slots] + c
    # the ring moves past the committed run
    shift = shifter(c, lane_ids)
    valid, token, loop, exit_loop, draft, y, drafted = (shift(t, f) for t, f in (
        (valid, False), (token, 0), (loop, 0), (exit_loop, 0), (draft, 0), (y, 0), (drafted, False)))
    hidden, survival = shift(hidden, 0.0), shift(survival, 1.0)
    # an empty lane behind an exited lane (its target) or one that drafted (its draft) enters at loop 1,
    # unless that token ends the request (a stop id) or lies past max_tokens (lane j computes completion
    # index token_index + j)
    prev_exited = valid[:, :-1] & (exit_loop[:, :-1] > 0)
    prev_drafted = valid[:, :-1] & (exit_loop[:, :-1] == 0) & (loop[:, :-1] >= depth)
    fed = torch.where(prev_exited, y[:, :-1], draft[:, :-1])
    stops = (fed[:, :, None] == ring.stop[slots][:, None, :]).any(dim=2)
    room = (ds.token_index[slots][:, None] + lane_ids[1:]) < ring.limit[slots][:, None]
    enter = ~valid[:, 1:] & (prev_exited | prev_drafted) & room & ~stops
    token[:, 1:] = torch.where(enter, fed, token[:, 1:])
    loop[:, 1:] = torch.where(enter, 0, loop[:, 1:])
    exit_loop[:, 1:] = torch.where(enter, 0, exit_loop[:, 1:])
    drafted[:, 1:] = drafted[:, 1:] & ~enter
    valid[:, 1:] = valid[:, 1:] | enter
    ring.store(slots, (valid, token, loop, exit_loop, draft, hidden, survival, drafted))
    return committed.flatten(), verdicts
