"""How ``AsyncLLM`` reaches its :class:`EngineCore`: on a thread, or in an engine process of its own.

:class:`EngineClient` is the server-side half that both transports share: it
sends commands, and it routes each :class:`EngineMessage` -- handing each
request's :class:`OutputDelta` to its output stream as it came (the stream
builds what its reader asks for), resolving add acks and control calls,
publishing the snapshot and calling step listeners -- with one wake-up of each
event loop per message. The transports:

* :class:`MPClient` (what ``loopline serve`` uses): the engine loop runs in a
  child process started with ``spawn``, so the GPU launches of every step
  never wait for the server's event loop (SSE framing, JSON) to release the
  GIL. Commands go down a pipe pickled with torch's sharing reductions (CPU
  tensors of a weight update travel through shared memory, CUDA tensors as
  IPC handles); messages come back on a reader thread. A child that dies
  marks the engine dead: every waiter fails with ``EngineDeadError``.
* :class:`InProcClient`: the same loop on a thread of this process, over an
  existing engine object (tests and embedders that need ``.engine``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor-sharing reductions with the pickler)

from loopline.engine import LLMEngine, PromptType
from loopline.errors import EngineDeadError
from loopline.runtime.core import EngineCore, Inbox, run_engine_process
from loopline.runtime.protocol import (AbortCmd, AddCmd, CallCmd, Command, EngineInfo, EngineMessage, EngineSnapshot,
                                       OutputDelta, ShutdownCmd, StepRecord)
from loopline.sampling_params import SamplingParams

logger = logging.getLogger("loopline.async")


@dataclass
class _PendingAdd:
    request_ids: list[str]
    stream: Any  # OutputStream (or what wraps one): _put(OutputDelta), _fail(error)
    ack: asyncio.Future


class EngineClient:
    """Commands to an engine loop and the routing of its messages (subclasses: the transport)."""

    def __init__(self) -> None:
        self.info: EngineInfo | None = None
        self.snapshot = EngineSnapshot()
        self.dead: BaseException | None = None
        self.stopping = False
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._adds: dict[int, _PendingAdd] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._streams: dict[str, tuple[Any, asyncio.AbstractEventLoop]] = {}  # request id -> (stream, its loop)
        self._abort_asked: set[str] = set()  # streamed requests this client asked to abort
        self._listeners: list[Callable[[StepRecord], None]] = []

    # --- the transport ------------------------------------------------------------------------
    def _send(self, cmd: Command) -> None:
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float | None) -> None:
        raise NotImplementedError

    @property
    def engine(self) -> LLMEngine:
        raise AttributeError(f"{type(self).__name__} runs the engine in another process; build the AsyncLLM "
                             "with engine=LLMEngine(...) for direct access")

    # --- commands (any thread) ----------------------------------------------------------------
    def add(self, requests: list[tuple[str, PromptType, SamplingParams]], chat_stop: bool, stream: Any,
            ack: asyncio.Future) -> None:
        """Queues an all-or-none add; ``ack`` gets ``None`` or the error once the engine applied it."""
        with self._lock:
            error = self._refusal()
            if error is None:
                add_id = next(self._ids)
                self._adds[add_id] = _PendingAdd([rid for rid, _, _ in requests], stream, ack)
        if error is not None:
            call_soon(ack.get_loop(), set_exception, ack, error)
            return
        self._send(AddCmd(add_id, requests, chat_stop))

    def call(self, name: str, args: tuple = (), until_drained: bool = False) -> concurrent.futures.Future:
        """``engine.<name>(*args)`` between steps; the future gets its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            error = self._refusal()
            if error is None:
                call_id = next(self._ids)
                self._calls[call_id] = future
        if error is not None:
            future.set_exception(error)
            return future
        self._send(CallCmd(call_id, name, args, until_drained))
        return future

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            with self._lock:
                self._abort_asked.update(rid for rid in request_ids if rid in self._streams)
            self._send(AbortCmd(request_ids))

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        self._listeners.append(fn)

    def has_stream(self, request_id: str) -> bool:
        """Whether an accepted request's outputs are still routed (it has not finished or failed)."""
        with self._lock:
            return request_id in self._streams

    #: This engine's name among its front end's engines in /health and the metrics' ``replica`` label
    #: (``None``: its index, "0" for a single engine; a prefill/decode worker: "prefill-0", "decode-1").
    label: str | None = None

    def replicas(self) -> list["EngineClient"]:
        """The engine loops behind this client (one; the data-parallel client has one per replica, the
        prefill/decode client one per worker)."""
        return [self]

    def _refusal(self) -> BaseException | None:
        if self.dead is not None:
            return self.dead
        return EngineDeadError("the engine is shutting down") if self.stopping else None

    # --- messages (the thread that receives them) ---------------------------------------------
    def _on_message(self, msg: EngineMessage) -> None:
        """Routes one message: acks (streams registered), failures, outputs, then call replies
        (after the outputs they caused, e.g. an abort's, were delivered)."""
        acks, replies = [], []
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, Callable, Any]]] = {}
        with self._lock:
            if self.dead is not None:
                return
            self.snapshot = msg.snapshot
            for reply in msg.replies:
                add = self._adds.pop(reply.id, None)
                if add is not None:
                    if reply.error is None:
                        loop = add.ack.get_loop()
                        self._streams.update((rid, (add.stream, loop)) for rid in add.request_ids)
                    acks.append((add.ack, reply.error))
                elif (future := self._calls.pop(reply.id, None)) is not None:
                    replies.append((future, reply.result, reply.error))
            outputs = msg.outputs
            if msg.dead is not None and not self.stopping:
                # NOTE: an engine stopped from outside (SIGTERM to its process) aborts its requests on its way
                # out; nobody asked for those aborts: their streams fail with ``dead`` below (never an "abort")
                outputs = [d for d in outputs if d.request_id in self._abort_asked or not ended_by_abort(d)]
            for rid, error in msg.failures:
                target = self._streams.pop(rid, None)
                self._abort_asked.discard(rid)
                if target is not None:
                    batches.setdefault(target[1], []).append((target[0], _fail, error))
            for delta in outputs:  # NOTE: as they came: O(what the step added), never a copy of a history
                rid = delta.request_id
                target = self._streams.pop(rid, None) if delta.finished else self._streams.get(rid)
                if delta.finished:
                    self._abort_asked.discard(rid)
                if target is not None:
                    batches.setdefault(target[1], []).append((target[0], _put, delta))
            if msg.dead is not None:
                self.dead = msg.dead
                pending_adds, self._adds = list(self._adds.values()), {}
                pending_calls, self._calls = list(self._calls.values()), {}
                acks += [(add.ack, msg.dead) for add in pending_adds]
                replies += [(future, None, msg.dead) for future in pending_calls]
                for stream, loop in self._streams.values():
                    batches.setdefault(loop, []).append((stream, _fail, msg.dead))
                self._streams.clear()
                self._abort_asked.clear()
        for record in msg.steps:
            for fn in self._listeners:
                try:
                    fn(record)
                except Exception:  # metrics must never fail a step
                    logger.exception("step listener %r failed", fn)
        for ack, error in acks:
            call_soon(ack.get_loop(), set_exception if error is not None else set_result, ack, error)
        # NOTE: one wake-up of each event loop per message, not one per request: every
        # call_soon_threadsafe writes the loop's self-pipe.
        for loop, batch in batches.items():
            call_soon(loop, _deliver, batch)
        for future, result, error in replies:
            settle(future, result, error)

    def _die(self, error: BaseException) -> None:
        self._on_message(EngineMessage(snapshot=replace(self.snapshot, num_running=0, num_waiting=0), dead=error))


