"""``AsyncLLM``: one continuously batched :class:`LLMEngine` shared by many asyncio callers.

The engine is not thread-safe, so exactly one background thread owns it: it
applies queued commands (add / abort / control calls) in arrival order, runs
``step()`` while some request can progress, and sleeps on a condition variable
otherwise -- also while a pause holds or freezes requests. Outputs go back
to the event loop with ``loop.call_soon_threadsafe`` into per-request
:class:`OutputStream`s. Because ``RequestOutput``s are cumulative, a stream
keeps only the newest output per request: a slow consumer never makes the
engine thread wait or queues unbounded history.

The RL control calls (``pause_generation``, ``resume_generation``, the weight
updates, ``reset_prefix_cache``, ``sleep`` / ``wake_up``; see docs/rl.md) are
queued like adds and aborts and run on the engine thread between steps; their
exceptions reach the caller unchanged.

No request stops the thread: a failing ``add_request`` fails that add, a
failing ``step()`` fails the requests to blame (``RequestFailedError`` names
them, otherwise every request the step ran) and frees their KV; only a device
fault or a step failing again and again stops it, and ``health_problem()``
then says why. Text prompts are tokenized on a :class:`TokenizerPool`, never
on the event loop or the engine thread.

Usage (vLLM names)::

    llm = AsyncLLM(EngineArgs(model=path))
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)
    await llm.abort("req-2")
    await llm.pause_generation("keep"); await llm.update_weights_from_disk("/ckpt/step-1", 1)
    await llm.resume_generation()
    llm.shutdown()
"""
from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import copy
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loopline.config import EngineArgs
from loopline.engine import LLMEngine, PromptType
from loopline.engine.llm_engine import is_device_fault
from loopline.engine.input_processor import parent_request_id
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.entrypoints.tokenizer_pool import TokenizerPool
from loopline.errors import (EngineDeadError, EngineInternalError, EngineStateError, InvalidRequestError,
                             LooplineError, RequestFailedError)
from loopline.outputs import RequestOutput
from loopline.sampling_params import SamplingParams

logger = logging.getLogger("loopline.async")

_IDLE_WAIT_S = 0.005
# A step that fails this many times in a row, although every request in flight was failed and
# aborted after each failure, is an engine fault rather than a bad request: the thread stops.
_MAX_CONSECUTIVE_STEP_FAILURES = 3

