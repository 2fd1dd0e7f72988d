"""Prefill/decode disaggregation: prefill workers and decode workers as engines of their own.

``loopline serve --prefill-workers P --decode-workers D`` (``EngineArgs.prefill_workers`` /
``decode_workers``) gives ``AsyncLLM`` a :class:`PDClient` instead of the one-process client.
Each worker is an engine whose loop is a :class:`PrefillCore` or a :class:`DecodeCore`; a
:class:`WorkerPool` runs them: engine processes on this host (:class:`ProcessWorkerPool`,
``runtime.client.MPClient`` machinery, ``spawn``), or Ray actors in a placement group, one bundle
per worker, on any node of a Ray cluster (``--distributed-executor-backend ray``,
``ray_backend.RayWorkerPool``, the actor machinery data-parallel replicas use). A request's life:

1. **Admission (front end).** It waits in the front end until some decode worker has *credit*
   for its whole reservation (``planes * ceil((prompt + max_tokens) / block_size)`` KV pages):
   a decode worker never receives more than its pool holds, and the prefill side is held back
   while decode is full (back-pressure). It then goes to the prefill worker with the fewest
   requests, tagged with its decode worker and a transfer tag.
2. **Prefill (prefill worker).** Full-depth chunked prefill as in a single engine
   (``LLMEngine(prefill_only=True)``). The **first token is sampled on the prefill worker**, in
   the step where the last chunk finishes its last loop, exactly where a single engine samples
   it: only that worker holds the last prompt position's hidden state at the depth the exit rule
   picked (and its gate values); sampling is counter-based (seed, token index 0), so the token is
   the single engine's. It streams to the client from there (TTFT pays no transfer).
3. **Handoff.** If the first token did not end the request, the prefill worker exports it
   (``LLMEngine.handoff.take``: a copy of its prompt's KV pages of every plane -- all R for
   ``last_exited``, the one for ``shared`` -- and its slot's decode state), frees its pages at
   once, starts the transport's send on its own thread and reports the handoff; the front end
   forwards it to the decode worker, which resumes the request exactly as a preempted one
   (``LLMEngine.handoff.adopt``) once its pages are in. Its text and logprob deltas continue the prefill
   worker's in the same client stream.

   The decode worker reserves the request's prompt pages (every plane the layout keeps) in its
   own KV pool, through its KV manager, when the first piece arrives (``LLMEngine.handoff.reserve``;
   the front end's credit guarantees the room), and writes every piece straight into them as it
   is received (``LLMEngine.handoff.write_pages``: gloo's CPU tensor copied into the pages; on CUDA
   a copy on a stream of its own that the step resuming the request waits for). Adoption then
   copies nothing. A request that is dropped, fails or cannot be reserved frees its pages at once.

Failures: a failed or timed-out transfer fails its request (clean error, an error id in the
log); a dead worker fails only the requests it held (and, for a decode worker, those still
prefilling for it); the others continue, and the client is dead only when no prefill or no
decode worker is left. Aborts reach whichever worker holds the request, also mid-transfer.
``n > 1`` is refused (one completion per request). Of the control verbs (``engine/verbs.py``),
those the table marks ``disaggregated`` (``reset_prefix_cache``, ``abort_all`` and the read-only
state queries) go to every worker, their answers combined by the verb's rule
(``runtime.fanout``); the others are refused.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from loopline.engine.verbs import VERBS
from loopline.errors import CapacityError, EngineDeadError, EngineStateError, InvalidRequestError, LooplineError
from loopline.distributed.kv_transfer import check_transport_device, make_transport, resolve_transport
from loopline.distributed.pd_worker import WorkerRole
from loopline.distributed.worker_pool import WorkerLink, WorkerPool, WorkerSpec
from loopline.runtime.client import EngineClient, ended_by_abort
from loopline.runtime.fanout import Gather
from loopline.runtime.protocol import (AbortCmd, AcceptCmd, AddCmd, CallCmd, Command, DropCmd, EngineInfo,
                                       EngineMessage, EngineSnapshot, HandoffMsg, PieceCmd, PieceMsg, PrefillCmd, Reply,
                                       ShutdownCmd)

logger = logging.getLogger("loopline.pd")

_TAG_STRIDE = 2**16


def disaggregation_refusal(name: str, until_drained: bool = False) -> LooplineError | None:
    """Why prefill/decode disaggregation refuses the control call (``None``: it is sent to every
    worker): an unknown verb, a verb the table does not mark ``disaggregated``, or a reply that
    would wait for the requests in flight to drain."""
    try:
        verb = VERBS.lookup(name)
    except LooplineError as e:
        return e
    if not verb.disaggregated or until_drained:
        return EngineStateError(f"{name} is not supported with prefill/decode disaggregation")
    return None


@dataclass
class Placement:
    """Where a request is: its prefill worker until its handoff arrives, then its decode worker
    (:meth:`PDClient.placement` hands out copies)."""

    prefill: WorkerLink
    decode: WorkerLink
    blocks: int  # credit held on the decode worker
    on_decode: bool = False
    pieces: bool = False  # some of its pages went to the decode worker already


class Broadcast:
    """The control calls sent to every live worker, each answered once all of them replied: their
    answers combined by the verb's rule (``runtime.fanout.Gather``, keyed by worker rank). The
    caller (``PDClient``) serializes the calls."""

    def __init__(self) -> None:
        self._gathers: dict[int, Gather] = {}  # call id -> the workers' replies so far

    def send(self, cmd: CallCmd, workers: list[WorkerLink]) -> Reply | None:
        """Sends ``cmd`` to every live worker of ``workers``; returns the refusal (nothing sent) of a
        verb prefill/decode disaggregation does not serve (:func:`disaggregation_refusal`)."""
        error = disaggregation_refusal(cmd.name, cmd.until_drained)
        if error is not None:
            return Reply(cmd.call_id, None, error)
        live = [w for w in workers if w.alive]
        names = {w.rank: w.name for w in live}
        self._gathers[cmd.call_id] = Gather(VERBS[cmd.name], list(names), engines="prefill/decode workers",
                                            label=names.__getitem__)
        for w in live:
            w._send(cmd)
        return None

    def reply(self, worker: WorkerLink, reply: Reply) -> Reply | None:
        """A worker's reply: the combined reply once every worker answered the call (``None`` before);
        a reply to anything but a broadcast call is returned as it is."""
        gather = self._gathers.get(reply.id)
        if gather is None:
            return reply
        outcome = gather.reply(worker.rank, reply.result, reply.error)
        if outcome is None:
            return None
        del self._gathers[reply.id]
        return Reply(reply.id, outcome.result, outcome.error)

    def fail(self, worker: WorkerLink, error: BaseException) -> list[Reply]:
        """A dead worker answers every call it still owes with ``error``; returns the calls this completed."""
        replies = [self.reply(worker, Reply(call_id, None, error)) for call_id in list(self._gathers)]
        return [r for r in replies if r is not None]


class PDClient(EngineClient):
    """``AsyncLLM``'s client for prefill/decode disaggregation (see the module docstring)."""

    def __init__(self, engine_args: Any, pool: WorkerPool) -> None:
        """``pool``: where the workers run (``launch.make_worker_pool`` picks it)."""
        super().__init__()
        args = engine_args
        args.validate()
        num_p, num_d = args.prefill_workers, args.decode_workers
        self._pd_lock = threading.RLock()
        self._tags = itertools.count(1)
        self._placed: dict[str, Placement] = {}
        self._queue: deque[AddCmd] = deque()  # adds waiting for decode credit (back-pressure)
        self._add_worker: dict[int, WorkerLink] = {}  # add id -> the prefill worker it went to
        self._add_requests: dict[int, list[str]] = {}
        self._aborted: set[str] = set()
        self.broadcast = Broadcast()  # control calls in flight to every worker
        self.num_pieces = self.num_handoffs = 0  # pieces of pages forwarded, requests handed off
        self.prefill: list[WorkerLink] = []
        self.decode: list[WorkerLink] = []
        self.pool = pool
        try:
            self.transport = transport = resolve_transport(args.kv_transport, self.pool.device,
                                                           self.pool.devices_shared)
            check_transport_device(transport, self.pool.device)
            make_transport(transport, args.kv_transfer_timeout).close()  # a transport that cannot work: fail now
            self.init_method = init_method = self.pool.rendezvous()
            specs = []
            for rank in range(num_p + num_d):
                kind, index = ("prefill", rank) if rank < num_p else ("decode", rank - num_p)
                # NOTE: seeds drawn for seed=None requests differ between prefill workers (as between the
                # requests of one engine); one prefill worker draws exactly what one engine draws
                wargs = dataclasses.replace(args, prefill_workers=0, decode_workers=0, distributed_executor_backend="mp",
                                            seed=args.seed + index, **self.pool.worker_args(args, rank))
                role = WorkerRole(kind, rank, num_p + num_d, init_method, transport, args.kv_transfer_timeout)
                specs.append(WorkerSpec(kind, index, rank, wargs, role))
            workers = self.pool.start(self, specs)
        except BaseException:
            self.pool.release()
            raise
        self.prefill, self.decode = workers[:num_p], workers[num_p:]
        logger.info("prefill/decode: %d prefill + %d decode workers (%s), KV pages over %s, transport group at %s",
                    num_p, num_d, type(self.pool).__name__, transport, init_method)
        first = self.prefill[0].info
        self.info = EngineInfo(first.config, first.model_config, sum(w.info.kv_pages for w in self.workers),
                               first.kv_planes, first.sampling_defaults)
        self._credit = {w.rank: w.info.kv_pages for w in self.decode}
        self.snapshot = self.aggregate()

    @property
    def workers(self) -> list[WorkerLink]:
        return self.prefill + self.decode

    def replicas(self) -> list[WorkerLink]:
        """Every worker, prefill then decode (their index is their rank): /health names the dead ones,
        and the metrics' ``replica`` label is the worker's ("prefill-0", "decode-1")."""
        return self.workers

    # --- the transport of EngineClient ------------------------------------------------------------
    def _send(self, cmd: Command) -> None:
        if isinstance(cmd, AddCmd):
            with self._pd_lock:
                self._queue.append(cmd)
            self._pump()
        elif isinstance(cmd, AbortCmd):
            self._abort(cmd.request_ids)
        elif isinstance(cmd, CallCmd):
            self._broadcast(cmd)
        elif isinstance(cmd, ShutdownCmd):
            for w in self.workers:
                w._send(cmd)

    def is_alive(self) -> bool:
        return any(w.alive and w.is_alive() for w in self.prefill) and any(w.alive and w.is_alive() for w in self.decode)

    def shutdown(self, timeout: float | None) -> None:
        for w in self.workers:  # NOTE: every worker is told first, so their exits (seconds each on a busy host) overlap
            w.stopping = True
            if w.alive:
                w._send(ShutdownCmd())
        for w in self.workers:
            w.shutdown(timeout)
        self.pool.release()

    # --- admission ------------------------------------------------------------------------------
    def _blocks(self, prompt: Any, params: Any) -> int:
        """Pages a request may take on a decode worker (its whole reservation; an upper bound when
        the prompt's length is not known here)."""
        cfg = self.info.config
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        num = len(prompt) if isinstance(prompt, (list, tuple)) else cfg.max_model_len
        tokens = min(cfg.max_model_len, num + (params.max_tokens if params.max_tokens is not None else cfg.max_model_len))
        return self.info.kv_planes * -(-tokens // cfg.block_size)

    def _pump(self) -> None:
        """Sends waiting adds, in order, while decode workers have credit for them."""
        refusals: list[Reply] = []
        with self._pd_lock:
            while self._queue:
                cmd = self._queue[0]
                plan = self._plan(cmd)
                if plan is None:
                    break  # head of line: later adds wait too, so a big one is never starved
                self._queue.popleft()
                if isinstance(plan, Exception):
                    refusals.append(Reply(cmd.add_id, None, plan))
                    continue
                prefill, targets = plan
                self._add_worker[cmd.add_id] = prefill
                self._add_requests[cmd.add_id] = [rid for rid, _, _ in cmd.requests]
                for rid, (decode, blocks) in targets.items():
                    self._credit[decode.rank] -= blocks
                    self._placed[rid] = Placement(prefill, decode, blocks)
                # a request's pieces use tags first, first + 1, ... (fewer than _TAG_STRIDE: one per prompt page at most)
                tags = {rid: (decode.rank, next(self._tags) * _TAG_STRIDE % 2**31) for rid, (decode, _) in targets.items()}
                prefill._send(PrefillCmd(cmd.add_id, cmd.requests, cmd.chat_stop, targets=tags))
        if refusals:
            EngineClient._on_message(self, EngineMessage(replies=refusals, snapshot=self.snapshot))

    def _plan(self, cmd: AddCmd) -> tuple[WorkerLink, dict[str, tuple[WorkerLink, int]]] | Exception | None:
        prefills = [w for w in self.prefill if w.alive]
        decodes = [w for w in self.decode if w.alive]
        if not prefills or not decodes:
            return EngineDeadError("no prefill or no decode worker is left")
        credit = dict(self._credit)
        targets: dict[str, tuple[WorkerLink, int]] = {}
        for rid, prompt, params in cmd.requests:
            if params.n != 1:
                return InvalidRequestError(f"n must be 1 with prefill/decode disaggregation, got {params.n}", param="n")
            if rid in self._placed or rid in targets:
                return InvalidRequestError(f"request_id {rid!r} is already in use", param="request_id")
            blocks = self._blocks(prompt, params)
            if blocks > max(w.info.kv_pages for w in decodes):
                return CapacityError(f"the request needs {blocks} KV blocks but a decode worker's pool has "
                                     f"{max(w.info.kv_pages for w in decodes)}; lower max_tokens", param="max_tokens")
            best = max(decodes, key=lambda w: credit[w.rank])
            if credit[best.rank] < blocks:
                return None
            credit[best.rank] -= blocks
            targets[rid] = (best, blocks)
        load = {w.rank: 0 for w in prefills}
        for p in self._placed.values():
            if not p.on_decode and p.prefill.rank in load:
                load[p.prefill.rank] += 1
        return min(prefills, key=lambda w: load[w.rank]), targets

    def _release(self, rid: str) -> None:
        placed = self._placed.pop(rid, None)
        self._aborted.discard(rid)
        if placed is not None:
            self._credit[placed.decode.rank] += placed.blocks
            if placed.pieces and not placed.on_decode and placed.decode.alive:
                placed.decode._send(DropCmd(rid))  # it ended before its handoff: the pieces there go

    # --- aborts and calls -------------------------------------------------------------------------
    def _abort(self, request_ids: list[str]) -> None:
        dropped: list[Reply] = []
        with self._pd_lock:
            for rid in request_ids:
                for cmd in list(self._queue):  # not sent yet: the whole add goes
                    if any(r == rid for r, _, _ in cmd.requests):
                        self._queue.remove(cmd)
                        dropped.append(Reply(cmd.add_id, None, EngineStateError("the request was aborted")))
                placed = self._placed.get(rid)
                if placed is None:
                    continue
                self._aborted.add(rid)
                (placed.decode if placed.on_decode else placed.prefill)._send(AbortCmd([rid]))
        if dropped:
            EngineClient._on_message(self, EngineMessage(replies=dropped, snapshot=self.snapshot))

    def _broadcast(self, cmd: CallCmd) -> None:
        with self._pd_lock:
            refusal = self.broadcast.send(cmd, self.workers)
        if refusal is not None:
            EngineClient._on_message(self, EngineMessage(replies=[refusal], snapshot=self.snapshot))

    # --- messages from the workers ----------------------------------------------------------------
    def _on_worker_message(self, worker: WorkerLink, msg: EngineMessage) -> None:
        forward: list[tuple[WorkerLink, AcceptCmd]] = []
        with self._pd_lock:
            if not worker.alive:
                return
            worker.snapshot = msg.snapshot
            for item in msg.handoffs:  # pieces first: a release below may drop them again
                placed = self._placed.get(item.request_id) if isinstance(item, PieceMsg) else None
                if placed is not None and placed.prefill is worker and not placed.on_decode:
                    placed.pieces = True
                    placed.decode._send(PieceCmd(item, worker.rank))
                    self.num_pieces += 1
            outputs = [d for d in msg.outputs if self._holds(worker, d.request_id)]
            if msg.dead is not None and not worker.stopping:
                # NOTE: a worker stopped from outside (SIGTERM) aborts what it holds on its way out; nobody asked
                # for those aborts: the requests fail below as a killed worker's do, never as a 200 "abort"
                outputs = [d for d in outputs if not self._aborted_by_shutdown(d)]
            failures = [(rid, e) for rid, e in msg.failures if self._holds(worker, rid)]
            replies = []
            for reply in msg.replies:
                if reply.id in self._add_worker:
                    self._add_worker.pop(reply.id)
                    rids = self._add_requests.pop(reply.id)
                    if reply.error is not None:
                        for rid in rids:
                            self._release(rid)
                gathered = self.broadcast.reply(worker, reply)
                if gathered is not None:
                    replies.append(gathered)
            for delta in outputs:
                if delta.finished:
                    self._release(delta.request_id)
            for rid, _ in failures:
                self._release(rid)
            for h in msg.handoffs:
                if not isinstance(h, HandoffMsg):
                    continue
                placed = self._placed.get(h.handoff.request_id)
                if placed is None or placed.prefill is not worker:
                    continue  # failed meanwhile (its decode worker died): the transfer is dropped
                placed.on_decode = True
                self.num_handoffs += 1
                forward.append((placed.decode, AcceptCmd(h.handoff, h.num_pieces, worker.rank)))
            dead = None
            if msg.dead is not None:
                failures += self._worker_died(worker, msg.dead, replies)
                if not self.is_alive():
                    dead = EngineDeadError(f"the {worker.name} stopped and no {worker.kind} worker is left: {msg.dead}")
            snapshot = self.aggregate()
        steps = [dataclasses.replace(r, replica=worker.rank) for r in msg.steps]  # (replicas()[rank] is the worker)
        EngineClient._on_message(self, EngineMessage(outputs=outputs, failures=failures, replies=replies,
                                                     steps=steps, snapshot=snapshot, dead=dead))
        if forward:
            # NOTE: after the first token was routed: the decode worker's deltas come after it
            with self._pd_lock:
                for decode, accept in forward:
                    rid = accept.handoff.request_id
                    if rid not in self._placed:  # failed while its first token was routed
                        continue
                    accept.aborted = rid in self._aborted
                    decode._send(accept)
        self._pump()

    def _aborted_by_shutdown(self, delta: Any) -> bool:
        """Whether a dying worker's output ends its request with an abort the client did not ask for."""
        return delta.request_id not in self._aborted and ended_by_abort(delta)

    def _holds(self, worker: WorkerLink, rid: str) -> bool:
        placed = self._placed.get(rid)
        return placed is not None and (placed.decode if placed.on_decode else placed.prefill) is worker

    def _worker_died(self, worker: WorkerLink, error: BaseException, replies: list[Reply]) -> list[tuple[str, BaseException]]:
        """Fails what the dead worker held: its requests (a decode worker's also while still
        prefilling for it: they are aborted there), its adds and its part of broadcast calls."""
        worker.alive = False
        if not self.stopping:
            logger.error("the %s stopped (%s): failing its requests; the other workers go on", worker.name, error)
        failure = EngineDeadError(f"the {worker.name} serving this request stopped")
        failures = []
        for rid, placed in list(self._placed.items()):
            here = placed.decode if placed.on_decode else placed.prefill
            if here is worker or placed.decode is worker:
                if here is not worker:
                    here._send(AbortCmd([rid]))
                failures.append((rid, failure))
                self._release(rid)
        for add_id, w in list(self._add_worker.items()):
            if w is worker:
                del self._add_worker[add_id]
                for rid in self._add_requests.pop(add_id):
                    self._release(rid)
                replies.append(Reply(add_id, None, failure))
        replies += self.broadcast.fail(worker, failure)
        return failures

    def aggregate(self) -> EngineSnapshot:
        """The live workers' gauges as one (``EngineSnapshot.total``). The prefix-cache counters are the
        prefill workers' alone: a decode worker looks the same prompt up again to share its pages, which
        saves memory but no prompt computation, and counting both would count every prompt twice. (The
        client's ``snapshot`` is this, as of the last worker message.)"""
        live = [w for w in self.workers if w.alive]
        total = EngineSnapshot.total([w.snapshot for w in live])
        prefill = [w.snapshot for w in live if w.kind == "prefill"]
        return dataclasses.replace(total, prefix_cache_queries=sum(s.prefix_cache_queries for s in prefill),
                                   prefix_cache_hits=sum(s.prefix_cache_hits for s in prefill))

    @property
    def worker_snapshots(self) -> dict[str, EngineSnapshot]:
        """Each worker's own gauges (KV pages in use per side: tests, /metrics)."""
        return {w.name: w.snapshot for w in self.workers}

    def placement(self, request_id: str) -> Placement | None:
        """Where an admitted request is now, as a copy (``None`` while it waits for credit and once it
        ended): its prefill and decode workers, whether pages went ahead and whether it was handed off."""
        with self._pd_lock:
            placed = self._placed.get(request_id)
            return dataclasses.replace(placed) if placed is not None else None

    @property
    def num_queued(self) -> int:
        """Adds waiting in the front end until a decode worker has credit for them (back-pressure)."""
        with self._pd_lock:
            return len(self._queue)

    @property
    def decode_credit(self) -> dict[int, int]:
        """Each decode worker's credit (rank -> KV pages of its pool not reserved for a request placed on it)."""
        with self._pd_lock:
            return dict(self._credit)
