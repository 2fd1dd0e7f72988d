"""Prefill/decode disaggregation: prefill workers and decode workers as engine processes of their own.

``loopline serve --prefill-workers P --decode-workers D`` (``EngineArgs.prefill_workers`` /
``decode_workers``) gives ``AsyncLLM`` a :class:`PDClient` instead of the one-process client.
Each worker is an engine process (``core_client.MPClient`` machinery, ``spawn``) whose loop is a
:class:`PrefillCore` or a :class:`DecodeCore`. A request's life:

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
   forwards it to the decode worker, which receives the pages and resumes the request exactly
   as a preempted one (``LLMEngine.adopt``). Its text and logprob deltas continue the prefill
   worker's in the same client stream.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from loopline.engine import LLMEngine
from loopline.engine.handoff import Handoff
from loopline.engine.input_processor import parent_request_id
from loopline.entrypoints.core_client import EngineClient, MPClient
from loopline.entrypoints.engine_core import (AbortCmd, AddCmd, CallCmd, Command, EngineCore, EngineInfo,
                                              EngineMessage, EngineSnapshot, Inbox, Reply, ShutdownCmd)
from loopline.errors import (CapacityError, EngineDeadError, EngineInternalError, EngineStateError, InvalidRequestError,
                             LooplineError, new_error_id)
from loopline.distributed.kv_transfer import KVTransport, make_transport, resolve_transport

logger = logging.getLogger("loopline.pd")

__all__ = ["PDClient", "PrefillCore", "DecodeCore", "WorkerRole"]

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
class AcceptCmd:
    """A decode worker receives a handed-off request (``aborted``: the client aborted it meanwhile:
    receive its pages, then end it as aborted)."""

    handoff: Handoff
    payload: Any
    src_rank: int
    tag: int
    aborted: bool = False


@dataclass
class TransferDoneCmd:
    """Inside a decode worker: a receive finished (the transport's thread wakes the loop)."""

    request_id: str


@dataclass
class HandoffMsg:
    """A prefill worker's request leaving it (in ``EngineMessage.handoffs``)."""

    handoff: Handoff
    payload: Any
    tag: int
    decode_rank: int


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
    """The loop of a prefill worker: a request leaves after its first token (``HandoffMsg``)."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit, transport: KVTransport) -> None:
        super().__init__(engine, inbox, emit)
        self.transport = transport
        self._targets: dict[str, tuple[int, int]] = {}

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, PrefillCmd):
            self._targets.update(cmd.targets)
        super()._apply(cmd)

    def _step(self) -> bool:
        progressed = super()._step()
        for child in self.engine.ready_handoffs():
            progressed = True
            self._hand_off(child)
        if len(self._targets) > len(self._live):  # requests that finished or failed here
            self._targets = {rid: t for rid, t in self._targets.items() if rid in self._live}
        return progressed

    def _hand_off(self, child: str) -> None:
        rid = parent_request_id(child)
        rank, tag = self._targets.pop(rid)
        try:
            handoff, kv = self.engine.hand_off(child)
            payload, sent = self.transport.send(kv, rank, tag)
        except Exception as e:  # this request fails; the others go on
            error_id = new_error_id()
            logger.exception("request %s: the handoff failed (error id %s)", rid, error_id)
            self.engine.abort_request(rid)
            self._msg.failures.append((rid, EngineInternalError(
                f"internal error while handing the request to a decode worker (error id {error_id})", error_id)))
        else:
            sent.add_done_callback(lambda f: f.exception() is not None and logger.error(
                "request %s: sending its KV pages to worker %d failed: %s", rid, rank, f.exception()))
            self._msg.handoffs.append(HandoffMsg(handoff, payload, tag, rank))
        self._live.discard(rid)
        self._encoder.drop(rid)


class DecodeCore(EngineCore):
    """The loop of a decode worker: handed-off requests arrive (``AcceptCmd``), their pages are
    received on the transport's threads while the loop steps, and they resume once complete."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit, transport: KVTransport) -> None:
        super().__init__(engine, inbox, emit)
        self.transport = transport
        self._pending: dict[str, tuple[AcceptCmd, concurrent.futures.Future]] = {}
        self._aborted: set[str] = set()  # pending requests the client aborted

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, AcceptCmd):
            self._accept(cmd)
        elif isinstance(cmd, TransferDoneCmd):
            self._adopt(cmd.request_id)
        else:
            if isinstance(cmd, AbortCmd):
                self._aborted.update(rid for rid in cmd.request_ids if rid in self._pending)
            super()._apply(cmd)

    def _accept(self, cmd: AcceptCmd) -> None:
        h = cmd.handoff
        future = self.transport.recv(cmd.payload, h.kv_shape, h.kv_dtype, cmd.src_rank, cmd.tag)
        self._pending[h.request_id] = (cmd, future)
        if cmd.aborted:
            self._aborted.add(h.request_id)
        future.add_done_callback(lambda _f, rid=h.request_id: self.inbox.put(TransferDoneCmd(rid)))

    def _adopt(self, rid: str) -> None:
        cmd, future = self._pending.pop(rid)
        aborted = rid in self._aborted
        self._aborted.discard(rid)
        try:
            text = self.engine.adopt(cmd.handoff, future.result())
        except Exception as e:  # a failed transfer (or a refusal): this request fails alone
            if isinstance(e, LooplineError):
                failure: Exception = e
            else:
                error_id = new_error_id()
                logger.error("request %s: receiving it from worker %d failed (error id %s): %s", rid, cmd.src_rank,
                             error_id, e)
                failure = EngineInternalError(f"the KV transfer of the request failed (error id {error_id}); "
                                              "it was aborted", error_id)
            self._msg.failures.append((rid, failure))
            return
        self._live.add(rid)
        self._encoder.seed(rid, 1, text)
        if aborted:
            self.engine.abort_request(rid)

    @property
    def num_pending(self) -> int:
        return len(self._pending)


