"""The engine loop behind ``AsyncLLM``, and what it says to its client: one message per step.

:class:`EngineCore` owns one :class:`LLMEngine` and is the only code that touches it.
It applies queued commands (add / abort / control calls) in arrival order, runs
``step()`` while some request can progress, and sleeps on its :class:`Inbox`
otherwise -- also while a pause holds or freezes requests. After every
iteration it emits one :class:`EngineMessage`: the outputs of the step as
**deltas** (tokens, text, logprobs, exit depths added since the last message;
never cumulative lists, whose pickling would cost O(n^2) over a request), the
replies of the commands it applied, the step's :class:`StepRecord` and an
:class:`EngineSnapshot`. The same loop runs on a thread of the server process
(``runtime.client.InProcClient``) or in an engine process of its own
(``runtime.client.MPClient``, through :func:`run_engine_process`); only ``emit``
and who fills the inbox differ.

No request stops the loop: a failing ``add_request`` fails that add, a failing
``step()`` fails the requests to blame (``RequestFailedError`` names them,
otherwise every request the step ran) and frees their KV; only a device fault
or a step failing again and again stops it, and the last message then carries
``dead``.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from loopline.engine import LLMEngine
from loopline.engine.input_processor import parent_request_id
from loopline.engine.llm_engine import is_device_fault
from loopline.engine.verbs import VERBS
from loopline.errors import (EngineDeadError, EngineInternalError, EngineStateError, LooplineError, new_error_id,
                             RequestFailedError)
from loopline.runtime.heap import freeze_startup_heap, thawed
from loopline.runtime.protocol import (AbortCmd, AddCmd, CallCmd, Command, EngineInfo, EngineMessage, EngineSnapshot,
                                       Reply, ShutdownCmd, StepRecord)

logger = logging.getLogger("loopline.async")
# Verbs that drop or rebuild long-lived engine state (the KV pool, the CUDA graphs, offloaded weights): they run
# with the startup heap back under the collector (loopline.runtime.heap.thawed), so what they drop is freed.
_THAWING_VERBS = frozenset({"sleep", "wake_up"})

_IDLE_WAIT_S = 0.005
# A step that fails this many times in a row, although every request in flight was failed and
# aborted after each failure, is an engine fault rather than a bad request: the loop stops.
_MAX_CONSECUTIVE_STEP_FAILURES = 3
# Step records of steps without outputs wait at most this long for a message to ride on.
_MAX_STEP_RECORD_DELAY_S = 0.05


# --- the loop --------------------------------------------------------------------------------
@dataclass
class LoadEvent:
    """From a staged call's reader thread to the engine loop, through the inbox (never crosses a
    process): ``"validated"``, ``"piece"`` (validated entries to copy), ``"done"`` or ``"failed"``."""

    call_id: int
    kind: str
    payload: Any = None


class _Reader:
    """The reader thread of one staged call (``Verb.staged``, e.g. ``update_weights_from_disk``): it
    validates the whole checkpoint while the engine steps, waits until the engine opens the update,
    then hands over one validated piece at a time (the next is read once the engine applied the last)."""

    def __init__(self, call_id: int, load: Any, inbox: Inbox) -> None:
        self.call_id, self.load, self.inbox = call_id, load, inbox
        self.waiting = False  # (engine thread) its "validated" event arrived: open the update once none generates
        self._go = threading.Event()  # the engine opened the update: read the pieces
        self._applied = threading.Semaphore(0)  # the engine applied the piece in flight
        threading.Thread(target=self._run, name="loopline-weights-reader", daemon=True).start()

    def _run(self) -> None:
        try:
            self.load.validate()
            self.inbox.put(LoadEvent(self.call_id, "validated"))
            self._go.wait()
            for items in self.load.pieces():  # (raises once cancelled)
                self.inbox.put(LoadEvent(self.call_id, "piece", items))
                del items
                self._applied.acquire()  # NOTE: the next tensor is read once the engine copied this one
            self.inbox.put(LoadEvent(self.call_id, "done"))
        except BaseException as e:  # reported to the caller by the engine loop
            self.inbox.put(LoadEvent(self.call_id, "failed", e))

    def go(self) -> None:
        self._go.set()

    def applied(self) -> None:
        self._applied.release()

    def stop(self) -> None:
        """Cancels the load (engine thread) and unblocks the thread, which then ends."""
        self.load.cancel()
        self._go.set()
        self._applied.release()


class Inbox:
    """Commands for the engine loop, in arrival order (filled from any thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._commands: list[Command | LoadEvent] = []
        self._stopping = False

    def put(self, cmd: Command | LoadEvent) -> None:
        with self._cond:
            if isinstance(cmd, ShutdownCmd):
                self._stopping = True
            else:
                self._commands.append(cmd)
            self._cond.notify()

    def take(self, runnable: Callable[[], bool], idle: bool) -> tuple[list[Command | LoadEvent], bool]:
        """Waits until there is a command, a shutdown, or (``runnable()``) work; returns the commands
        and whether to stop. ``idle``: the last step made no progress, so wait a little anyway."""
        with self._cond:
            # NOTE: requests held or frozen by a pause count as unfinished but cannot progress:
            # wait for a command (resume) instead of stepping.
            while not (self._commands or self._stopping or runnable()):
                self._cond.wait()
            if idle and not (self._commands or self._stopping):
                self._cond.wait(_IDLE_WAIT_S)  # do not spin on steps that cannot make progress
            commands, self._commands = self._commands, []
            return commands, self._stopping


class EngineCore:
    """Runs one engine from an :class:`Inbox`; ``emit(EngineMessage)`` after every iteration."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit: Callable[[EngineMessage], None]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.emit = emit
        self._live: set[str] = set()  # ids of accepted requests whose final output was not sent
        self._msg = EngineMessage()  # being filled by this iteration
        self._drain_waiters: list[int] = []  # pause("wait") calls waiting for the requests in flight
        self._step_failures = 0  # consecutive failed steps
        self._last_snapshot: EngineSnapshot | None = None
        self._first_unsent = 0.0  # when the oldest step record not yet emitted was made
        self._readers: dict[int, _Reader] = {}  # staged calls in flight, by call id

    def run(self) -> None:
        engine = self.engine
        device = engine.config.device
        if device.type == "cuda":  # NOTE: a new thread starts on cuda:0; kernels must launch on the engine's device
            torch.cuda.set_device(device)
        idle = False  # the last step ran no rows although requests are unfinished (e.g. all wait for KV)
        try:
            while True:
                commands, stopping = self.inbox.take(self.engine.has_runnable_requests, idle)
                for cmd in commands:
                    self._apply(cmd)
                if stopping:
                    self.engine.abort_request(list(self._live))
                try:
                    rows = self.engine.stats.rows
                    idle = not self._step()
                    if self.engine.stats.rows > rows:  # NOTE: a step that ran no row proves nothing
                        self._step_failures = 0
                except Exception as e:  # a request must not stop the engine: fail the ones to blame
                    idle = True
                    self._on_step_error(e)
                self._open_ready_loads()
                self._check_drained()
                if stopping:
                    break  # NOTE: the aborts of a shutdown go in the last message, with ``dead`` (see _die)
                self._flush()
        except BaseException:  # a device fault or an engine bug: fail every waiter instead of hanging them
            error_id = new_error_id()
            logger.exception("engine loop stopped (error id %s)", error_id)
            self._die(EngineDeadError(f"internal error (error id {error_id}); see the server log"))
            return
        self._die(EngineDeadError("the engine was shut down"))

    # --- what tests and embedders that drive the loop by hand see -------------------------------
    def apply(self, cmd: Command) -> None:
        """Applies one command now, as :meth:`run` does with each it takes from the inbox (replies and
        failures go into :attr:`outbox`); for callers that drive the loop command by command."""
        self._apply(cmd)

    @property
    def outbox(self) -> EngineMessage:
        """The message this iteration is filling (outputs, failures, replies, handoffs); the loop emits it
        after the step once it carries news."""
        return self._msg

    @property
    def live_requests(self) -> frozenset[str]:
        """Accepted requests whose final output was not sent yet (a copy)."""
        return frozenset(self._live)

    # --- commands -----------------------------------------------------------------------------
    def _apply(self, cmd: Command | LoadEvent) -> None:
        if isinstance(cmd, AbortCmd):
            self._abort(cmd.request_ids)  # outputs with finish_reason "abort" come from the next step
        elif isinstance(cmd, LoadEvent):
            self._on_load_event(cmd)
        elif isinstance(cmd, CallCmd):
            try:
                verb = VERBS.lookup(cmd.name)  # only a verb of engine/verbs.py runs here
                if verb.staged:  # the reply comes once its reader and the copy are done
                    load = getattr(self.engine.control, f"stage_{verb.name}")(*cmd.args)
                    self._readers[cmd.call_id] = _Reader(cmd.call_id, load, self.inbox)
                    return
                with thawed() if verb.name in _THAWING_VERBS else contextlib.nullcontext():
                    result = (getattr(self, f"call_{verb.name}")(*cmd.args) if verb.loop
                              else self.engine.control_call(verb.name, *cmd.args))
            except Exception as e:  # engine errors go back to the caller unchanged
                self._msg.replies.append(Reply(cmd.call_id, None, e))
                return
            if cmd.until_drained:
                self._drain_waiters.append(cmd.call_id)
            else:
                self._msg.replies.append(Reply(cmd.call_id, result))
        else:
            self._add(cmd)

    def _add(self, cmd: AddCmd) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, params in cmd.requests:
                try:
                    self.engine.add_request(request_id, prompt, params, chat_stop=cmd.chat_stop)
                except LooplineError:
                    raise  # validation, or a state that refuses requests (asleep): the engine changed nothing
                except Exception as e:  # an internal failure while adding: undo what it may have left
                    error_id = new_error_id()
                    logger.exception("adding request %s failed (error id %s)", request_id, error_id)
                    self._abort([request_id])
                    raise EngineInternalError(f"internal error while adding the request (error id {error_id})",
                                              error_id) from e
                added.append(request_id)
                self._live.add(request_id)
        except Exception as e:  # all or none: the ones already added go again
            self._abort(added)
            self._live.difference_update(added)
            self._msg.replies.append(Reply(cmd.add_id, None, e))
            return
        self._msg.replies.append(Reply(cmd.add_id))

    def call_abort_all(self) -> list[str]:
        """The ``abort_all`` verb (served here: the loop knows which requests it still streams):
        aborts every unfinished request; returns their ids."""
        ids = list(self._live)
        self.engine.abort_request(ids)
        return ids

    def _abort(self, request_ids: list[str]) -> None:
        """Aborts requests in the engine; a failure here is an engine fault (it propagates)."""
        if request_ids:
            self.engine.abort_request(request_ids)

    # --- staged calls (weight updates from disk) ------------------------------------------------
    def _on_load_event(self, event: LoadEvent) -> None:
        reader = self._readers.get(event.call_id)
        if reader is None:
            return  # stopped meanwhile
        if event.kind == "failed":  # the checkpoint was refused: the caller gets the reader's error
            self._end_load(reader, event.payload)
            return
        try:
            if event.kind == "validated":
                reader.waiting = True  # new requests are held from now on
            elif event.kind == "piece":
                reader.load.apply(event.payload)
                reader.applied()
            elif event.kind == "done":
                del self._readers[event.call_id]
                self._msg.replies.append(Reply(event.call_id, reader.load.commit()))
        except Exception as e:
            self._end_load(reader, e)

    def _open_ready_loads(self) -> None:
        """Opens each validated load once no request generates: the copy runs between steps from now on."""
        for reader in list(self._readers.values()):
            if reader.waiting and reader.load.ready:
                reader.waiting = False
                try:
                    reader.load.open()
                except Exception as e:
                    self._end_load(reader, e)
                    continue
                reader.go()

    def _end_load(self, reader: _Reader, error: BaseException) -> None:
        """A staged call failed: cancels it (the old weights serve unless some tensors were copied)."""
        self._readers.pop(reader.call_id, None)
        self._msg.replies.append(Reply(reader.call_id, None, error))
        reader.stop()

    # --- steps --------------------------------------------------------------------------------
    def _step(self) -> bool:
        """One engine step; its outputs go into this iteration's message; returns whether anything happened."""
        engine = self.engine
        rows0, tokens0, t0 = engine.stats.rows, engine.stats.scheduled_tokens, time.perf_counter()
        iter0 = engine.stats.iteration_tokens
        outs = engine.step_deltas()
        rows = engine.stats.rows - rows0
        if rows:
            if not self._msg.steps:
                self._first_unsent = t0
            self._msg.steps.append(StepRecord(rows, engine.stats.scheduled_tokens - tokens0, time.perf_counter() - t0,
                                              iteration_tokens=engine.stats.iteration_tokens - iter0))
        for out in outs:
            if out.request_id in self._live:  # else it failed (or its add did): nobody waits for it
                self._msg.outputs.append(out)
                if out.finished:
                    self._live.discard(out.request_id)
        return bool(rows or outs)

    def _on_step_error(self, error: Exception) -> None:
        """A failed ``step()``: fails the requests to blame (the named ones, else every one in flight),
        aborts them in the engine (frees their KV) and keeps serving the others."""
        error_id = new_error_id()
        if isinstance(error, RequestFailedError):
            blamed = error.request_ids
        else:  # every request that was in the step; those a pause holds back never reached it
            held = {parent_request_id(r.request_id) for r in self.engine.control.held}
            blamed = [rid for rid in self._live if rid not in held]
        logger.exception("engine step failed (error id %s); failing request(s) %s", error_id,
                         ", ".join(blamed[:20]) + (" ..." if len(blamed) > 20 else "") or "-")
        if is_device_fault(error):
            raise error  # the device is unusable: stop (the client's ``health_problem`` says so)
        self._step_failures += 1
        if self._step_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineStateError(f"the engine step failed {self._step_failures} times in a row "
                                   f"(error id {error_id})") from error
        # EngineStateError ("cannot step: ...") is the engine's own clear message; anything else
        # is internal and reaches clients only as its id.
        failure = error if isinstance(error, EngineStateError) else EngineInternalError(
            f"internal error while generating (error id {error_id}); the request was aborted", error_id)
        self._abort([rid for rid in blamed if rid in self._live])
        for rid in blamed:
            if rid in self._live:
                self._live.discard(rid)
                self._msg.failures.append((rid, failure))

    def _check_drained(self) -> None:
        """Replies to ``pause_generation("wait")`` callers once nothing is in flight."""
        if not self._drain_waiters:
            return
        engine = self.engine
        if engine.is_drained:
            error = None
        elif engine.control.pause_mode != "wait":
            state = "resumed" if not engine.is_paused else f"turned into a {engine.control.pause_mode!r} pause"
            error = EngineStateError(f"generation was {state} before the requests in flight drained")
        else:
            return
        waiters, self._drain_waiters = self._drain_waiters, []
        self._msg.replies += [Reply(call_id, None, error) for call_id in waiters]

    # --- messages -----------------------------------------------------------------------------
    def _flush(self) -> None:
        """Emits the iteration's message if it carries news for the client. Steps that only ran
        rows (a token's inner loops, prefill chunks) ride along with the next message, or go
        alone once ``_MAX_STEP_RECORD_DELAY_S`` old: at fixed depth R that is R x fewer messages."""
        msg = self._msg
        msg.snapshot = self.take_snapshot()
        news = msg.outputs or msg.failures or msg.replies or msg.handoffs or msg.snapshot != self._last_snapshot
        if not news and not (msg.steps and time.perf_counter() - self._first_unsent > _MAX_STEP_RECORD_DELAY_S):
            return
        self._msg = EngineMessage()
        self._last_snapshot = msg.snapshot
        self.emit(msg)

    def take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        cache, sched, weights, stats = engine.kv.prefix_cache, engine.scheduler, engine.weights, engine.stats
        return EngineSnapshot(sched.num_running, sched.num_waiting, engine.kv.num_used_blocks, engine.kv.pool.num_blocks,
                              cache.stats.queries if cache else 0, cache.stats.hits if cache else 0,
                              sched.num_preemptions, engine.get_num_unfinished_requests(),
                              sum(1 for r in sched.requests.values() if r.output), engine.is_paused,
                              "partially_updated" if weights.broken else "updating" if weights.in_progress
                              else "committed", stats.spec_num_drafts, stats.spec_num_draft_tokens,
                              stats.spec_num_accepted_tokens, tuple(stats.spec_accepted_per_pos))

    def _die(self, error: BaseException) -> None:
        """The last message: outputs and replies gathered so far, then ``dead`` (the client fails the rest).
        A shutdown's aborts come in this message, so a front end that did not ask for the shutdown (a
        worker stopped by SIGTERM) sees them beside ``dead`` and can fail those requests instead."""
        for reader in list(self._readers.values()):
            try:
                self._end_load(reader, error)
            except Exception:  # the engine is broken: the caller still gets the error
                logger.exception("cancelling the weight update from disk failed")
        msg, self._msg = self._msg, EngineMessage()
        msg.replies += [Reply(call_id, None, error) for call_id in self._drain_waiters]
        self._drain_waiters = []
        try:
            snapshot = self.take_snapshot()
        except Exception:  # the engine is broken: keep its last gauges
            snapshot = self._last_snapshot or EngineSnapshot()
        msg.snapshot = replace(snapshot, num_running=0, num_waiting=0)
        msg.dead = error
        self.emit(msg)


# --- the engine process ----------------------------------------------------------------------
def run_engine_process(engine_args: Any, conn: Any, log_level: int, num_threads: int, role: Any = None) -> None:
    """Entry point of the engine process (``MPClient``): builds the engine, sends its
    :class:`EngineInfo` (or the exception that stopped the build), then runs the loop.

    A receiver thread feeds the inbox from ``conn``; the loop writes its messages itself (the
    server's reader thread drains the pipe at once). The server process owns shutdown: SIGINT
    (a Ctrl-C reaches the whole process group) is ignored here, so the server can drain first;
    SIGTERM (multiprocessing's exit handler, a service manager) and a closed connection (the
    server went away) stop the loop as a shutdown does: requests still running are aborted.

    ``role`` (a prefill or decode worker, ``loopline.distributed.pd``) builds the engine and the
    loop instead: ``role.build_engine(engine_args)`` and ``role.make_core(engine, inbox, emit)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the loop can stop cleanly
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("loopline").setLevel(log_level)
    torch.set_num_threads(num_threads)
    device = getattr(engine_args, "device", "auto")
    if isinstance(device, str) and device.startswith("cuda:"):
        # NOTE: building the engine (memory profiling, CUDA graph capture) launches kernels on the current
        # device: a data-parallel replica on cuda:i must make it its own before that.
        torch.cuda.set_device(torch.device(device))
    try:
        engine = LLMEngine(engine_args) if role is None else role.build_engine(engine_args)
    except BaseException as e:  # the server raises it (e.g. an invalid flag) and exits
        conn.send_bytes(dumps(EngineMessage(dead=e)))
        return
    conn.send_bytes(pickle.dumps(EngineInfo.of(engine), pickle.HIGHEST_PROTOCOL))
    freeze_startup_heap()  # the engine lives as long as this process: no collector pauses over it
    inbox = Inbox()

    def receive() -> None:
        try:
            while True:
                inbox.put(conn.recv())
        except (EOFError, OSError):  # the server process closed the connection or died
            inbox.put(ShutdownCmd())

    def send(msg: EngineMessage) -> None:
        try:
            conn.send_bytes(dumps(msg))
        except OSError:  # the server process is gone: the receiver stops the loop
            pass

    threading.Thread(target=receive, name="loopline-engine-recv", daemon=True).start()
    # NOTE: the loop runs on a thread of its own, as in the server process before: on a small CPU
    # host, torch ops issued from the main thread ran up to 10x slower (its OpenMP team busy-waits
    # when cores are oversubscribed). The process ends when the loop does.
    core = EngineCore(engine, inbox, send) if role is None else role.make_core(engine, inbox, send)
    loop = threading.Thread(target=core.run, name="loopline-engine")
    loop.start()
    signal.signal(signal.SIGTERM, lambda *_: inbox.put(ShutdownCmd()))
    while loop.is_alive():  # NOTE: a timed join, so that the signal handler runs on this thread
        loop.join(0.5)


def dumps(msg: EngineMessage) -> bytes:
    """Pickles a message; an exception that cannot cross the process boundary becomes a plain one."""
    msg.replies = [replace(r, error=_portable(r.error)) if r.error is not None else r for r in msg.replies]
    msg.failures = [(rid, _portable(e)) for rid, e in msg.failures]
    msg.dead = _portable(msg.dead) if msg.dead is not None else None
    return pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives a pickle round trip (it may pickle yet fail to unpickle), else a
    plain exception with its type and text."""
    try:
        pickle.loads(pickle.dumps(error, pickle.HIGHEST_PROTOCOL))
        return error
    except Exception:
        return EngineStateError(f"{type(error).__name__}: {error}") if isinstance(error, LooplineError) else \
            RuntimeError(f"{type(error).__name__}: {error}")
