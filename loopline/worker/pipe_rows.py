"""Depth-pipelined speculation on the device (docs/speculation.md, scheme 2).

A pipelining request keeps up to ``L = ceil(R / d)`` tokens in flight at once, one per *lane* of its
slot's lane ring: lane ``j`` holds the token at position ``pos + j`` (``pos``: the slot's decode state,
the position of its last committed token), its input token, the loops it has run, its hidden state and
gate survival, its exit loop (0: still looping) and the draft it proposed at loop ``d``. The host
schedules all ``L`` lanes every step (it cannot know which hold a token: a rejection changes that); each
is a one-query row reading its own loop's plane. An empty lane, or one whose token exited and waits for
its predecessors, runs on the scratch slot and changes nothing.

* :class:`~loopline.worker.lane_ring.LaneRing`: the lanes of every slot.
* :class:`PipeKind`: the row kind. ``prepare`` starts lane 0 from the slot's committed token when it is
  empty and derives every lane's position, KV slot, table and input; ``finish`` applies each lane's own
  exit rule (plain decoding's), stores its state and makes the ``last_exited`` exit copy.
* :class:`PipeRounds`: after the forward, vectorized over ``[slots, L]``: every lane's target token is
  sampled from its hidden state (one sampler call with the step's decode rows; exited lanes' are their
  tokens); a lane that reached loop ``d`` without exiting drafts its successor's token, which is its target
  token unless a draft adapter maps its state first (:class:`~loopline.worker.draft_head.DraftHead`); then
  the verdicts oldest first: a lane whose predecessor exited must hold the
  predecessor's target token, else it and every lane behind it are dropped; the leading run of exited,
  accepted lanes commits (read back on lane 0's row), the ring shifts past it and the slot's decode state
  moves with it; an empty lane behind a lane that exited (its target) or drafted (its draft) enters.

Every lane computes exactly what plain decoding computes for its position: lanes of one request run at
least ``d`` loops apart, so the K/V a lane reads at loop ``r`` (its predecessors' loop-``r`` K/V, or their
exit loop's copied there at the exit) was written in an earlier step, and a dropped lane's K/V is rewritten
before any query reads it. Drafts and targets are sampled with the counter-based noise of the token index
they stand for, as scheme 1 does (``spec_rows``), so committed tokens are plain seeded sampling's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.attention import AttentionBackend
from loopline.core.contracts import PipeLane, ScheduledRow
from loopline.models.ouro import OuroForCausalLM
from loopline.spec.replay import AcceptanceReplay
from loopline.worker.decode_state import DeviceDecodeState, PipeRows, RowsInto
from loopline.worker.draft_head import DraftHead
from loopline.worker.lane_ring import LaneRing
from loopline.worker.request_state import RequestState
from loopline.worker.row_kinds import RowKind, exit_columns
from loopline.worker.sampler import Sampler, SamplingTensors
from loopline.worker.spec_rows import DraftSampler, VerifyPart, round_history
from loopline.worker.staging import stage
from loopline.worker.step_inputs import HostImage, KindRows, Segment, StepInputs

_FIELDS = ("slots", "lane", "min_loops", "max_loops", "threshold")


class PipePrepared(NamedTuple):
    """A step's lanes as ``prepare`` derived them (``[n]`` each)."""

    slots: Tensor
    lane: Tensor
    rows: PipeRows  # each lane's loop, whether it still loops, its KV slot in every plane
    min_loops: Tensor
    max_loops: Tensor
    threshold: Tensor