# --- the front end ---------------------------------------------------------------------------
class _Worker(MPClient):
    """One worker process; its messages go to the :class:`PDClient`."""

    def __init__(self, owner: "PDClient", kind: str, index: int, rank: int, engine_args: Any, role: WorkerRole) -> None:
        self.owner, self.kind, self.index, self.rank = owner, kind, index, rank
        self.alive = True
        super().__init__(engine_args, role)

    @property
    def name(self) -> str:
        return f"{self.kind} worker {self.index}"

    def _on_message(self, msg: EngineMessage) -> None:
        self.owner._on_worker_message(self, msg)


@dataclass
class _Placement:
    """Where a request is: its prefill worker until its handoff arrives, then its decode worker."""

    prefill: _Worker
    decode: _Worker
    blocks: int  # credit held on the decode worker
    on_decode: bool = False


class PDClient(EngineClient):
    """``AsyncLLM``'s client for prefill/decode disaggregation (see the module docstring)."""

    def __init__(self, engine_args: Any) -> None:
        super().__init__()
        args = engine_args
        args.validate()
        from loopline.config import resolve_device
        device = resolve_device(args.device)
        num_p, num_d = args.prefill_workers, args.decode_workers
        devices = _worker_devices(device, num_p + num_d)
        shared = len(set(devices)) == 1
        transport = resolve_transport(args.kv_transport, device, shared)
        make_transport(transport, args.kv_transfer_timeout).close()  # a transport that cannot work: fail now
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.transport = transport
        self._pd_lock = threading.RLock()
        self._tags = itertools.count(1)
        self._placed: dict[str, _Placement] = {}
        self._queue: deque[AddCmd] = deque()  # adds waiting for decode credit (back-pressure)
        self._add_worker: dict[int, _Worker] = {}  # add id -> the prefill worker it went to
        self._add_requests: dict[int, list[str]] = {}
        self._aborted: set[str] = set()
        self._bcast: dict[int, list] = {}  # call id -> [name, workers left, results, error]
        self.prefill: list[_Worker] = []
        self.decode: list[_Worker] = []
        try:
            for i, dev in enumerate(devices):
                kind, index = ("prefill", i) if i < num_p else ("decode", i - num_p)
                util = args.gpu_memory_utilization
                if dev.type == "cuda":  # NOTE: workers start one after another on a shared device: each
                    # one's pool is sized from what the earlier ones left (cumulative fractions)
                    util *= (devices[:i + 1].count(dev)) / devices.count(dev)
                wargs = dataclasses.replace(args, prefill_workers=0, decode_workers=0, device=str(dev),
                                            gpu_memory_utilization=util)
                role = WorkerRole(kind, i, num_p + num_d, init_method, transport, args.kv_transfer_timeout)
                worker = _Worker(self, kind, index, i, wargs, role)
                (self.prefill if kind == "prefill" else self.decode).append(worker)
        except BaseException:
            self.shutdown(5)
            raise
        first = self.prefill[0].info
        self.info = EngineInfo(first.config, first.model_config, sum(w.info.kv_pages for w in self.workers),
                               first.kv_planes)
        self._credit = {w.rank: w.info.kv_pages for w in self.decode}
        self.snapshot = self._aggregate()

    @property
    def workers(self) -> list[_Worker]:
        return self.prefill + self.decode

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
                tags = {rid: (decode.rank, next(self._tags) % 2**31) for rid, (decode, _) in targets.items()}
                prefill._send(PrefillCmd(cmd.add_id, cmd.requests, cmd.chat_stop, targets=tags))
        if refusals:
            EngineClient._on_message(self, EngineMessage(replies=refusals, snapshot=self.snapshot))

    def _plan(self, cmd: AddCmd) -> tuple[_Worker, dict[str, tuple[_Worker, int]]] | Exception | None:
        prefills = [w for w in self.prefill if w.alive]
        decodes = [w for w in self.decode if w.alive]
        if not prefills or not decodes:
            return EngineDeadError("no prefill or no decode worker is left")
        credit = dict(self._credit)
        targets: dict[str, tuple[_Worker, int]] = {}
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

    def _gather_reply(self, worker: _Worker, reply: Reply) -> Reply | None:
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
    def _on_worker_message(self, worker: _Worker, msg: EngineMessage) -> None:
        forward: list[tuple[_Worker, AcceptCmd]] = []
        with self._pd_lock:
            if not worker.alive:
                return
            worker.snapshot = msg.snapshot
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
                placed = self._placed.get(h.handoff.request_id)
                if placed is None or placed.prefill is not worker:
                    continue  # failed meanwhile (its decode worker died): the transfer is dropped
                placed.on_decode = True
                forward.append((placed.decode, AcceptCmd(h.handoff, h.payload, worker.rank, h.tag)))
            dead = None
            if msg.dead is not None:
                failures += self._worker_died(worker, msg.dead, replies)
                if not self.is_alive():
                    dead = EngineDeadError(f"the {worker.name} stopped and no {worker.kind} worker is left: {msg.dead}")
            snapshot = self._aggregate()
        EngineClient._on_message(self, EngineMessage(outputs=outputs, failures=failures, replies=replies,
                                                     steps=msg.steps, snapshot=snapshot, dead=dead))
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

    def _holds(self, worker: _Worker, rid: str) -> bool:
        placed = self._placed.get(rid)
        return placed is not None and (placed.decode if placed.on_decode else placed.prefill) is worker

    def _worker_died(self, worker: _Worker, error: BaseException, replies: list[Reply]) -> list[tuple[str, BaseException]]:
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
        """The workers' gauges summed (flags: any of them)."""
        snaps = [w.snapshot for w in self.workers if w.alive]
        if not snaps:
            return EngineSnapshot()
        values = {}
        for f in dataclasses.fields(EngineSnapshot):
            vals = [getattr(s, f.name) for s in snaps]
            if isinstance(vals[0], bool):
                values[f.name] = any(vals)
            elif isinstance(vals[0], int):
                values[f.name] = sum(vals)
            else:
                values[f.name] = next((v for v in vals if v != "committed"), vals[0])
        return EngineSnapshot(**values)

    @property
    def worker_snapshots(self) -> dict[str, EngineSnapshot]:
        """Each worker's own gauges (KV pages in use per side: tests, /metrics)."""
        return {w.name: w.snapshot for w in self.workers}


def _worker_devices(device: torch.device, count: int) -> list[torch.device]:
    """One device per worker where there are enough GPUs, else every worker on ``device``."""
    if device.type == "cuda" and torch.cuda.device_count() >= count and device.index in (None, 0):
        return [torch.device("cuda", i) for i in range(count)]
    return [device] * count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
