"""Per-slot decode state that advances on the device.

The host may launch step n+1 before it reads step n's results (the overlapped
engine), so it never tells a decode slot which loop to run or which token to
feed. The device does: after each step a slot whose token exited starts its
next token at loop 1 at the next position, fed with the token it just sampled
(``refill``), or idles until no slot is in flight (``no_refill``); a slot
whose token did not exit runs its next loop. The exit rule itself runs on the
device, so the host never needs to read a decision before the next step, and
no exit is ever delayed or approximated.

Presence, frequency and repetition penalties need each slot's generated
tokens, which the host may read one step late; so the device keeps them too, as
per-slot token counts and a seen mask (prompt or output), allocated when the
first request with penalties arrives. Likewise ``exit_mode="trace"`` depths
are kept per slot and read at the device's token index. A preempted request's
slot state is saved and loaded with it (``save`` / ``load``).

:class:`SlotOps` computes a step's decode rows from this state, the loop's
input (the prelude or the slot's hidden state), the exit rule with the slots'
hidden state and survival, and the advance, in torch (the reference), and the depth
pipeline's lane rows (``pipe_rows``, ``pipe_finish``: the same for the lanes of its ring),
drafting lanes and step after sampling (``pipe_accept``). At one decode row each
torch op is a launch of its own, ~40 per step (~50 for the lane rows, ~150 for ``pipe_accept``);
``loopline.worker.triton_slot_ops.TritonSlotOps`` does each op in one kernel.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.spec.replay import AcceptanceReplay
from loopline.worker.exit_rule import exit_decision
from loopline.kv.layout import KVLayout
from loopline.worker.lane_ring import LaneRing, accept_lanes
from loopline.worker.staging import stage


@dataclass
class DecodeTensors:
    """Decode rows on the device, as the layer loop, the exit rule and the exit copy read them."""

    slots: Tensor
    loops: Tensor
    starts: Tensor
    input_ids: Tensor
    min_loops: Tensor
    max_loops: Tensor
    threshold: Tensor
    plane_slots: Tensor


class SlotRows(NamedTuple):
    """What sampling and the state's advance need of a step's decode rows."""

    slots: Tensor  # [B] int64, the rows' slots (not masked: see DecodeTensors.slots)
    loops: Tensor  # [B] int64, the loop each row runs (1-based)
    run: Tensor  # [B] bool; False: a no_refill slot waiting for its cohort, run on scratch
    token_index: Tensor  # [B] int64, index in the completion of the token being computed


class RowsInto(NamedTuple):
    """Where ``decode_rows`` writes the rows' attention inputs (views of the step's persistent buffers)
    instead of fresh tensors. ``block_tables`` may be narrower than the state's tables: a step reads no
    key past its ``max_seq_len``, so columns past it are never read."""

    positions: Tensor  # [B] int64
    slot_mapping: Tensor  # [B] int64
    seq_lens: Tensor  # [B] int32
    block_tables: Tensor  # [B, width] int32, rows contiguous


class DecodeRows(NamedTuple):
    """A step's decode rows derived from the device state."""

    slots: Tensor  # [B] int64, as the host named them
    dec: DecodeTensors
    positions: Tensor  # [B] int64
    slot_mapping: Tensor  # [B] int64, the K/V slot this loop writes
    seq_lens: Tensor  # [B] int32
    block_tables: Tensor  # [B, max_blocks] int32, of the plane this loop reads
    loops: Tensor  # [B] int64, the loop each row runs (1-based)
    run: Tensor  # [B] bool; False: a no_refill slot waiting for its cohort, run on scratch
    token_index: Tensor  # [B] int64, index in the completion of the token being computed


class PipeRows(NamedTuple):
    """A pipelining step's lanes as ``pipe_rows`` derived them (``[n]`` each, ``plane_slots`` ``[n, P]``)."""

    loop: Tensor  # int64, the loop each lane runs (1-based)
    live: Tensor  # bool, the lane holds a token that is still looping
    plane_slots: Tensor  # int64, the KV slot of the lane's position in every plane (scratch where not live)