class PipeKind(RowKind):
    """Rows of pipelining requests: one query per lane (module docstring)."""

    query_len = 1
    derives = True

    def __init__(self, *, model: OuroForCausalLM, backend: AttentionBackend, kv: Callable[[], tuple[Tensor, Tensor]],
                 state: DeviceDecodeState, ring: LaneRing, requests: dict[str, RequestState], scratch_slot: int,
                 max_loops: int) -> None:
        self.model, self.backend, self.kv, self.state, self.ring = model, backend, kv, state, ring
        self.requests, self.scratch_slot, self.max_loops = requests, scratch_slot, max_loops

    def takes(self, row: ScheduledRow) -> bool:
        return isinstance(row.spec, PipeLane)

    def host_fields(self, rows: int) -> dict:
        i64 = np.int64
        return {"slots": (i64, (rows,), self.scratch_slot), "lane": (i64, (rows,), 0), "min_loops": (i64, (rows,), 1),
                "max_loops": (i64, (rows,), 1), "threshold": (np.float32, (rows,), 1.0)}

    def plan(self, rows: list[ScheduledRow]) -> KindRows:
        n = len(rows)
        if not n:
            return KindRows(rows, 0, 0, None, 0, 0)
        host = (np.fromiter((r.slot for r in rows), np.int64, n), np.fromiter((r.spec.lane for r in rows), np.int64, n),
                *exit_columns(rows))
        bound = max(self.requests[r.request_id].max_len for r in rows)
        return KindRows(rows, n, n, None, 1, bound, host)

    def fill(self, part: KindRows, image: HostImage) -> None:
        n = part.num_rows
        for name, values in zip(_FIELDS, part.host):
            image.own(name)[:n] = values

    def prepare(self, inp: StepInputs, seg: Segment, own: dict[str, Tensor]) -> PipePrepared | None:
        if not seg.rows:
            return None
        r, t, n = seg.row0, seg.tok0, seg.rows
        slots, lane = own["slots"], own["lane"]
        into = RowsInto(inp.positions[t:t + n], inp.slot_mapping[t:t + n], inp.seq_lens[r:r + n],
                        inp.block_tables[r:r + n])
        rows = self.state.ops.pipe_rows(self.ring, self.state, slots, lane, self.max_loops, self.scratch_slot,
                                        self.model.model.embed_tokens.weight, into, inp.x[t:t + n])
        return PipePrepared(slots, lane, rows, own["min_loops"], own["max_loops"], own["threshold"])

    def finish(self, h: Tensor, gate: Tensor, p: PipePrepared | None, own: dict[str, Tensor]) -> tuple:
        """Each live lane's own exit rule after this loop, its state, and the exit copy."""
        if p is None:
            return ()
        exited = self.state.ops.pipe_finish(self.ring, h, gate, p.slots, p.lane, p.rows, p.min_loops, p.max_loops,
                                            p.threshold)
        k_cache, v_cache = self.kv()  # (the pipeline runs on last_exited only: EngineArgs.speculative)
        self.backend.copy_exited(k_cache, v_cache, p.rows.plane_slots, p.rows.loop, exited,
                                 self.state.scratch_block * self.state.block_size)
        return ()


