"""Continuous depth batching scheduler (DESIGN.md §4). Host-side only: no torch.

Every step runs one loop for each scheduled row. Decode rows go first (one
token each, in persistent slots); prefill chunks fill the rest of the token
budget. Because ``max_num_batched_tokens >= max_num_seqs`` (validated) every
running request gets a row or budget every step, so neither prefill nor
decode starves: decode rows always fit, and when all slots are busy at least
one prefilling request owns a slot and the leftover budget.
"""
from __future__ import annotations

from collections.abc import Iterable

from loopline.core.contracts import (
    NewRequestData,
    RunnerOutput,
    ScheduledRow,
    SchedulerOutput,
)
from loopline.core.exit_policy import ExitPolicy
from loopline.core.queue import RequestQueue
from loopline.core.request import PrefillChunk, Request, RequestStatus
from loopline.kv.manager import KVCacheManager


class SchedulingMode:
    """Whether a decode slot whose token exited may start its next token now."""

    name = "refill"

    def may_start_token(self, running_decode: Iterable[Request]) -> bool:
        return True


class NoRefill(SchedulingMode):
    """Cohort baseline: exited rows idle until every in-flight token has exited."""

    name = "no_refill"

    def may_start_token(self, running_decode: Iterable[Request]) -> bool:
        return not any(r.token_loop > 0 for r in running_decode)


def make_scheduling_mode(name: str) -> SchedulingMode:
    return {"refill": SchedulingMode, "no_refill": NoRefill}[name]()


class Scheduler:
    def __init__(self, kv: KVCacheManager, exit_policy: ExitPolicy, mode: SchedulingMode, queue: RequestQueue,
                 max_num_seqs: int, max_num_batched_tokens: int, num_loops: int) -> None:
        self.kv = kv
        self.exit_policy = exit_policy
        self.mode = mode
        self.waiting = queue
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.num_loops = num_loops
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._finished_since_schedule: list[str] = []
        self._new_since_schedule: list[NewRequestData] = []

    # --- lifecycle --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> Request | None:
        """Finishes (or aborts) a request and frees its KV and slot at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.kv.free(req.request_id)
            if req.slot >= 0:
                self._free_slots.append(req.slot)
                req.slot = -1
            self._finished_since_schedule.append(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        rows: list[ScheduledRow] = []
        decoding = [r for r in self.running if r.status == RequestStatus.DECODE]
        may_start = self.mode.may_start_token(decoding)
        for req in decoding:
            if req.token_loop == 0 and not may_start:
                continue
            rows.append(self._decode_row(req))
            budget -= 1
        self._admit()
        for req in self.running:
            if req.status == RequestStatus.PREFILL and budget > 0:
                budget = self._schedule_prefill(req, rows, budget)
        out = SchedulerOutput(rows, self._new_since_schedule, self._finished_since_schedule)
        self._new_since_schedule, self._finished_since_schedule = [], []
        return out

    def _decode_row(self, req: Request) -> ScheduledRow:
        pos = req.next_position
        loop = req.token_loop + 1
        token_index = req.num_output_tokens
        return ScheduledRow(
            request_id=req.request_id, is_prefill=False, start=pos, end=pos + 1, loop=loop,
            plane=self.kv.layout.plane(loop), input_token_ids=[req.last_token_id] if loop == 1 else None,
            slot=req.slot, exit=self.exit_policy.params_for(req.params, token_index), token_index=token_index)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if not self.kv.can_allocate(req.num_tokens_reserved):
                break  # head-of-line: later requests wait too, so big requests never starve
            self.waiting.pop()
            alloc = self.kv.allocate(req.request_id, req.num_tokens_reserved)
            req.status = RequestStatus.PREFILL
            req.slot = self._free_slots.pop()
            self.running.append(req)
            self._new_since_schedule.append(NewRequestData(
                req.request_id, req.prompt_token_ids, alloc.block_tables, req.seed, req.params,
                self.exit_policy.params_for(req.params, 0)))

    def _schedule_prefill(self, req: Request, rows: list[ScheduledRow], budget: int) -> int:
        layout = self.kv.layout
        done = [c.loops_done for c in req.chunks]
        planned = list(done)
        for i, chunk in enumerate(req.chunks):
            n = chunk.end - chunk.start
            if n <= budget and layout.chunk_may_run(done, planned, i, req.fully_chunked):
                rows.append(self._prefill_row(req, chunk))
                planned[i] += 1
                budget -= n
        if budget > 0 and not req.fully_chunked:
            if layout.chunk_may_run(done + [0], planned + [0], len(req.chunks), False):
                start = req.num_chunked
                chunk = PrefillChunk(start, min(req.prompt_len, start + budget))
                req.chunks.append(chunk)
                rows.append(self._prefill_row(req, chunk))
                budget -= chunk.end - chunk.start
        return budget

    def _prefill_row(self, req: Request, chunk: PrefillChunk) -> ScheduledRow:
        loop = chunk.loops_done + 1
        ids = req.prompt_token_ids[chunk.start:chunk.end] if loop == 1 else None
        return ScheduledRow(
            request_id=req.request_id, is_prefill=True, start=chunk.start, end=chunk.end, loop=loop,
            plane=self.kv.layout.plane(loop), input_token_ids=ids, slot=req.slot,
            is_last_chunk=chunk.end == req.prompt_len, token_index=0)

    # --- update -----------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Applies a step's results; returns requests that received a token."""
        touched: list[Request] = []
        for row, exited, sample in zip(sched.rows, result.exited, result.sampled):
            req = self.requests.get(row.request_id)
            if req is None:  # finished or aborted meanwhile
                continue
            if row.is_prefill:
                chunk = next(c for c in req.chunks if c.start == row.start)
                chunk.loops_done += 1
                if exited:
                    req.status = RequestStatus.DECODE
            elif exited:
                req.token_loop = 0
            else:
                req.token_loop += 1
            if sample is not None:
                req.output.append(sample)
                touched.append(req)
        return touched

    def check_stop(self, req: Request) -> tuple[str, int | str | None] | None:
        """Finish reason from token ids and length (stop strings are the engine's)."""
        last = req.output[-1].token_id
        if not req.params.ignore_eos and last in req.eos_token_ids:
            return "stop", None
        if last in req.params.stop_token_ids:
            return "stop", last
        if req.num_output_tokens >= req.max_tokens:
            return "length", None
        return None

