"""Continuous depth batching scheduler (docs/design.md, 'Scheduling'). Host-side only: no torch.

Every step runs one loop for each scheduled row. Decode rows go first (one
token each, in persistent slots); prefill chunks fill the rest of the token
budget. Because ``max_num_batched_tokens >= max_num_seqs`` (validated) every
running request gets a row or budget every step, so neither prefill nor
decode starves: decode rows always fit, and when all slots are busy at least
one prefilling request owns a slot and the leftover budget.

KV policies are small strategy objects: :class:`Allocation` (full reservation
or incremental growth) and the optional :class:`Preemption` (snapshot a
victim to CPU memory when KV runs out or a higher-priority request waits).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from loopline.core.contracts import (
    NewRequestData,
    ResumedRequestData,
    RunnerOutput,
    ScheduledRow,
    SchedulerOutput,
)
from loopline.core.exit_policy import ExitPolicy
from loopline.core.queue import RequestQueue
from loopline.core.request import PrefillChunk, Request, RequestStatus
from loopline.core.speculation import NoSpeculation
from loopline.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)


# Statuses whose rows a step runs (HANDOFF: the prompt's last loop, booked as the row was scheduled).
_SCHEDULED = (RequestStatus.DECODE, RequestStatus.PREFILL, RequestStatus.HANDOFF)


# --- strategies -------------------------------------------------------------------------------
class Allocation:
    """Full reservation: a request's whole ``prompt + max_tokens`` is allocated at admission."""

    name = "full"

    def initial_tokens(self, req: Request) -> int:
        return req.num_tokens_reserved

    def needs_growth(self) -> bool:
        return False


class IncrementalAllocation(Allocation):
    """Blocks grow with the sequence; the growth of running requests stays reserved
    unless preemption may reclaim it."""

    name = "incremental"

    def initial_tokens(self, req: Request) -> int:
        return req.num_positions

    def needs_growth(self) -> bool:
        return True


def make_allocation(name: str) -> Allocation:
    return {"full": Allocation, "incremental": IncrementalAllocation}[name]()


@dataclass
class Preemption:
    """Snapshot victims to CPU memory (never recompute: a replay would change the exit history).

    Victim: the lowest priority (largest ``priority`` value), then the largest KV footprint.
    ``swap_blocks`` bounds the KV blocks held in CPU snapshots.
    """

    swap_blocks: int
    swapped_blocks: int = 0

    def pick_victim(self, candidates: list[Request], kv: KVCacheManager, worse_than: int | None = None) -> Request | None:
        fits = [r for r in candidates if kv.get(r.request_id).num_blocks <= self.swap_blocks - self.swapped_blocks
                and (worse_than is None or r.priority > worse_than)]
        if not fits:
            return None
        return max(fits, key=lambda r: (r.priority, kv.get(r.request_id).num_blocks, r.arrival_seq))