class PipeRounds:
    """What pipelining rows do after the forward: drafts, every lane's target, the verdicts, commits and
    entries (module docstring). The runner's interface is scheme 1's (``SpecRounds``): ``draft``,
    ``verify_part``, ``accept``."""

    def __init__(self, model: OuroForCausalLM, state: DeviceDecodeState, ring: LaneRing,
                 requests: dict[str, RequestState], sampler: Sampler, device: torch.device, head: DraftHead,
                 redraft: bool = False) -> None:
        self.model, self.state, self.ring, self.requests, self.device = model, state, ring, requests, device
        self.head, self.redraft = head, redraft  # (redraft: SpeculativeConfig.redraft)
        self.drafts = DraftSampler(sampler, device)
        self.replay: AcceptanceReplay | None = None  # a measurement hook (loopline/spec/replay.py); None: real verdicts
        self._lanes: tuple[Tensor, Tensor] | None = None  # draft()'s slots and every lane's head output, for verify_part()

    def _lane0(self, rows: list[ScheduledRow], row0: int = 0) -> list[tuple[int, ScheduledRow]]:
        return [(row0 + i, r) for i, r in enumerate(rows) if r.spec.lane == 0]

    def _slots(self, rows: list[ScheduledRow]) -> Tensor:
        return stage(self.device, ([r.slot for r in rows], np.int64))[0]

    def _index(self, slots: Tensor) -> Tensor:
        """``[M * L]``: the completion index of each lane's token (its target and its draft stand for it)."""
        return (self.state.token_index[slots][:, None] + self.ring.lane_ids).flatten()

    def _lanes_head(self, slots: Tensor) -> Tensor:
        """``[M * L, V]`` fp32: the model's head on every lane's hidden state (the lanes' target logits)."""
        return self.model.head(self.ring.hidden[slots].flatten(0, 1)).float()

    def draft(self, rows: list[ScheduledRow]) -> None:
        """Lanes that ran loop ``d`` and still loop propose their successor's token from their loop-``d``
        head, sampled as the target samples the same token index.

        Without a draft adapter a drafting lane's head output is its target row's (the same hidden state
        through the same head), so the step runs the head once, over every lane, and ``verify_part`` takes
        the result: one read of the output projection a step instead of two. Its draft is then exactly its
        target token (the same logits, history, parameters and counter-based noise of the same token index),
        which ``accept`` makes its draft: no sampling, no lane choice or store of its own."""
        self._lanes = None
        heads = [r for _, r in self._lane0(rows)]
        if not heads:
            return
        ring, ops = self.ring, self.state.ops
        slots = self._slots(heads)
        if self.head.adapter is None:
            self._lanes = slots, self._lanes_head(slots)
            return
        # (lane 0, whose draft is unused, where no lane drafts)
        lane, any_due, index = ops.pipe_draft_lanes(ring, self.state, slots, self.head.depth)
        logits = self.head(ring.hidden[slots, lane], any_due)
        # lane j's history: the committed tokens, then lanes 1..j's input tokens
        drafted = self.drafts(logits, [self.requests[r.request_id] for r in heads], index,
                              lambda t: round_history(self.state, ring.token[slots, 1:], t, slots, lane))
        ops.pipe_store_draft(ring, slots, lane, any_due, index, drafted)

    def verify_part(self, rows: list[ScheduledRow], row0: int) -> VerifyPart | None:
        """Every lane of the pipelining requests among ``rows`` (step rows from ``row0``) as a target row, its
        step row lane 0's (whose row carries the commits)."""
        heads = self._lane0(rows, row0)
        if not heads:
            return None
        ring, L = self.ring, self.ring.lanes
        if self._lanes is not None:  # draft's, for the same rows, when it ran the head over every lane
            (slots, logits), self._lanes = self._lanes, None
        else:
            slots = self._slots([r for _, r in heads])
            logits = self._lanes_head(slots)
        states = [self.requests[r.request_id] for _, r in heads for _ in range(L)]
        return VerifyPart([i for i, _ in heads for _ in range(L)], states, slots, logits, self._index(slots),
                          ring.exit_loop[slots].flatten())

    def target_history(self, tensors: SamplingTensors, part: VerifyPart) -> None:
        """``part``'s lanes are the sampling rows after those whose history ``tensors`` holds: lane ``j``'s generated history (what
        penalties and multi-token bad words read) is the committed tokens plus lanes ``1..j``'s input tokens
        (:func:`~loopline.worker.spec_rows.round_history`). The lanes ahead of a lane that commits all
        committed, each holding its predecessor's target, so a committed token read plain decoding's history."""
        L = self.ring.lanes
        slots = part.slots.repeat_interleave(L)
        round_history(self.state, self.ring.token[slots, 1:], tensors, slots, self.ring.lane_ids.repeat(len(part.slots)))

    def accept(self, part: VerifyPart, target: Tensor) -> Tensor:
        """The verdicts, commits and entries of the pipelining slots; ``target`` ``[M * L]``: each lane's
        token from its head this step (the sampler's, greedy: the argmax): exited lanes' targets, and with
        ``redraft`` the new drafts of lanes looping past the draft loop. Returns the committed
        mask ``[M * L]`` (a leading run of each slot's lanes); ``part.verdicts``: each committed lane's draft
        verdict (0: it drafted none, 1: rejected, 2: accepted). One op of the decode state's slot ops
        (:func:`~loopline.worker.lane_ring.accept_lanes`, or its kernel)."""
        # (self.replay: cost measurements on random weights, drawn inside the op: lane j's draft is for ti + j + 1;
        # without an adapter the lanes at the draft loop draft their targets inside the op)
        committed, part.verdicts = self.state.ops.pipe_accept(self.ring, self.state, part.slots, target,
                                                              self.head.depth, self.replay, redraft=self.redraft,
                                                              drafts=self.head.adapter is None)
        L = self.ring.lanes
        self.state.take_run(part.slots, target.view(-1, L), committed.view(-1, L))  # (penalties, bad words)
        return committed
