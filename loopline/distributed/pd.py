"""Prefill/decode disaggregation: prefill workers and decode workers as engines of their own.

``loopline serve --prefill-workers P --decode-workers D`` (``EngineArgs.prefill_workers`` /
``decode_workers``) gives ``AsyncLLM`` a :class:`PDClient` instead of the one-process client.
Each worker is an engine whose loop is a :class:`PrefillCore` or a :class:`DecodeCore`; a
:class:`WorkerPool` runs them: engine processes on this host (:class:`ProcessWorkerPool`,
``core_client.MPClient`` machinery, ``spawn``), or Ray actors in a placement group, one bundle
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
   (``LLMEngine.hand_off``: a copy of its prompt's KV pages of every plane -- all R for
   ``last_exited``, the one for ``shared`` -- and its slot's decode state), frees its pages at
   once, starts the transport's send on its own thread and reports the handoff; the front end
   forwards it to the decode worker, which resumes the request exactly as a preempted one
   (``LLMEngine.adopt``) once its pages are in. Its text and logprob deltas continue the prefill
   worker's in the same client stream.

   The decode worker reserves the request's prompt pages (every plane the layout keeps) in its
   own KV pool, through its KV manager, when the first piece arrives (``LLMEngine.reserve_handoff``;
   the front end's credit guarantees the room), and writes every piece straight into them as it
   is received (``LLMEngine.write_handoff_pages``: gloo's CPU tensor copied into the pages; on CUDA
   a copy on a stream of its own that the step resuming the request waits for). Adoption then
   copies nothing. A request that is dropped, fails or cannot be reserved frees its pages at once.

Failures: a failed or timed-out transfer fails its request (clean error, an error id in the
log); a dead worker fails only the requests it held (and, for a decode worker, those still
prefilling for it); the others continue, and the client is dead only when no prefill or no
decode worker is left. Aborts reach whichever worker holds the request, also mid-transfer.
``n > 1`` is refused (one completion per request); the RL control calls other than
``reset_prefix_cache`` / ``abort_all`` and the read-only ones are refused too.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import socket
import threading
from collections import deque
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from loopline.core.request import RequestStatus
from loopline.engine import LLMEngine
from loopline.engine.handoff import Handoff
from loopline.engine.input_processor import parent_request_id
from loopline.entrypoints.core_client import EngineClient, MPClient
from loopline.entrypoints.engine_core import (AbortCmd, AddCmd, CallCmd, Command, EngineCore, EngineInfo,
                                              EngineMessage, EngineSnapshot, Inbox, Reply, ShutdownCmd)
from loopline.errors import (CapacityError, EngineDeadError, EngineInternalError, EngineStateError, InvalidRequestError,
                             LooplineError, new_error_id)
from loopline.distributed.kv_transfer import (KVTransport, check_transport_device, make_transport,
                                              resolve_transport)

logger = logging.getLogger("loopline.pd")

_TAG_STRIDE = 2**16

__all__ = ["PDClient", "PrefillCore", "DecodeCore", "WorkerRole", "WorkerPool", "ProcessWorkerPool"]

# Calls the front end sends to every worker, and how their results combine.
_BROADCAST = {
    "reset_prefix_cache": lambda rs: None,
    "abort_all": lambda rs: sorted({rid for r in rs for rid in r}),
    "get_weight_version": lambda rs: rs[0],
    "is_paused": any,
    "is_sleeping": any,
}


# --- what crosses the pipes ------------------------------------------------------------------
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


# --- the worker processes --------------------------------------------------------------------
@dataclass
class WorkerRole:
    """How ``run_engine_process`` builds a prefill or decode worker (picklable: it crosses ``spawn``)."""

    kind: str  # "prefill" | "decode"
    rank: int  # in the transport group: prefill workers first, then decode workers
    world_size: int
    init_method: str
    transport: str
    timeout_s: float

    def build_engine(self, engine_args: Any) -> LLMEngine:
        # NOTE: the transport is made here, before the engine reports that it started, so that
        # a transport that cannot work (nixl missing) is the start's error, not a dead worker.
        self._transport = make_transport(self.transport, self.timeout_s)
        return LLMEngine(engine_args, prefill_only=self.kind == "prefill")

    def make_core(self, engine: LLMEngine, inbox: Inbox, emit) -> EngineCore:
        self._transport.start(self.rank, self.world_size, self.init_method, engine.config.device)
        cls = PrefillCore if self.kind == "prefill" else DecodeCore
        return cls(engine, inbox, emit, self._transport)


class PrefillCore(EngineCore):
    """The loop of a prefill worker: after every step, the prompt pages that became final are sent
    to the request's decode worker (``PieceMsg``) while the next chunks compute; a request leaves
    after its first token with the rest (``HandoffMsg``)."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit, transport: KVTransport) -> None:
        super().__init__(engine, inbox, emit)
        self.transport = transport
        self._targets: dict[str, tuple[int, int]] = {}  # request id -> (decode rank, first tag)
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (pages sent, pieces sent)

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, PrefillCmd):
            self._targets.update(cmd.targets)
        super()._apply(cmd)

    def _step(self) -> bool:
        progressed = super()._step()
        for child, pages in self.engine.final_prompt_pages().items():
            rid = parent_request_id(child)
            if rid not in self._targets:
                continue
            try:
                sent, _ = self._sent.get(rid, (0, 0))
                req = self.engine.scheduler.requests[child]
                if pages > sent and req.status == RequestStatus.PREFILL:
                    self._send_piece(rid, PageReservation(child, req.prompt_token_ids),
                                     self.engine.export_pages(child, sent, pages), sent, pages)
            except Exception as e:  # this request fails; the others go on
                self._fail(rid, e)
        for child in self.engine.ready_handoffs():
            progressed = True
            self._hand_off(child)
        if len(self._targets) > len(self._live):  # requests that finished or failed here
            self._targets = {rid: t for rid, t in self._targets.items() if rid in self._live}
            self._sent = {rid: t for rid, t in self._sent.items() if rid in self._live}
        return progressed

    def _send_piece(self, rid: str, reservation: PageReservation, kv: torch.Tensor, first: int, end: int) -> None:
        rank, tag0 = self._targets[rid]
        _, count = self._sent.get(rid, (0, 0))
        tag = tag0 + count
        payload, sent = self.transport.send(kv, rank, tag)
        sent.add_done_callback(lambda f: f.exception() is not None and logger.error(
            "request %s: sending KV pages to worker %d failed: %s", rid, rank, f.exception()))
        self._sent[rid] = (end, count + 1)
        self._msg.handoffs.append(PieceMsg(rid, tag, payload, tuple(kv.shape), kv.dtype, first,
                                           reservation if count == 0 else None))

    def _hand_off(self, child: str) -> None:
        rid = parent_request_id(child)
        try:
            sent, _ = self._sent.get(rid, (0, 0))
            handoff, rest = self.engine.hand_off(child, sent)
            if rest.shape[2]:
                self._send_piece(rid, PageReservation(child, handoff.prompt_token_ids), rest, sent,
                                 sent + rest.shape[2] // self.engine.kv.layout.num_planes)
            self._msg.handoffs.append(HandoffMsg(handoff, self._sent.get(rid, (0, 0))[1]))
        except Exception as e:
            self._fail(rid, e)
        self._targets.pop(rid, None)
        self._sent.pop(rid, None)
        self._live.discard(rid)
        self._encoder.drop(rid)

    def _fail(self, rid: str, error: Exception) -> None:
        error_id = new_error_id()
        logger.error("request %s: handing it to a decode worker failed (error id %s)", rid, error_id, exc_info=error)
        self.engine.abort_request(rid)
        self._live.discard(rid)
        self._encoder.drop(rid)
        self._targets.pop(rid, None)
        self._sent.pop(rid, None)
        self._msg.failures.append((rid, EngineInternalError(
            f"internal error while handing the request to a decode worker (error id {error_id})", error_id)))


@dataclass
class _Incoming:
    """A decode worker's view of a request on its way: its reserved pages, its pieces and, once sent,
    its handoff."""

    child_id: str | None = None  # set once its pages are reserved in the engine
    outstanding: int = 0  # receives not finished
    received: int = 0
    accept: AcceptCmd | None = None
    error: BaseException | None = None
    aborted: bool = False
    dropped: bool = False


class DecodeCore(EngineCore):
    """The loop of a decode worker: a request's prompt pages are reserved in the engine's KV pool when
    its first piece arrives (``PieceCmd``); the pieces are received on the transport's threads while
    the loop steps, and each is written straight into its reserved pages; the request resumes once its
    handoff (``AcceptCmd``) and all its pieces are in, with nothing left to copy."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit, transport: KVTransport) -> None:
        super().__init__(engine, inbox, emit)
        self.transport = transport
        self._incoming: dict[str, _Incoming] = {}

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, PieceCmd):
            self._receive(cmd)
        elif isinstance(cmd, PieceDoneCmd):
            self._piece_done(cmd)
        elif isinstance(cmd, AcceptCmd):
            inc = self._incoming.setdefault(cmd.handoff.request_id, _Incoming())
            inc.accept, inc.aborted = cmd, inc.aborted or cmd.aborted
            self._maybe_adopt(cmd.handoff.request_id)
        elif isinstance(cmd, DropCmd):
            if cmd.request_id in self._incoming:
                inc = self._incoming[cmd.request_id]
                inc.dropped = True
                self._release(inc)  # at once: receives still on their way (a dead sender's) write nothing
                self._maybe_adopt(cmd.request_id)
        else:
            if isinstance(cmd, AbortCmd):
                for rid in cmd.request_ids:
                    if rid in self._incoming:
                        self._incoming[rid].aborted = True
            super()._apply(cmd)

    def _receive(self, cmd: PieceCmd) -> None:
        piece = cmd.piece
        inc = self._incoming.setdefault(piece.request_id, _Incoming())
        if piece.reservation is not None and inc.child_id is None and inc.error is None:
            try:
                self.engine.reserve_handoff(piece.reservation.child_id, piece.reservation.prompt_token_ids)
                inc.child_id = piece.reservation.child_id
            except Exception as e:  # the request fails at its handoff; its pieces are still received
                inc.error = e  # (so that the sender's transfers complete), and dropped
        inc.outstanding += 1
        future = self.transport.recv(piece.payload, piece.shape, piece.dtype, cmd.src_rank, piece.tag)
        future.add_done_callback(lambda f, rid=piece.request_id, first=piece.first_page:
                                 self.inbox.put(PieceDoneCmd(rid, f, first)))

    def _piece_done(self, cmd: PieceDoneCmd) -> None:
        inc = self._incoming.get(cmd.request_id)
        if inc is None:
            return
        inc.outstanding -= 1
        try:
            kv = cmd.future.result()
            if inc.error is None and not (inc.dropped or inc.aborted):  # (else its pages are not read)
                if inc.child_id is None:
                    raise EngineStateError(f"pages of request {cmd.request_id!r} arrived before its reservation")
                self.engine.write_handoff_pages(inc.child_id, cmd.first_page, kv)
            inc.received += 1
        except Exception as e:
            inc.error = inc.error or e
            self._release(inc)  # it will fail at its handoff: its pages go now
        self._maybe_adopt(cmd.request_id)

    def _maybe_adopt(self, rid: str) -> None:
        """Adopts (or fails, or forgets) a request once nothing of it is still on its way; whatever
        does not end adopted frees its reserved pages."""
        inc = self._incoming[rid]
        if inc.outstanding:
            return
        if inc.dropped:
            self._forget(rid)
            return
        accept = inc.accept
        if accept is None:
            return  # more pieces, and the handoff, are coming
        if inc.error is None and inc.received < accept.num_pieces:
            return
        try:
            if inc.error is not None:
                raise inc.error
            text = self.engine.adopt(accept.handoff)
            del self._incoming[rid]
        except Exception as e:  # a failed transfer (or a refusal): this request fails alone
            self._forget(rid)
            if isinstance(e, LooplineError):
                failure: Exception = e
            else:
                error_id = new_error_id()
                logger.error("request %s: receiving it from worker %d failed (error id %s): %s", rid, accept.src_rank,
                             error_id, e)
                failure = EngineInternalError(f"the KV transfer of the request failed (error id {error_id}); "
                                              "it was aborted", error_id)
            self._msg.failures.append((rid, failure))
            return
        self._live.add(rid)
        self._encoder.seed(rid, 1, text)
        if inc.aborted:
            self.engine.abort_request(rid)

    def _forget(self, rid: str) -> None:
        self._release(self._incoming.pop(rid))

    def _release(self, inc: _Incoming) -> None:
        """Frees a request's reserved pages (it will not be adopted); later pieces are not written."""
        if inc.child_id is not None:
            self.engine.release_handoff(inc.child_id)
            inc.child_id = None


# --- the front end ---------------------------------------------------------------------------
@dataclass
class WorkerSpec:
    """One worker a :class:`WorkerPool` starts: its kind, index among its kind, rank in the
    transport group, engine arguments and role."""

    kind: str
    index: int
    rank: int
    engine_args: Any
    role: WorkerRole


class WorkerLink:
    """What :class:`PDClient` needs of a worker's client, whatever runs the worker (a mixin over an
    engine client: an engine process's, a Ray actor's): its place in the pool, and its messages
    going to the ``PDClient``."""

    owner: "PDClient"
    kind: str
    index: int
    rank: int
    alive: bool

    def _link(self, owner: "PDClient", spec: WorkerSpec) -> None:
        # NOTE: before the engine client starts: its reader may deliver a message at once
        self.owner, self.kind, self.index, self.rank = owner, spec.kind, spec.index, spec.rank
        self.alive = True

    @property
    def name(self) -> str:
        return f"{self.kind} worker {self.index}"

    @property
    def label(self) -> str:
        return f"{self.kind}-{self.index}"

    def is_alive(self) -> bool:
        return self.alive and super().is_alive()

    def _on_message(self, msg: EngineMessage) -> None:
        self.owner._on_worker_message(self, msg)


class _Worker(WorkerLink, MPClient):
    """One worker process; its messages go to the :class:`PDClient`."""

    def __init__(self, owner: "PDClient", spec: WorkerSpec) -> None:
        self._link(owner, spec)
        MPClient.__init__(self, spec.engine_args, spec.role)


class WorkerPool(ABC):
    """Where a :class:`PDClient`'s workers run: engine processes on this host
    (:class:`ProcessWorkerPool`) or Ray actors in a placement group (``ray_backend.RayWorkerPool``)."""

    #: what the workers compute on (its type picks the KV transport) and whether they all share one GPU
    device: torch.device
    devices_shared: bool

    @abstractmethod
    def rendezvous(self) -> str:
        """The ``tcp://host:port`` where the KV transport group meets (rank 0 listens there)."""

    @abstractmethod
    def worker_args(self, args: Any, rank: int) -> dict[str, Any]:
        """The engine arguments worker ``rank``'s engine gets instead of the front end's (its device...)."""

    @abstractmethod
    def start(self, owner: "PDClient", specs: list[WorkerSpec]) -> list[WorkerLink]:
        """Starts every worker and returns their clients, in order; if one fails, the started ones
        are stopped and its error is raised."""

    def release(self) -> None:
        """Frees what the pool holds once every worker stopped (nothing for processes)."""


class ProcessWorkerPool(WorkerPool):
    """Workers as engine processes on this host: one GPU each where there are enough, else all on
    the front end's device (and the transport group on the loopback interface)."""

    def __init__(self, args: Any) -> None:
        from loopline.config import resolve_device
        self.device = resolve_device(args.device)
        self.devices = _worker_devices(self.device, args.prefill_workers + args.decode_workers)
        self.devices_shared = len(set(self.devices)) == 1

    def rendezvous(self) -> str:
        return f"tcp://127.0.0.1:{_free_port()}"

    def worker_args(self, args: Any, rank: int) -> dict[str, Any]:
        dev, util = self.devices[rank], args.gpu_memory_utilization
        if dev.type == "cuda":  # NOTE: workers start one after another on a shared device: each
            # one's pool is sized from what the earlier ones left (cumulative fractions)
            util *= self.devices[:rank + 1].count(dev) / self.devices.count(dev)
        return dict(device=str(dev), gpu_memory_utilization=util)

    def start(self, owner: "PDClient", specs: list[WorkerSpec]) -> list[WorkerLink]:
        workers: list[WorkerLink] = []
        try:
            for spec in specs:  # one after another: see worker_args
                workers.append(_Worker(owner, spec))
        except BaseException:
            for w in workers:
                w.stopping = True
                w.shutdown(5)
            raise
        return workers


def make_worker_pool(args: Any) -> WorkerPool:
    """The pool ``args.distributed_executor_backend`` asks for (``ray`` imports Ray, only then)."""
    if args.distributed_executor_backend == "ray":
        from loopline.distributed.ray_backend import RayWorkerPool
        return RayWorkerPool(args)
    return ProcessWorkerPool(args)


@dataclass
class _Placement:
    """Where a request is: its prefill worker until its handoff arrives, then its decode worker."""

    prefill: WorkerLink
    decode: WorkerLink
    blocks: int  # credit held on the decode worker
    on_decode: bool = False
    pieces: bool = False  # some of its pages went to the decode worker already


class PDClient(EngineClient):
    """``AsyncLLM``'s client for prefill/decode disaggregation (see the module docstring)."""

    def __init__(self, engine_args: Any, pool: WorkerPool | None = None) -> None:
        """``pool``: where the workers run (default: what ``distributed_executor_backend`` names)."""
        super().__init__()
        args = engine_args
        args.validate()
        num_p, num_d = args.prefill_workers, args.decode_workers
        self._pd_lock = threading.RLock()
        self._tags = itertools.count(1)
        self._placed: dict[str, _Placement] = {}
        self._queue: deque[AddCmd] = deque()  # adds waiting for decode credit (back-pressure)
        self._add_worker: dict[int, WorkerLink] = {}  # add id -> the prefill worker it went to
        self._add_requests: dict[int, list[str]] = {}
        self._aborted: set[str] = set()
        self._bcast: dict[int, list] = {}  # call id -> [name, workers left, results, error]
        self.num_pieces = self.num_handoffs = 0  # pieces of pages forwarded, requests handed off
        self.prefill: list[WorkerLink] = []
        self.decode: list[WorkerLink] = []
        self.pool = pool or make_worker_pool(args)
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
        self.snapshot = self._aggregate()

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
        for w in self.workers:
            w.stopping = True
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
                    self._placed[rid] = _Placement(prefill, decode, blocks)
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
        if cmd.name not in _BROADCAST or cmd.until_drained:
            error = EngineStateError(f"{cmd.name} is not supported with prefill/decode disaggregation")
            EngineClient._on_message(self, EngineMessage(replies=[Reply(cmd.call_id, None, error)],
                                                         snapshot=self.snapshot))
            return
        with self._pd_lock:
            live = [w for w in self.workers if w.alive]
            self._bcast[cmd.call_id] = [cmd.name, {w.rank for w in live}, [], None]
            for w in live:
                w._send(cmd)

    def _gather_reply(self, worker: WorkerLink, reply: Reply) -> Reply | None:
        """A worker's reply to a broadcast call; the combined reply once every worker answered."""
        entry = self._bcast.get(reply.id)
        if entry is None:
            return reply
        name, left, results, error = entry
        left.discard(worker.rank)
        if reply.error is not None:
            entry[3] = error or reply.error
        else:
            results.append(reply.result)
        if left:
            return None
        del self._bcast[reply.id]
        return Reply(reply.id, None, entry[3]) if entry[3] is not None else Reply(reply.id, _BROADCAST[name](results))

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
            failures = [(rid, e) for rid, e in msg.failures if self._holds(worker, rid)]
            replies = []
            for reply in msg.replies:
                if reply.id in self._add_worker:
                    self._add_worker.pop(reply.id)
                    rids = self._add_requests.pop(reply.id)
                    if reply.error is not None:
                        for rid in rids:
                            self._release(rid)
                gathered = self._gather_reply(worker, reply)
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
            snapshot = self._aggregate()
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
        for call_id in list(self._bcast):
            gathered = self._gather_reply(worker, Reply(call_id, None, failure))
            if gathered is not None:
                replies.append(gathered)
        return failures

    def _aggregate(self) -> EngineSnapshot:
        """The live workers' gauges as one (``EngineSnapshot.total``). The prefix-cache counters are the
        prefill workers' alone: a decode worker looks the same prompt up again to share its pages, which
        saves memory but no prompt computation, and counting both would count every prompt twice."""
        live = [w for w in self.workers if w.alive]
        total = EngineSnapshot.total([w.snapshot for w in live])
        prefill = [w.snapshot for w in live if w.kind == "prefill"]
        return dataclasses.replace(total, prefix_cache_queries=sum(s.prefix_cache_queries for s in prefill),
                                   prefix_cache_hits=sum(s.prefix_cache_hits for s in prefill))

    @property
    def worker_snapshots(self) -> dict[str, EngineSnapshot]:
        """Each worker's own gauges (KV pages in use per side: tests, /metrics)."""
        return {w.name: w.snapshot for w in self.workers}


def _worker_devices(device: torch.device, count: int) -> list[torch.device]:
    """One device per worker where there are enough GPUs, else every worker on ``device``."""
    if device.type == "cuda" and torch.cuda.device_count() >= count and device.index in (None, 0):
        return [torch.device("cuda", i) for i in range(count)]
    return [device] * count


def _free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host``'s interface ("": every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
