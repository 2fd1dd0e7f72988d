"""Per-slot decode state that advances on the device (async scheduling).

With ``async_scheduling`` the host launches step n+1 before it reads step n's
results, so it cannot tell a decode slot which loop to run or which token to
feed. The device does: after each step a slot whose token exited starts its
next token at loop 1 at the next position, fed with the token it just sampled
(``refill``), or idles until no slot is in flight (``no_refill``); a slot
whose token did not exit runs its next loop. The exit rule itself ran on the
device, so these are exactly the sync engine's decisions, only never read by
the host in between.

Presence, frequency and repetition penalties need each slot's generated
tokens, which the host reads one step late; so the device keeps them too, as
per-slot token counts and a seen mask (prompt or output), allocated when the
first request with penalties arrives. Likewise ``exit_mode="trace"`` depths
are kept per slot and read at the device's token index. A preempted request's
slot state is saved and loaded with it (``save`` / ``load``).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from loopline.kv.layout import KVLayout
from loopline.worker.staging import stage


class DeviceDecodeState:
    def __init__(self, num_slots: int, layout: KVLayout, block_size: int, max_blocks: int, scratch_block: int,
                 device: torch.device) -> None:
        self.layout, self.block_size, self.device = layout, block_size, device
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

    def trace_depths(self, slots: Tensor, token_index: Tensor) -> Tensor:
        assert self.trace is not None, "set_trace() first"
        return self.trace[slots, token_index.clamp(max=self.max_tokens - 1)].long()

    def _per_slot(self) -> dict[str, Tensor]:
        rows = {"loop": self.loop, "pos": self.pos, "token": self.token, "token_index": self.token_index}
        for name in ("trace", "counts", "seen"):
            if getattr(self, name) is not None:
                rows[name] = getattr(self, name)
        return rows

    def save(self, slot: int, to_host: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """The slot's state (preemption), through ``to_host`` (a non-blocking copy to pinned memory)."""
        return {name: to_host(t[slot]) for name, t in self._per_slot().items()}

    def load(self, slot: int, saved: dict[str, Tensor], block_tables: list) -> None:
        """Restores ``save``'s state into ``slot`` (resumption), with the request's new block tables."""
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
        self.seen[slot, prompt] = True

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
        self.loop[slots] = 0
        self.token[slots] = tokens
        self.pos[slots] = positions
        self.token_index[slots] = 1
        self._count(slots, tokens, torch.ones_like(slots, dtype=torch.bool))

    def rows(self, slots: Tensor, no_refill: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Step inputs of decode rows ``slots`` ``[B]``: ``(loops, positions, plane_slots [B, P], run, token_index)``.

        ``run`` is False for a ``no_refill`` slot that waits for its cohort: such a row
        runs on scratch and changes nothing.
        """
        loop = self.loop[slots]
        run = torch.ones_like(loop, dtype=torch.bool)
        if no_refill:
            in_flight = (loop > 0).any()
            run = (loop > 0) | ~in_flight
        loops = loop + 1
        pos = self.pos[slots]
        blk = (pos // self.block_size).view(-1, 1, 1).expand(-1, self.layout.num_planes, 1)
        plane_slots = self.tables[slots].gather(2, blk).squeeze(2).long() * self.block_size + (pos % self.block_size)[:, None]
        return loops, pos, plane_slots, run, self.token_index[slots]

    def advance(self, slots: Tensor, loops: Tensor, run: Tensor, exited: Tensor, sampled: Tensor) -> None:
        """After a step: exited slots take their sampled token and move to the next position."""
        # NOTE: imported here, not at the top: Triton reads TRITON_INTERPRET when it first decorates a
        # kernel, and the CPU-interpreted tests set it after the engine modules are imported.
        from loopline.kernels import slot_state

        if self.loop.is_cuda and slot_state.available():  # one launch instead of ~15 tiny ones
            slot_state.advance_slots(self.loop, self.token, self.pos, self.token_index, slots, loops, run, exited, sampled)
        else:
            advance_reference(self.loop, self.token, self.pos, self.token_index, slots, loops, run, exited, sampled)
        self._count(slots, sampled, exited & run)


def advance_reference(loop: Tensor, token: Tensor, pos: Tensor, token_index: Tensor, slots: Tensor, loops: Tensor,
                      run: Tensor, exited: Tensor, sampled: Tensor) -> None:
    """:func:`loopline.kernels.slot_state.advance_slots` in torch (the reference it is tested against)."""
    ex = exited & run
    loop[slots] = torch.where(run, torch.where(ex, torch.zeros_like(loops), loops), loop[slots])
    token[slots] = torch.where(ex, sampled, token[slots])
    pos[slots] = pos[slots] + ex.long()
    token_index[slots] = token_index[slots] + ex.long()
