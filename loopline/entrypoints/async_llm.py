"""``AsyncLLM``: one continuously batched :class:`LLMEngine` shared by many asyncio callers.

The engine is not thread-safe, so exactly one background thread owns it: it
applies queued commands (add / abort) in arrival order, runs ``step()`` while
there is work, and sleeps on a condition variable otherwise. Outputs go back
to the event loop with ``loop.call_soon_threadsafe`` into per-request
:class:`OutputStream`s. Because ``RequestOutput``s are cumulative, a stream
keeps only the newest output per request: a slow consumer never makes the
engine thread wait or queues unbounded history.

Usage (vLLM names)::

    llm = AsyncLLM(EngineArgs(model=path))
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)
    await llm.abort("req-2")
    llm.shutdown()
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from loopline.config import EngineArgs
from loopline.core.engine import LLMEngine, PromptType
from loopline.errors import EngineStateError, InvalidRequestError
from loopline.outputs import RequestOutput
from loopline.sampling_params import SamplingParams

logger = logging.getLogger("loopline.async")

_IDLE_WAIT_S = 0.005


class EngineDeadError(EngineStateError):
    """The engine thread stopped (shutdown, or an internal error in ``step()``)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges published by the engine thread after every iteration (safe to read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One engine step as seen by step listeners (rows run, tokens scheduled, wall time)."""

    rows: int
    scheduled_tokens: int
    duration_s: float


class OutputStream:
    """Outputs of one or more requests, filled from the engine thread, read on the event loop.

    ``get()`` waits until at least one request progressed and returns the newest
    cumulative output of every request that progressed since the last call.
    """

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def _put(self, out: RequestOutput) -> None:  # on the event loop
        self._latest[out.request_id] = out
        self._ready.set()

    def _fail(self, error: BaseException) -> None:  # on the event loop
        self._error = error
        self._ready.set()

    async def get(self) -> list[RequestOutput]:
        await self._ready.wait()
        self._ready.clear()
        if self._latest:
            outs, self._latest = list(self._latest.values()), {}
            return outs
        assert self._error is not None
        raise self._error


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    chat_stop: bool
    stream: OutputStream
    ack: asyncio.Future


class AsyncLLM:
    """Async front end of one :class:`LLMEngine` driven by a background thread.

    ``generate()`` is an async generator of cumulative ``RequestOutput``s; a
    consumer that stops early (``break``, ``aclose()``, cancellation) aborts its
    request, which frees its KV at once. Validation errors from the engine's
    ``add_request`` reach the caller unchanged (``InvalidRequestError``).
    """

    def __init__(self, engine_args: EngineArgs | None = None, *, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine(engine_args or EngineArgs())
        # NOTE: the front end gets its own tokenizer copy: the engine thread detokenizes
        # concurrently, and one HF fast tokenizer must not be used from two threads at once.
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self._cond = threading.Condition()
        self._commands: list[_Add | list[str]] = []  # FIFO: adds and aborts keep their order
        self._streams: dict[str, tuple[OutputStream, asyncio.AbstractEventLoop]] = {}  # engine thread only
        self._stopping = False
        self._dead: BaseException | None = None
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self.snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="loopline-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLM":
        return cls(engine_args)

    # --- read-only facts about the engine -----------------------------------------------
    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None and not self._stopping

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """``fn(StepRecord)`` is called on the engine thread after every step that ran rows; keep it cheap."""
        self._step_listeners.append(fn)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        """Token ids of ``messages`` through the checkpoint's chat template (no engine state touched)."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("chat needs a tokenizer (the engine runs with skip_tokenizer_init)", param="messages")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise InvalidRequestError("the checkpoint has no chat template", param="messages")
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                      chat_template=chat_template)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # --- requests -------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                          chat_stop: bool = False, stream: OutputStream | None = None) -> OutputStream:
        """Queues a request; returns once the engine accepted it (raises its validation error otherwise).

        Several requests may share one ``stream`` (a multi-prompt HTTP request).
        """
        loop = asyncio.get_running_loop()
        stream = stream or OutputStream()
        ack = loop.create_future()
        self._submit(_Add(request_id, prompt, params or SamplingParams(), chat_stop, stream, ack))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort_nowait(request_id)  # it may have been added before the caller went away
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str, *,
                       chat_stop: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative output each time it progresses, the last one ``finished``."""
        stream = await self.add_request(request_id, prompt, sampling_params, chat_stop=chat_stop)
        finished = False
        try:
            while not finished:
                for out in await stream.get():
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self.abort_nowait(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str | list[str]) -> None:
        """Aborts requests without awaiting (safe in ``finally`` blocks and from any thread)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            with self._cond:
                self._commands.append(ids)
                self._cond.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Aborts every unfinished request (their streams get ``finish_reason="abort"``) and stops the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, cmd: _Add) -> None:
        with self._cond:
            if self._stopping or self._dead is not None:
                error = self._dead or EngineDeadError("the engine is shutting down")
                cmd.ack.get_loop().call_soon(_set_exception, cmd.ack, error)
                return
            self._commands.append(cmd)
            self._cond.notify()

    # --- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        device = engine.config.device
        if device.type == "cuda":  # NOTE: a new thread starts on cuda:0; kernels must launch on the engine's device
            torch.cuda.set_device(device)
        idle = False  # the last step ran no rows although requests are unfinished (e.g. all wait for KV)
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if idle and not (self._commands or self._stopping):
                        self._cond.wait(_IDLE_WAIT_S)  # do not spin on steps that cannot make progress
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for cmd in commands:
                    self._apply(cmd)
                if stopping:
                    engine.abort_request(list(self._streams))
                idle = not self._step()
                if stopping:
                    break
        except BaseException as e:  # an engine bug: fail every waiter instead of hanging them
            logger.exception("engine thread died")
            self._die(e)
            return
        self._die(EngineDeadError("the engine was shut down"))

    def _apply(self, cmd: _Add | list[str]) -> None:
        if isinstance(cmd, list):
            self.engine.abort_request(cmd)  # outputs with finish_reason "abort" come from the next step
            return
        loop = cmd.ack.get_loop()
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, chat_stop=cmd.chat_stop)
        except Exception as e:  # validation errors go back to the caller unchanged
            loop.call_soon_threadsafe(_set_exception, cmd.ack, e)
            return
        self._streams[cmd.request_id] = (cmd.stream, loop)
        loop.call_soon_threadsafe(_set_result, cmd.ack, None)

    def _step(self) -> bool:
        """One engine step; delivers outputs; returns whether anything happened."""
        engine = self.engine
        rows0, tokens0, t0 = engine.stats.rows, engine.stats.scheduled_tokens, time.perf_counter()
        outs = engine.step()
        rows = engine.stats.rows - rows0
        if rows and self._step_listeners:
            record = StepRecord(rows, engine.stats.scheduled_tokens - tokens0, time.perf_counter() - t0)
            for fn in self._step_listeners:
                fn(record)
        for out in outs:
            target = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if target is not None:
                stream, loop = target
                _call_soon(loop, stream._put, out)
        self.snapshot = self._take_snapshot()
        return bool(rows or outs)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        return EngineSnapshot(engine.scheduler.num_running, engine.scheduler.num_waiting,
                              engine.kv.num_used_blocks, engine.kv.pool.num_blocks)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._dead = error
            pending, self._commands = self._commands, []
        for cmd in pending:
            if isinstance(cmd, _Add):
                _call_soon(cmd.ack.get_loop(), _set_exception, cmd.ack, error)
        for stream, loop in self._streams.values():
            _call_soon(loop, stream._fail, error)
        self._streams.clear()
        self.snapshot = EngineSnapshot(0, 0, self.snapshot.kv_used_blocks, self.snapshot.kv_total_blocks)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