class SlotOps:
    """The per-slot decode state's step ops in torch: the reference for ``TritonSlotOps``."""

    name = "torch"

    def decode_rows(self, ds: "DeviceDecodeState", slots: Tensor, min_loops: Tensor, max_loops: Tensor,
                    threshold: Tensor, no_refill: bool, per_token_exits: bool, scratch_slot: int,
                    into: RowsInto | None = None) -> DecodeRows:
        """Decode rows ``slots`` ``[B]`` from the state; a row with ``run`` False (a ``no_refill`` slot
        waiting for its cohort) runs on scratch and changes nothing. ``per_token_exits``: the rows'
        min and max loops come from the recorded depths at the device's token index. ``into``: the
        attention inputs are written there (and returned as those views)."""
        loop = ds.loop[slots]
        run = torch.ones_like(loop, dtype=torch.bool)
        if no_refill:
            in_flight = (loop > 0).any()
            run = (loop > 0) | ~in_flight
        loops = loop + 1
        pos = ds.pos[slots]
        tidx = ds.token_index[slots]
        if per_token_exits:  # the host's token index lags; the device's is exact
            min_loops = max_loops = ds.trace_depths(slots, tidx)
        plane_slots = ds.plane_slots(slots, pos)
        scratch_kv = ds.scratch_block * ds.block_size
        dec = DecodeTensors(
            slots=torch.where(run, slots, scratch_slot), loops=loops, starts=loops == 1,
            input_ids=ds.token[slots], min_loops=min_loops, max_loops=max_loops, threshold=threshold,
            plane_slots=torch.where(run[:, None], plane_slots, scratch_kv))
        plane = ds.layout.plane_index(loops)
        attn = RowsInto(
            positions=torch.where(run, pos, 0), slot_mapping=dec.plane_slots.gather(1, plane[:, None]).squeeze(1),
            seq_lens=torch.where(run, pos + 1, 1).to(torch.int32),
            block_tables=torch.where(run[:, None], ds.tables[slots, plane], ds.scratch_block))
        if into is not None:
            for dst, src in zip(into, attn):
                dst.copy_(src[:, :dst.shape[1]] if src.dim() == 2 else src)
            attn = into
        return DecodeRows(slots, dec, *attn, loops=loops, run=run, token_index=tidx)

    def decode_inputs(self, d: DecodeTensors, embed_weight: Tensor, slot_hidden: Tensor,
                      out: Tensor | None = None) -> Tensor:
        """The loop's input of decode rows ``d`` ``[B, H]``: the prelude (the embedding of the fed token)
        for rows starting a token, the slot's hidden state for the others; written into ``out`` if given."""
        x = torch.where(d.starts[:, None], embed_weight[d.input_ids], slot_hidden[d.slots])
        return x if out is None else out.copy_(x)

    def exit_and_store(self, h: Tensor, gate: Tensor, d: DecodeTensors, slot_hidden: Tensor,
                       slot_survival: Tensor) -> Tensor:
        """The exit rule after this loop for decode rows ``d`` (``gate``: their gate logits), and their
        slots' hidden state (``h``) and survival stored for the next loop. Returns ``exit [B] bool``."""
        survival = torch.where(d.loops == 1, torch.ones_like(gate), slot_survival[d.slots])
        ex, survival = exit_decision(d.loops, survival, gate, d.min_loops, d.max_loops, d.threshold)
        slot_hidden[d.slots] = h
        slot_survival[d.slots] = survival
        return ex

    def advance(self, ds: "DeviceDecodeState", slots: Tensor, loops: Tensor, run: Tensor, exited: Tensor,
                sampled: Tensor, record: Tensor | None = None) -> None:
        """After a step, for rows that ran: exited slots restart at loop 0 with their sampled token at the
        next position, the others keep the loop they ran.

        ``record``: ``[3, B]`` int64; where given it also receives each row's exit flag (``exited & run``),
        loop and sampled token, the step's results as the host reads them back (:class:`SampleBatch`)."""
        ex = exited & run
        if record is not None:
            record.copy_(torch.stack([ex.long(), loops, sampled]))
        ds.loop[slots] = torch.where(run, torch.where(ex, torch.zeros_like(loops), loops), ds.loop[slots])
        ds.token[slots] = torch.where(ex, sampled, ds.token[slots])
        ds.pos[slots] = ds.pos[slots] + ex.long()
        ds.token_index[slots] = ds.token_index[slots] + ex.long()

    def pipe_rows(self, ring: LaneRing, ds: "DeviceDecodeState", slots: Tensor, lane: Tensor, max_loops: int,
                  scratch_slot: int, embed_weight: Tensor, into: RowsInto, x: Tensor) -> PipeRows:
        """The depth pipeline's lane rows ``(slots, lane)`` ``[n]`` of a step, inside its graph: an empty lane
        0 of a real slot (its first step, or every lane committed or dropped) starts the slot's committed
        token; every lane's position, KV slot, seq length and table (of its loop's plane) go to ``into``
        and its input (the token's embedding at loop 1, else its hidden state) to ``x`` ``[n, H]``. Lanes
        that do not loop (empty, exited, or the scratch slot's padding rows) run on scratch."""
        key = (slots, lane)
        real = slots != scratch_slot
        enter = (lane == 0) & ~ring.valid[key] & real
        ring.token[key] = torch.where(enter, ds.token[slots], ring.token[key])
        ring.loop[key] = torch.where(enter, 0, ring.loop[key])
        ring.exit_loop[key] = torch.where(enter, 0, ring.exit_loop[key])
        ring.drafted[key] = ring.drafted[key] & ~enter
        ring.valid[key] = ring.valid[key] | enter
        live = ring.valid[key] & (ring.exit_loop[key] == 0) & real
        loop = (ring.loop[key] + 1).clamp(max=max_loops)
        pos = ds.pos[slots] + lane
        plane_slots = torch.where(live[:, None], ds.plane_slots(slots, pos), ds.scratch_block * ds.block_size)
        plane = ds.layout.plane_index(loop)
        into.positions.copy_(torch.where(live, pos, 0))
        into.slot_mapping.copy_(plane_slots.gather(1, plane[:, None]).squeeze(1))
        into.seq_lens.copy_(torch.where(live, pos + 1, 1))
        width = into.block_tables.shape[1]
        into.block_tables.copy_(torch.where(live[:, None], ds.tables[slots, plane][:, :width], ds.scratch_block))
        x.copy_(torch.where((loop == 1)[:, None], embed_weight[ring.token[key]], ring.hidden[key]))
        return PipeRows(loop, live, plane_slots)

    def pipe_finish(self, ring: LaneRing, h: Tensor, gate: Tensor, slots: Tensor, lane: Tensor, rows: PipeRows,
                    min_loops: Tensor, max_loops: Tensor, threshold: Tensor) -> Tensor:
        """Each live lane's own exit rule after the loop it ran (plain decoding's), and its hidden state
        ``h``, survival and loop stored in the ring (its exit loop where it exits). Returns ``exited`` ``[n]``."""
        key, live = (slots, lane), rows.live
        survival = torch.where(rows.loop == 1, torch.ones_like(gate, dtype=torch.float32), ring.survival[key])
        ex, survival = exit_decision(rows.loop, survival, gate, min_loops, max_loops, threshold)
        ring.hidden[key] = torch.where(live[:, None], h, ring.hidden[key])
        ring.survival[key] = torch.where(live, survival, ring.survival[key])
        ring.loop[key] = torch.where(live, rows.loop, ring.loop[key])
        exited = live & ex
        ring.exit_loop[key] = torch.where(exited, rows.loop, ring.exit_loop[key])
        return exited

    def pipe_accept(self, ring: LaneRing, ds: "DeviceDecodeState", slots: Tensor, target: Tensor, depth: int,
                    replay: AcceptanceReplay | None = None, *, redraft: bool = False,
                    drafts: bool = False) -> tuple[Tensor, Tensor]:
        """The depth pipeline's verdicts, commits and entries after sampling (:func:`accept_lanes`).
        ``redraft``: lanes looping past loop ``depth`` re-draft; ``drafts``: lanes at loop ``depth`` draft their
        target token here (without a draft adapter; else :meth:`pipe_store_draft` stored the drafts). With
        ``replay`` (a measurement hook) lane ``j``'s draft (for the slot's completion index ``token_index + j``)
        is judged by the replay's draws: re-drafting, by its change at the loop the lane ran
        (:meth:`AcceptanceReplay.changed`); otherwise once, at its exit, with the replay's first probability,
        and no lane re-drafts."""
        agrees, redraft = None, self.redrafts(replay, redraft)
        if replay is not None and redraft:
            index = ds.token_index[slots][:, None] + ring.lane_ids[None, :]
            agrees = ~replay.changed(slots[:, None], index, ring.loop[slots], depth)
        elif replay is not None:
            agrees = replay.accepted(slots, ds.token_index[slots], ring.lanes, per_position=False)
        return accept_lanes(ring, ds, slots, target, depth, agrees, redraft=redraft, drafts=drafts)

    @staticmethod
    def redrafts(replay: AcceptanceReplay | None, redraft: bool) -> bool:
        """Whether :meth:`pipe_accept`'s lanes re-draft: asked to, and under a replay only one that draws the
        loops' changes (:attr:`AcceptanceReplay.redrafts`)."""
        return redraft and (replay is None or replay.redrafts)

    def pipe_draft_lanes(self, ring: LaneRing, ds: "DeviceDecodeState", slots: Tensor,
                         depth: int) -> tuple[Tensor, Tensor, Tensor]:
        """The depth pipeline's drafting lane of each of ``slots`` ``[M]``: the lane that ran loop ``depth``
        this step and still loops (at most one a slot: live lanes entered in different steps and each runs
        one loop a step). Returns ``lane`` ``[M]`` int64 (0 where none drafts), ``due`` ``[M]`` bool and the
        completion index of the drafting lane's token ``[M]`` int64 (its draft is for the index after it)."""
        due = ring.valid[slots] & (ring.exit_loop[slots] == 0) & (ring.loop[slots] == depth)  # [M, L]
        lane = due.long().argmax(dim=1)
        return lane, due.any(dim=1), ds.token_index[slots] + lane

    def pipe_store_draft(self, ring: LaneRing, slots: Tensor, lane: Tensor, due: Tensor, index: Tensor,
                         drafted: Tensor) -> None:
        """Stores the drafts ``drafted`` ``[M]`` of the due lanes (:meth:`pipe_draft_lanes`) in the ring; a
        draft within the request's max_tokens is a round of one draft (counted when its lane commits)."""
        ring.draft[slots, lane] = torch.where(due, drafted, ring.draft[slots, lane])
        ring.drafted[slots, lane] = ring.drafted[slots, lane] | (due & (index + 1 < ring.limit[slots]))