# --- scheduler --------------------------------------------------------------------------------
class Scheduler:
    def __init__(self, kv: KVCacheManager, exit_policy: ExitPolicy, queue: RequestQueue,
                 max_num_seqs: int, max_num_batched_tokens: int, num_loops: int,
                 allocation: Allocation | None = None, preemption: Preemption | None = None,
                 watermark_blocks: int = 0, after_prefill: RequestStatus = RequestStatus.DECODE,
                 speculation: NoSpeculation | None = None) -> None:
        self.kv = kv
        self.exit_policy = exit_policy
        self.waiting = queue
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        # NOTE: a chunk re-runs once per loop at its first size, so it must fit beside a full
        # decode batch (max_num_seqs - 1 other rows): then the oldest prefill progresses every step.
        self.max_chunk = max_num_batched_tokens - max_num_seqs + 1
        self.num_loops = num_loops
        self.allocation = allocation or Allocation()
        self.preemption = preemption
        self.watermark_blocks = watermark_blocks
        # loop self-speculation: which requests run draft-then-verify rounds instead of decode rows
        self.speculation = speculation or NoSpeculation()
        # DECODE: the request decodes here; HANDOFF (a prefill worker, loopline.distributed.pd): it is
        # never scheduled again and leaves with its first token for a decode worker.
        self.after_prefill = after_prefill
        self.cache_salt: object = 0  # the weight version: prefix-cache keys include it
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._out = SchedulerOutput([])
        self._snapshot_blocks: dict[str, int] = {}
        self._moved_now: set[str] = set()  # started, resumed or preempted in the current schedule()
        self._restored_prompts: list[Request] = []  # handed-off requests resumed by the last schedule()

    # --- lifecycle --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        # (the requests it will run beside: those running and those queued before it)
        request.speculative = self.speculation.admit(request, len(self.running) + len(self.waiting))
        request.lookahead = self.speculation.lookahead(request.params) if request.speculative else 0
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def adopt(self, request: Request) -> None:
        """Queues a request handed off by a prefill worker: ``PREEMPTED`` with ``resume_status``
        ``DECODE``, its state in a runner snapshot, so it resumes exactly like a preempted request.
        Its prompt pages are already in the KV manager (reserved as they arrived, written there);
        admission only adds the rest of its reservation."""
        assert request.status == RequestStatus.PREEMPTED and request.resume_status == RequestStatus.DECODE
        assert self.kv.owns(request.request_id), request.request_id
        self.add_request(request)

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> Request | None:
        """Finishes (or aborts) a request and frees its KV, slot and snapshot at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
            self.kv.free(req.request_id)  # a handed-off request's reserved prompt pages (else it owns none)
        else:
            self.running.remove(req)
            self.kv.free(req.request_id)
            self._release_slot(req)
        if req.status == RequestStatus.PREEMPTED and self.preemption is not None:
            self.preemption.swapped_blocks -= self._snapshot_blocks.pop(request_id, 0)
        if req.status != RequestStatus.WAITING:
            self._out.finished_request_ids.append(request_id)  # the runner drops state / snapshot
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

    def _release_slot(self, req: Request) -> None:
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    # --- schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        rows: list[ScheduledRow] = []
        self._moved_now.clear()
        self._cache_restored_prompts()
        self._admit()
        # NOTE: the device decides each decode row's loop (and no_refill cohorts); a row only names
        # its slot, so every decoding request gets one every step. Speculating requests' rows follow
        # the plain decode rows (the runner's row kinds come in that order).
        spec: list[ScheduledRow] = []
        for req in [r for r in self.running if r.status == RequestStatus.DECODE]:
            if req.status != RequestStatus.DECODE:
                continue  # preempted while another request grew
            # NOTE: a round's positions are all allocated at its start (num_positions covers the round even
            # when the previous round's commit is still unread), so a round in flight never grows: growing then,
            # as its previous commit is read, could find no victim (speculating requests are preempted only
            # between rounds) and leave every request waiting (tests/spec/test_engine.py, preemption)
            mid_round = req.speculative and req.spec_step > 0
            if self.allocation.needs_growth() and not mid_round and not self._grow(req):
                continue  # out of KV: it waits (or was preempted)
            exit = self.exit_policy.params_for(req.params, req.num_output_tokens) if req.speculative else None
            if exit is not None and req.spec_step == 0:  # a round starts: its size, and whether it runs at all
                self.speculation.plan_round(req, exit.max_loops, len(self.running))
                why = self.speculation.why_stop(req, exit.max_loops, len(self.running))
                if why is not None:
                    logger.debug("request %s stops speculating: %s", req.request_id, why)
                    req.speculative = False
            if req.speculative:
                mine = self.speculation.rows(req, exit)
                spec += mine
            else:
                mine = [self._decode_row(req)]
                rows += mine
            budget -= sum(row.num_tokens for row in mine)
        rows += self.speculation.order(spec)
        for req in self.running:
            if req.status == RequestStatus.PREFILL and budget > 0:
                budget = self._schedule_prefill(req, rows, budget)
        rows = [r for r in rows if self.requests[r.request_id].status in _SCHEDULED]
        for r in spec:  # only rows sure to run move their round on
            if self.requests[r.request_id].status in _SCHEDULED:
                self.speculation.booked(self.requests[r.request_id], r)
        out, self._out = self._out, SchedulerOutput([])
        out.rows = rows
        return out

    def _cache_restored_prompts(self) -> None:
        """Caches the prompt pages of handed-off requests that the previous step resumed.
        NOTE: only now: a page must never be found before its KV is written (the runner orders the
        pages' writes before that step), and a step that failed to launch failed (and removed) its
        requests."""
        for req in self._restored_prompts:
            if self.requests.get(req.request_id) is req and req.status == RequestStatus.DECODE:
                self.kv.cache_prompt(req.request_id, req.prompt_token_ids, self.prefix_salt(req.params._cache_salt))
        self._restored_prompts.clear()

    def _decode_row(self, req: Request) -> ScheduledRow:
        # The device knows this slot's loop, position and token; the row only names the slot and the
        # exit rule (per-token rules are read on the device at its own token index).
        return ScheduledRow(request_id=req.request_id, is_prefill=False, start=-1, end=0, loop=0, plane=-1,
                            input_token_ids=None, slot=req.slot,
                            exit=self.exit_policy.params_for(req.params, req.num_output_tokens), seq=req.arrival_seq)

    # --- admission --------------------------------------------------------------------
    def _may_overcommit(self) -> bool:
        """Admission may skip reserving growth only if a victim can always be swapped out."""
        p = self.preemption
        if p is None:
            return False
        largest = max((self.kv.get(r.request_id).num_blocks for r in self.running), default=0)
        return p.swap_blocks - p.swapped_blocks >= max(largest, self.kv.blocks_needed(1))

    def _reserved_growth(self) -> int:
        if not self.allocation.needs_growth() or self._may_overcommit():
            return 0
        return sum(self.kv.growth_blocks(r.request_id, r.num_tokens_reserved) for r in self.running)

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting.peek()
            if req.request_id in self._moved_now:
                break  # preempted in this step: it resumes in a later one
            if len(self.running) >= self.max_num_seqs or not self._try_allocate(req):
                if self._preempt_for(req):
                    continue
                break  # head-of-line: later requests wait too, so big requests never starve
            self.waiting.pop()
            self._start(req)

    def _try_allocate(self, req: Request) -> bool:
        keep = self.watermark_blocks + self._reserved_growth()
        if self.allocation.needs_growth() and not self._may_overcommit():
            keep += self.kv.blocks_needed(req.num_tokens_reserved) - self.kv.blocks_needed(self.allocation.initial_tokens(req))
        if req.handed_off:  # its prompt pages were reserved (and written) before it was adopted
            if self.kv.grow(req.request_id, self.allocation.initial_tokens(req), keep_free=keep) is None:
                return False
            # NOTE: only once it resumes in this step: the runner orders its pages' writes before the
            # step, so pages it gives up here are free to be written by any request from then on
            self.kv.share_cached_prefix(req.request_id, req.prompt_token_ids, self.prefix_salt(req.params._cache_salt))
            return True
        resumed = req.status == RequestStatus.PREEMPTED
        match = not (resumed or req.params.prompt_logprobs is not None)
        alloc = self.kv.allocate(req.request_id, self.allocation.initial_tokens(req),
                                 req.prompt_token_ids if match else None, self.prefix_salt(req.params._cache_salt), keep_free=keep)
        return alloc is not None

    def _start(self, req: Request) -> None:
        self._moved_now.add(req.request_id)
        alloc = self.kv.get(req.request_id)
        req.slot = self._free_slots.pop()
        self.running.append(req)
        if req.status == RequestStatus.PREEMPTED:
            req.status, req.resume_status = req.resume_status, None
            if self.preemption is not None:
                self.preemption.swapped_blocks -= self._snapshot_blocks.pop(req.request_id, 0)
            self._out.resumed_requests.append(ResumedRequestData(req.request_id, alloc.block_tables, req.slot,
                                                                 alloc.num_cached_tokens // self.kv.block_size))
            if req.handed_off:  # its prompt pages hold final KV for every step launched from now on
                req.handed_off = False
                self._restored_prompts.append(req)
            return
        req.status = RequestStatus.PREFILL
        req.cache_salt = self.cache_salt
        req.num_cached_tokens = alloc.num_cached_tokens
        if alloc.num_cached_tokens:
            req.chunks.append(PrefillChunk(0, alloc.num_cached_tokens, loops_done=self._prefill_loops(req)))
        self._out.new_requests.append(NewRequestData(
            req.request_id, req.prompt_token_ids, alloc.block_tables, req.seed, req.params,
            self.exit_policy.params_for(req.params, 0), alloc.num_cached_tokens, req.slot))

    # --- growth and preemption --------------------------------------------------------
    def _grow(self, req: Request) -> bool:
        """Makes room for the position the next decode token writes, preempting if allowed."""
        while True:
            added = self.kv.grow(req.request_id, req.num_positions)
            if added is not None:
                if any(added):
                    self._out.block_updates.setdefault(req.request_id, [[] for _ in added])
                    for table, blocks in zip(self._out.block_updates[req.request_id], added):
                        table.extend(blocks)
                return True
            if self.preemption is None:
                return False
            victim = self.preemption.pick_victim(self._victims(), self.kv)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False

    def _victims(self) -> list[Request]:
        """Running requests that may be preempted: not ones started or resumed in this same step
        (they have not run; preempting them would only thrash)."""
        # NOTE: a speculating request is preempted only between rounds (its round state is not snapshotted)
        return [r for r in self.running if r.request_id not in self._moved_now and r.status != RequestStatus.HANDOFF
                and r.spec_step == 0]

    def _preempt_for(self, waiting: Request) -> bool:
        """Preempts a running request of strictly lower priority than ``waiting``."""
        if self.preemption is None:
            return False
        victim = self.preemption.pick_victim(self._victims(), self.kv, worse_than=waiting.priority)
        if victim is None:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, req: Request) -> None:
        assert self.preemption is not None
        self._moved_now.add(req.request_id)
        blocks = self.kv.get(req.request_id).num_blocks
        self.preemption.swapped_blocks += blocks
        self._snapshot_blocks[req.request_id] = blocks
        self._out.preempted_request_ids.append(req.request_id)
        # NOTE: the runner snapshots this request's KV at the start of the step,
        # before any freed block is written by another request.
        self.kv.free(req.request_id)
        self.running.remove(req)
        self._release_slot(req)
        self._out.block_updates.pop(req.request_id, None)
        req.resume_status, req.status = req.status, RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)

    # --- prefill ----------------------------------------------------------------------
    def _schedule_prefill(self, req: Request, rows: list[ScheduledRow], budget: int) -> int:
        layout = self.kv.layout
        done = [c.loops_done for c in req.chunks]
        planned = list(done)
        depth = self._prefill_loops(req)
        for i, chunk in enumerate(req.chunks):
            n = chunk.end - chunk.start
            if n <= budget and done[i] < depth and layout.chunk_may_run(done, planned, i, req.fully_chunked):
                rows.append(self._prefill_row(req, chunk))
                planned[i] += 1
                budget -= n
                self._book_loop(req, chunk)
        if budget > 0 and not req.fully_chunked:
            if layout.chunk_may_run(done + [0], planned + [0], len(req.chunks), False):
                start = req.num_chunked
                chunk = PrefillChunk(start, min(req.prompt_len, start + budget, start + self.max_chunk))
                req.chunks.append(chunk)
                rows.append(self._prefill_row(req, chunk))
                budget -= chunk.end - chunk.start
                self._book_loop(req, chunk)
        return budget

    def _book_loop(self, req: Request, chunk: PrefillChunk) -> None:
        """Books a prefill chunk's loop when it is scheduled: prefill progress does not depend on
        results, so the next step can be scheduled before this one is read."""
        chunk.loops_done += 1
        depth = self._prefill_loops(req)
        if req.fully_chunked and all(c.loops_done == depth for c in req.chunks):
            self.prefill_done(req)

    def _prefill_loops(self, req: Request) -> int:
        """Loops ``req``'s prompt runs: its family's rule (Huginn: its max_loops), else every loop."""
        return req.prefill_loops or self.num_loops

    def _prefill_row(self, req: Request, chunk: PrefillChunk) -> ScheduledRow:
        loop = chunk.loops_done + 1
        ids = req.prompt_token_ids[chunk.start:chunk.end] if loop == 1 else None
        return ScheduledRow(
            request_id=req.request_id, is_prefill=True, start=chunk.start, end=chunk.end, loop=loop,
            plane=self.kv.layout.plane(loop), input_token_ids=ids, slot=req.slot,
            is_last_chunk=chunk.end == req.prompt_len, seq=req.arrival_seq)

    # --- update -----------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Applies a step's results; returns requests that received a token."""
        touched: list[Request] = []
        for i, (row, sample) in enumerate(zip(sched.rows, result.sampled)):
            req = self.owner(row)
            if req is None:  # finished or aborted meanwhile
                continue
            if sample is not None:
                req.output.append(sample)
                if row.spec is not None:  # a round's committed run: the sample, then the rest
                    req.unbooked = list(result.more.get(i, ()))
                    self.speculation.observe(req, [sample, *req.unbooked], len(self.running), row.spec.queries - 1)
                touched.append(req)
        return touched

    @staticmethod
    def take_unbooked(req: Request) -> bool:
        """Appends the next token of a speculative round's accepted run to ``req.output``; False when none
        is left. The engine books a run token by token, so a stop ends it exactly where it stops."""
        if not req.unbooked:
            return False
        req.output.append(req.unbooked.pop(0))
        return True

    def prefix_salt(self, cache_salt: str | None) -> object:
        """The prefix-cache salt of a request's prompt pages: the weight version, and the request's own
        ``cache_salt`` when it has one (pages are shared only between requests of equal salts)."""
        return self.cache_salt if cache_salt is None else (self.cache_salt, cache_salt)

    def owner(self, row: ScheduledRow) -> Request | None:
        """The unfinished request a row was scheduled for. A step read after its request finished
        (the overlapped engine) finds none, also when a new request took the same id meanwhile."""
        req = self.requests.get(row.request_id)
        return req if req is not None and req.arrival_seq == row.seq else None

    def prefill_done(self, req: Request) -> None:
        req.status = self.after_prefill
        # NOTE: a prompt whose prefill began under older weights (frozen across an
        # update by pause "keep") is never cached under the new salt.
        if req.cache_salt == self.cache_salt:
            self.kv.cache_prompt(req.request_id, req.prompt_token_ids, self.prefix_salt(req.params._cache_salt))

    def blocked_victim(self) -> Request | None:
        """When a step could schedule nothing although requests run (KV and swap exhausted),
        the request to fail so the others can finish."""
        if not self.running:
            return None
        return max(self.running, key=lambda r: (r.priority, r.arrival_seq))

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