class InProcClient(EngineClient):
    """The engine loop on a background thread of this process, over ``engine``."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self._engine = engine
        self.info = EngineInfo.of(engine)
        self._inbox = Inbox()
        core = EngineCore(engine, self._inbox, self._on_message)
        self.snapshot = core.take_snapshot()
        self._thread = threading.Thread(target=core.run, name="loopline-engine", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def _send(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        self._inbox.put(ShutdownCmd())
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class MPClient(EngineClient):
    """The engine loop in a child process (``spawn``), built from ``engine_args`` there."""

    def __init__(self, engine_args: Any, role: Any = None) -> None:
        """``role``: what the process runs instead of a plain engine (``run_engine_process``)."""
        super().__init__()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=run_engine_process, name="loopline-engine", daemon=True,
                                   args=(engine_args, child_conn, logging.getLogger("loopline").getEffectiveLevel(),
                                         torch.get_num_threads(), role))
        self.process.start()
        child_conn.close()  # NOTE: ours closed, the pipe reports EOF as soon as the child dies
        self._send_lock = threading.Lock()
        try:
            first = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineDeadError(f"the engine process exited while starting (exit code {self.process.exitcode}); "
                                  "see its log above") from None
        if isinstance(first, EngineMessage):  # the engine could not be built: its error, unchanged
            self.process.join(5)
            raise first.dead
        self.info = first
        self.snapshot = EngineSnapshot(kv_total_blocks=first.kv_pages)
        self._reader = threading.Thread(target=self._read, name="loopline-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, cmd: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)  # NOTE: torch's reductions: tensors are shared, not copied through the pipe
        except (OSError, ValueError):  # the child is gone: the reader reports it (or already did)
            if self.dead is None:
                self._die(EngineDeadError(f"the engine process is gone (exit code {self.process.exitcode})"))

    def _read(self) -> None:
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                self._on_message(msg)
                if msg.dead is not None:
                    return
        except (EOFError, OSError):
            pass
        self.process.join(1)
        self._die(EngineDeadError(f"the engine process exited unexpectedly (exit code {self.process.exitcode})"))

    def is_alive(self) -> bool:
        return self.process.is_alive() and self._reader.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        if self.process.is_alive():
            self._send(ShutdownCmd())
            self.process.join(timeout)
        if self.process.is_alive():  # a step that never returns: the server must still exit
            logger.warning("the engine process did not stop in %ss: terminating it", timeout)
            self.process.kill()
            self.process.join(5)
        self._reader.join(5)
        self._conn.close()


def ended_by_abort(delta: OutputDelta) -> bool:
    """Whether ``delta`` ends its request with ``finish_reason="abort"``."""
    return delta.finished and any(c.finish_reason == "abort" for c in delta.outputs)


# --- on the event loop -----------------------------------------------------------------------
def _put(stream: Any, delta: OutputDelta) -> None:
    stream._put(delta)


def _fail(stream: Any, error: BaseException) -> None:
    stream._fail(error)


def _deliver(batch: list[tuple[Any, Callable, Any]]) -> None:
    for stream, fn, arg in batch:
        fn(stream, arg)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def settle(future: concurrent.futures.Future, result: Any, error: BaseException | None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # the caller gave up (cancelled)
        pass


def set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(None)


def set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