class DeviceDecodeState:
    def __init__(self, num_slots: int, layout: KVLayout, block_size: int, max_blocks: int, scratch_block: int,
                 device: torch.device, ops: SlotOps | None = None) -> None:
        self.layout, self.block_size, self.device = layout, block_size, device
        self.scratch_block = scratch_block
        self.ops = ops or SlotOps()  # how a step reads and advances the state (torch, or fused kernels)
        i64 = dict(dtype=torch.long, device=device)
        self.loop = torch.zeros(num_slots, **i64)  # loops done by the in-flight token; 0: start a token
        self.pos = torch.zeros(num_slots, **i64)  # position of the token being fed
        self.token = torch.zeros(num_slots, **i64)  # the token fed at loop 1
        self.token_index = torch.zeros(num_slots, **i64)  # index in the completion of the token sampled next
        self.tables = torch.full((num_slots, layout.num_planes, max_blocks), scratch_block, dtype=torch.int32,
                                 device=device)
        self.max_tokens = max_blocks * block_size  # token indices a trace row covers
        self.trace: Tensor | None = None  # [slots, max_tokens] exit depth of each token (exit_mode="trace")
        self.counts: Tensor | None = None  # [slots, vocab] f32 generated-token counts (penalties)
        self.seen: Tensor | None = None  # [slots, vocab] bool: in the prompt or generated
        # [slots, W] int64: each slot's last W generated tokens, oldest first (multi-token bad_words);
        # entries older than the slot's token_index are stale
        self.recent: Tensor | None = None
        self.family_rows: dict[str, Tensor] = {}  # add_family_rows
        # [slots] int64: the loop at which the slot's token exits, fixed two loops ahead (exit_mode="lookahead"; 0: not yet)
        self.exit_target: Tensor | None = None
    def set_trace(self, slot: int, depths: list[int]) -> None:
        """Recorded exit depths of ``slot``'s tokens; the last one repeats past the end (``TraceExit``)."""
        self.allocate_trace()
        row = np.full(self.max_tokens, depths[-1], dtype=np.int8)
        n = min(len(depths), self.max_tokens)
        row[:n] = depths[:n]
        self.trace[slot] = stage(self.device, row)[0]

    def allocate_trace(self) -> None:
        """The per-slot depth table (before CUDA graphs capture reads of it)."""
        if self.trace is None:
            # int8: depths are loop counts, and a row spans max_model_len tokens
            self.trace = torch.ones(self.loop.shape[0], self.max_tokens, dtype=torch.int8, device=self.device)

    def allocate_exit_target(self) -> None:
        """The per-slot fixed exits of the lookahead rule (before CUDA graphs capture reads of it)."""
        if self.exit_target is None:
            self.exit_target = torch.zeros_like(self.loop)

    def plane_slots(self, slots: Tensor, pos: Tensor) -> Tensor:
        """``[n, P]``: the KV slot of position ``pos`` ``[n]`` of each row's slot in every plane."""
        bs = self.block_size
        blk = (pos // bs).view(-1, 1, 1).expand(-1, self.layout.num_planes, 1)
        return self.tables[slots].gather(2, blk).squeeze(2).long() * bs + (pos % bs)[:, None]

    def trace_depths(self, slots: Tensor, token_index: Tensor) -> Tensor:
        assert self.trace is not None, "set_trace() first"
        return self.trace[slots, token_index.clamp(max=self.max_tokens - 1)].long()

    def _per_slot(self) -> dict[str, Tensor]:
        rows = {"loop": self.loop, "pos": self.pos, "token": self.token, "token_index": self.token_index}
        for name in ("trace", "counts", "seen", "recent", "exit_target"):
            if getattr(self, name) is not None:
                rows[name] = getattr(self, name)
        rows.update(self.family_rows)
        return rows

    def add_family_rows(self, rows: dict[str, Tensor]) -> None:
        """A model family's own per-slot state (``loop_stack.py``: Huginn's prelude output, latent seed and
        ``log p``), ``[slots, ...]`` each, saved and loaded with the slot (preemption)."""
        self.family_rows.update(rows)

    def save(self, slot: int, to_host: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """The slot's state (preemption), through ``to_host`` (a non-blocking copy to pinned memory)."""
        return {name: to_host(t[slot]) for name, t in self._per_slot().items()}

    def load(self, slot: int, saved: dict[str, Tensor], block_tables: list) -> None:
        """Restores ``save``'s state into ``slot`` (resumption), with the request's new block tables.
        The state may come from another engine (a prefill worker): what it tracks is allocated here too."""
        if "counts" in saved and self.counts is None:
            vocab = saved["counts"].shape[-1]
            self.counts = torch.zeros(self.loop.shape[0], vocab, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(self.loop.shape[0], vocab, dtype=torch.bool, device=self.device)
        if "trace" in saved:
            self.allocate_trace()
        if "exit_target" in saved:
            self.allocate_exit_target()
        if "recent" in saved:
            self.track_recent(saved["recent"].shape[-1])
        per_slot = self._per_slot()
        for name, t in saved.items():
            per_slot[name][slot] = t.to(self.device, non_blocking=True)
        self.set_tables(slot, block_tables)

    def track_penalties(self, slot: int, prompt: Tensor, vocab: int) -> None:
        """Starts counting ``slot``'s tokens for a request with penalties (its prompt is seen)."""
        if self.counts is None:
            self.counts = torch.zeros(self.loop.shape[0], vocab, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(self.loop.shape[0], vocab, dtype=torch.bool, device=self.device)
        self.counts[slot] = 0
        self.seen[slot] = False
        self.seen[slot].index_fill_(0, prompt, True)  # (not seen[slot, prompt] = True: see start)

    def track_recent(self, width: int) -> None:
        """Starts keeping every slot's last ``width`` generated tokens (bad words; before its first token)."""
        if self.recent is None:
            self.recent = torch.zeros(self.loop.shape[0], width, dtype=torch.long, device=self.device)

    def _push(self, slots: Tensor, tokens: Tensor, taken: Tensor) -> None:
        if self.recent is not None:
            rows = self.recent[slots]
            pushed = torch.cat([rows[:, 1:], tokens.long()[:, None]], dim=1)
            self.recent[slots] = torch.where(taken[:, None], pushed, rows)

    def _count(self, slots: Tensor, tokens: Tensor, taken: Tensor) -> None:
        if self.counts is not None:  # slots are distinct, so accumulate adds each (slot, token) once
            self.counts.index_put_((slots, tokens), taken.to(self.counts.dtype), accumulate=True)
            self.seen[slots, tokens] |= taken

    def set_tables(self, slot: int, block_tables: list[list[int]]) -> None:
        staged = stage(self.device, *((blocks, np.int32) for blocks in block_tables))
        for plane, (blocks, dev) in enumerate(zip(block_tables, staged)):
            self.tables[slot, plane, :len(blocks)] = dev

    def start(self, slots: Tensor, tokens: Tensor, positions: Tensor) -> None:
        """Prefill finished: the first generated token is fed at ``positions`` (the prompt length)."""
        # index_fill_/index_copy_, not ``t[slots] = 0``: a Python scalar assigned through a tensor index is
        # staged from pageable host memory, a copy that waits for the whole queue (measured on an H200: every
        # step that finished a prompt waited ~8 ms for the step in flight, a third of refill's prefill cost)
        self.loop.index_fill_(0, slots, 0)
        self.token.index_copy_(0, slots, tokens.long())
        self.pos.index_copy_(0, slots, positions.long())
        self.token_index.index_fill_(0, slots, 1)
        self._count(slots, tokens, torch.ones_like(slots, dtype=torch.bool))
        self._push(slots, tokens, torch.ones_like(slots, dtype=torch.bool))

    def take_run(self, slots: Tensor, tokens: Tensor, taken: Tensor) -> None:
        """Each slot's run of tokens (``tokens`` ``[M, n]``, ``taken`` the prefix of it committed, a speculative
        round's) joins its generated-token counts and last tokens, one position at a time as :meth:`advance` adds one."""
        if self.counts is not None or self.recent is not None:
            for j in range(tokens.shape[1]):
                self._count(slots, tokens[:, j], taken[:, j])
                self._push(slots, tokens[:, j], taken[:, j])

    def advance(self, slots: Tensor, loops: Tensor, run: Tensor, exited: Tensor, sampled: Tensor,
                record: Tensor | None = None) -> None:
        """After a step: exited slots take their sampled token and move to the next position
        (``record``: see :meth:`SlotOps.advance`)."""
        self.ops.advance(self, slots, loops, run, exited, sampled, record)
        if self.counts is not None or self.recent is not None:  # (the mask is a launch of its own)
            taken = exited & run
            self._count(slots, sampled, taken)
            self._push(slots, sampled, taken)