@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges published by the engine thread after every iteration (safe to read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens served from it
    num_preemptions: int = 0


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
    """Requests to add in one engine-thread command (a multi-prompt HTTP request is one command):
    all of them are accepted, or none (the first error goes back, the ones added are aborted)."""

    requests: list[tuple[str, PromptType, SamplingParams]]
    chat_stop: bool
    stream: OutputStream
    ack: asyncio.Future


@dataclass
class _Call:
    """``fn(engine)`` to run on the engine thread; its result or exception goes to ``future``."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future
    until_drained: bool = False  # pause("wait"): resolve once no request is in flight


_Command = _Add | _Call | list  # a list: request ids to abort


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
        self._chat = ChatEncoder.for_engine(self.engine, self.tokenizer)
        # Tokenization of large inputs runs here, off the event loop and off the engine thread.
        self.tokenizers = (TokenizerPool(self.engine.tokenizer, self.engine.config.model_path,
                                         self.engine.model_config.extra) if self.engine.tokenizer is not None else None)
        self._cond = threading.Condition()
        self._commands: list[_Command] = []  # FIFO: adds, aborts and control calls keep their order
        self._streams: dict[str, tuple[OutputStream, asyncio.AbstractEventLoop]] = {}  # engine thread only
        # Engine thread only: the ids the engine gives the choices of live n > 1 requests
        # (``id#i``) -> the parent id, so no user id can collide with one of them.
        self._step_failures = 0  # consecutive failed steps
        # Engine thread only: results of control calls that ran (sent after the next step), and
        # pause("wait") callers waiting for the requests in flight to finish.
        self._replies: list[tuple[concurrent.futures.Future, Any, BaseException | None]] = []
        self._drain_waiters: list[concurrent.futures.Future] = []
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

    def weights_state(self) -> str:
        """``"committed"``, ``"updating"`` (an update is open) or ``"partially_updated"`` (a failed
        update left some tensors new: generation is refused until a complete update lands)."""
        weights = self.engine.weights
        return "partially_updated" if weights.broken else "updating" if weights.in_progress else "committed"

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (``None``: healthy): stopped, failed, or holding
        partially updated weights. Safe to call from any thread (it reads flags only)."""
        if self._stopping:
            return "the engine is shutting down"
        if self._dead is not None or not self._thread.is_alive():
            return f"the engine stopped: {self._dead}" if self._dead is not None else "the engine thread stopped"
        if self.engine.weights.broken:
            return ("the weights are partially updated (a weight update failed after copying some tensors); "
                    "generation is refused until a complete update lands")
        return None

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """``fn(StepRecord)`` is called on the engine thread after every step that ran rows; keep it cheap."""
        self._step_listeners.append(fn)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        """Token ids of ``messages`` through the checkpoint's chat template (no engine state touched);
        on a -Thinking checkpoint ``<think>\n`` follows the assistant prefix."""
        return self._chat.encode(messages, add_generation_prompt, chat_template)

    # --- requests -------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                          chat_stop: bool = False, stream: OutputStream | None = None) -> OutputStream:
        """Queues a request; returns once the engine accepted it (raises its validation error otherwise).

        Several requests may share one ``stream`` (a multi-prompt HTTP request).
        """
        return await self.add_requests([(request_id, prompt, params or SamplingParams())], chat_stop=chat_stop,
                                       stream=stream)

    async def add_requests(self, requests: list[tuple[str, PromptType, SamplingParams]], *, chat_stop: bool = False,
                           stream: OutputStream | None = None) -> OutputStream:
        """Queues several requests as one command: all are accepted or none (the first error is raised).

        Text prompts are tokenized first, on the tokenizer pool (never on the event loop or the
        engine thread). A caller cancelled while waiting (a client that went away) aborts every
        one of them at once.
        """
        loop = asyncio.get_running_loop()
        stream = stream or OutputStream()
        requests = await self._pretokenize(list(requests))
        ack = loop.create_future()
        self._submit(_Add(requests, chat_stop, stream, ack))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort_nowait([rid for rid, _, _ in requests])  # some may have been added before the caller left
            raise
        return stream

    async def _pretokenize(self, requests: list[tuple[str, PromptType, SamplingParams]]
                           ) -> list[tuple[str, PromptType, SamplingParams]]:
        """Text prompts become ``{"prompt": text, "prompt_token_ids": ids}`` (what the engine would compute)."""
        texts = [i for i, (_, p, _) in enumerate(requests) if _text_of(p)]
        if not texts or self.tokenizers is None or self._stopping or self._dead is not None:
            return requests  # the engine reports what is wrong with them (or that it stopped)
        try:
            ids = await self.tokenizers.encode_many([_text_of(requests[i][1]) for i in texts])
        except Exception as e:  # e.g. a lone surrogate from a Python caller
            raise InvalidRequestError("the prompt could not be tokenized (it must be valid Unicode text)",
                                      param="prompt") from e
        for i, prompt_ids in zip(texts, ids):
            rid, prompt, params = requests[i]
            if prompt_ids:  # an empty encoding: the engine's own error message
                requests[i] = (rid, {"prompt": _text_of(prompt), "prompt_token_ids": prompt_ids}, params)
        return requests

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str, *,
                       chat_stop: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative output each time it progresses, the last one ``finished``;
        raises ``EngineInternalError`` if an internal error ended it (``RequestOutput.error_id``)."""
        stream = await self.add_request(request_id, prompt, sampling_params, chat_stop=chat_stop)
        finished = False
        try:
            while not finished:
                for out in await stream.get():
                    finished = out.finished
                    if out.error_id is not None:
                        raise EngineInternalError.request_failed(out.error_id)
                    yield out
        finally:
            if not finished:
                self.abort_nowait(request_id)

    async def generate_tokens(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                              request_id: str | None = None) -> RequestOutput:
        """Token-in / token-out for trainers: runs one request to the end and returns its final output.

        ``out.outputs[i]`` carries ``token_ids``, ``token_logprobs`` (with ``logprobs=0``),
        ``exit_depths``, ``seed`` and ``finish_reason`` (``"abort"`` if a pause or abort ended
        it); ``out.weight_version`` is the version that generated it. ``request_id`` defaults
        to a fresh unique id.
        """
        final = None
        rid = request_id if request_id is not None else f"tok-{uuid.uuid4().hex}"
        async for out in self.generate({"prompt_token_ids": prompt_token_ids}, sampling_params, rid):
            final = out
        assert final is not None and final.finished
        return final

    async def abort(self, request_id: str | list[str]) -> None:
        self.abort_nowait(request_id)

    async def abort_all(self) -> list[str]:
        """Aborts every unfinished request (running, waiting, frozen or held); returns their ids.

        Their streams end with ``finish_reason="abort"`` and the tokens produced so far.
        """
        def abort_all(engine: LLMEngine) -> list[str]:
            ids = list(self._streams)
            engine.abort_request(ids)
            return ids

        return await self._call(abort_all)

    # --- RL control (docs/rl.md): each runs on the engine thread between steps -------------
    async def pause_generation(self, mode: str = "abort") -> None:
        """Pauses generation (``"abort"`` | ``"wait"`` | ``"keep"``); new requests are held until resume.

        Returns once the pause is in force: for ``"abort"`` every aborted request's stream has
        its final output; for ``"wait"`` every request in flight has finished (it raises
        ``EngineStateError`` if the pause is lifted or turned into ``"keep"`` before that).
        """
        await self._call(lambda engine: engine.pause_generation(mode), until_drained=mode == "wait")

    async def resume_generation(self) -> None:
        """Frozen requests continue; held ones start in arrival order."""
        await self._call(lambda engine: engine.resume_generation())

    async def is_paused(self) -> bool:
        return await self._call(lambda engine: engine.is_paused)

    async def get_weight_version(self) -> int:
        return await self._call(lambda engine: engine.get_weight_version())

    async def start_weight_update(self, version: int) -> None:
        await self._call(lambda engine: engine.start_weight_update(version))

    async def update_weights(self, weights: Any) -> int:
        """One batch of ``(HF name, tensor)`` pairs (a dict or an iterable); returns how many it held.

        NOTE: the iterable is consumed here, on the caller's thread, before it is handed to
        the engine thread: a generator that materializes tensors (e.g. with collectives)
        runs where the caller expects it to.
        """
        if isinstance(weights, dict):
            weights = list(weights.items())
        elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes, Tensor)):
            weights = list(weights)
        return await self._call(lambda engine: engine.update_weights(weights))

    async def finish_weight_update(self) -> int:
        return await self._call(lambda engine: engine.finish_weight_update())

    async def abort_weight_update(self) -> None:
        await self._call(lambda engine: engine.abort_weight_update())

    async def update_weights_from_disk(self, path: str, version: int) -> int:
        """Publishes a safetensors directory as ``version`` (start, every shard, finish) on the engine thread."""
        return await self._call(lambda engine: engine.update_weights_from_disk(path, version))

    async def reset_prefix_cache(self) -> None:
        await self._call(lambda engine: engine.reset_prefix_cache())

    async def sleep(self, level: int = 1) -> None:
        await self._call(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda engine: engine.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self._call(lambda engine: engine.is_sleeping)

    async def _call(self, fn: Callable[[LLMEngine], Any], until_drained: bool = False) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future, until_drained))
        return await asyncio.wrap_future(future)

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
        if self.tokenizers is not None:
            self.tokenizers.shutdown()

    def _submit(self, cmd: _Add | _Call) -> None:
        with self._cond:
            if self._stopping or self._dead is not None:
                error = self._dead or EngineDeadError("the engine is shutting down")
                if isinstance(cmd, _Add):
                    _call_soon(cmd.ack.get_loop(), _set_exception, cmd.ack, error)
                else:
                    cmd.future.set_exception(error)
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
                    # NOTE: requests held or frozen by a pause count as unfinished but cannot
                    # progress: wait for a command (resume) instead of stepping.
                    while not (self._commands or self._stopping or engine.has_runnable_requests()):
                        self._cond.wait()
                    if idle and not (self._commands or self._stopping):
                        self._cond.wait(_IDLE_WAIT_S)  # do not spin on steps that cannot make progress
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for cmd in commands:
                    self._apply(cmd)
                if stopping:
                    engine.abort_request(list(self._streams))
                try:
                    idle = not self._step()
                    self._step_failures = 0
                except Exception as e:  # a request must not stop the engine: fail the ones to blame
                    idle = True
                    self._on_step_error(e)
                self._send_replies()  # after the outputs the calls caused (e.g. aborts) were delivered
                self._check_drained()
                if stopping:
                    break
        except BaseException as e:  # a device fault or an engine bug: fail every waiter instead of hanging them
            error_id = _error_id()
            logger.exception("engine thread stopped (error id %s)", error_id)
            self._die(EngineDeadError(f"internal error (error id {error_id}); see the server log"))
            return
        self._die(EngineDeadError("the engine was shut down"))

    def _apply(self, cmd: _Command) -> None:
        if isinstance(cmd, list):
            self._abort(cmd)  # outputs with finish_reason "abort" come from the next step
            return
        if isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return  # the caller gave up before it ran
            try:
                result = cmd.fn(self.engine)
            except Exception as e:  # engine errors go back to the caller unchanged
                self._replies.append((cmd.future, None, e))
                return
            if cmd.until_drained:
                self._drain_waiters.append(cmd.future)
            else:
                self._replies.append((cmd.future, result, None))
            return
        loop = cmd.ack.get_loop()
        added: list[str] = []
        try:
            for request_id, prompt, params in cmd.requests:
                try:
                    self.engine.add_request(request_id, prompt, params, chat_stop=cmd.chat_stop)
                except LooplineError:
                    raise  # validation, or a state that refuses requests (asleep): the engine changed nothing
                except Exception as e:  # an internal failure while adding: undo what it may have left
                    error_id = _error_id()
                    logger.exception("adding request %s failed (error id %s)", request_id, error_id)
                    self._abort([request_id])
                    raise EngineInternalError(f"internal error while adding the request (error id {error_id})",
                                              error_id) from e
                added.append(request_id)
                self._streams[request_id] = (cmd.stream, loop)
        except Exception as e:  # all or none: the ones already added go again
            self._abort(added)
            for rid in added:
                self._forget(rid)
            _call_soon(loop, _set_exception, cmd.ack, e)
            return
        _call_soon(loop, _set_result, cmd.ack, None)

    def _abort(self, request_ids: list[str]) -> None:
        """Aborts requests in the engine; a failure here is an engine fault (it propagates)."""
        if request_ids:
            self.engine.abort_request(request_ids)

    def _forget(self, request_id: str) -> tuple[OutputStream, asyncio.AbstractEventLoop] | None:
        """Drops a request that ended (its stream target and its choices' ids); returns the target."""
        return self._streams.pop(request_id, None)

    def _on_step_error(self, error: Exception) -> None:
        """A failed ``step()``: fails the requests to blame (the named ones, else every one in flight),
        aborts them in the engine (frees their KV) and keeps serving the others."""
        error_id = _error_id()
        if isinstance(error, RequestFailedError):
            blamed = error.request_ids
        else:  # every request that was in the step; those a pause holds back never reached it
            held = {parent_request_id(r.request_id) for r in self.engine.control.held}
            blamed = [rid for rid in self._streams if rid not in held]
        logger.exception("engine step failed (error id %s); failing request(s) %s", error_id,
                         ", ".join(blamed[:20]) + (" ..." if len(blamed) > 20 else "") or "-")
        if is_device_fault(error):
            raise error  # the device is unusable: stop (``health_problem`` says so)
        self._step_failures += 1
        if self._step_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineStateError(f"the engine step failed {self._step_failures} times in a row "
                                   f"(error id {error_id})") from error
        # EngineStateError ("cannot step: ...") is the engine's own clear message; anything else
        # is internal and reaches clients only as its id.
        failure = error if isinstance(error, EngineStateError) else EngineInternalError(
            f"internal error while generating (error id {error_id}); the request was aborted", error_id)
        self._abort([rid for rid in blamed if rid in self._streams])
        for rid in blamed:
            target = self._forget(rid)
            if target is not None:
                stream, loop = target
                _call_soon(loop, stream._fail, failure)

    def _step(self) -> bool:
        """One engine step; delivers outputs; returns whether anything happened."""
        engine = self.engine
        rows0, tokens0, t0 = engine.stats.rows, engine.stats.scheduled_tokens, time.perf_counter()
        outs = engine.step()
        rows = engine.stats.rows - rows0
        if rows and self._step_listeners:
            record = StepRecord(rows, engine.stats.scheduled_tokens - tokens0, time.perf_counter() - t0)
            for fn in self._step_listeners:
                try:
                    fn(record)
                except Exception:  # metrics must never fail a step
                    logger.exception("step listener %r failed", fn)
        # NOTE: one wake-up of each event loop per step, not one per request: every call_soon_threadsafe
        # writes the loop's self-pipe, and at 128 streams those calls cost the engine thread ~1 ms a step.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
        for out in outs:
            target = self._forget(out.request_id) if out.finished else self._streams.get(out.request_id)
            if target is not None:
                stream, loop = target
                batches.setdefault(loop, []).append((stream, out))
        for loop, batch in batches.items():
            _call_soon(loop, _deliver, batch)
        self.snapshot = self._take_snapshot()
        return bool(rows or outs)

    def _send_replies(self) -> None:
        replies, self._replies = self._replies, []
        for future, result, error in replies:
            _settle(future, result, error)

    def _check_drained(self) -> None:
        """Resolves ``pause_generation("wait")`` callers once nothing is in flight."""
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
        for future in waiters:
            _settle(future, None, error)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        cache = engine.kv.prefix_cache
        return EngineSnapshot(engine.scheduler.num_running, engine.scheduler.num_waiting,
                              engine.kv.num_used_blocks, engine.kv.pool.num_blocks,
                              cache.stats.queries if cache else 0, cache.stats.hits if cache else 0,
                              engine.scheduler.num_preemptions)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._dead = error
            pending, self._commands = self._commands, []
        for cmd in pending:
            if isinstance(cmd, _Add):
                _call_soon(cmd.ack.get_loop(), _set_exception, cmd.ack, error)
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(error)
        self._send_replies()  # calls that ran before the failure keep their own outcome
        waiters, self._drain_waiters = self._drain_waiters, []
        for future in waiters:
            _settle(future, None, error)
        for stream, loop in self._streams.values():
            _call_soon(loop, stream._fail, error)
        self._streams.clear()
        self.snapshot = dataclasses.replace(self.snapshot, num_running=0, num_waiting=0)


def _text_of(prompt: PromptType) -> str | None:
    """The text of a text prompt that still needs token ids (``None`` otherwise)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _error_id() -> str:
    return uuid.uuid4().hex[:12]


def _deliver(batch: list[tuple[OutputStream, RequestOutput]]) -> None:  # on the event loop
    for stream, out in batch:
        stream._put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def _settle(future: concurrent.futures.Future, result: Any, error: BaseException | None) -> None:
    """Completes a running control call's future (it can no longer be cancelled)."""
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
