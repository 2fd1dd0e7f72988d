"""One HTTP generation request: its engine requests, their shared output stream, metrics and cleanup.

A request with several prompts becomes one engine request per prompt, all
delivering into one :class:`OutputStream`. ``close()`` is synchronous and
idempotent, so it is safe in ``finally`` blocks that run under cancellation
(a client that disconnects): it aborts every unfinished engine request, which
frees its KV, and records it as aborted.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loopline.engine import PromptType
from loopline.entrypoints.async_llm import AsyncLLM, OutputStream
from loopline.entrypoints.openai.logprobs import TokenNamer
from loopline.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from loopline.entrypoints.openai.protocol import APIError
from loopline.entrypoints.openai.sse import SSEResponse
from loopline.errors import EngineInternalError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import SamplingParams


class Generation:
    """The engine requests of one HTTP request (``id``: the response id; engine ids ``id`` or
    ``id-<prompt index>``, or the caller's ``request_ids``)."""

    def __init__(self, async_llm: AsyncLLM, metrics: ServerMetrics, base_id: str, num_prompts: int,
                 on_close: Callable[[], None] | None = None, request_ids: list[str] | None = None) -> None:
        self.llm = async_llm
        self.metrics = metrics
        self.id = base_id
        if request_ids is not None:
            assert len(request_ids) == num_prompts
            self.ids = list(request_ids)
        else:
            self.ids = [base_id] if num_prompts == 1 else [f"{base_id}-{i}" for i in range(num_prompts)]
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self.stream = OutputStream()
        self.trackers: dict[str, RequestTracker] = {}
        self.latest: dict[str, RequestOutput] = {}
        self._on_close = on_close
        self._closed = False

    async def start(self, prompts: list[PromptType], params: SamplingParams | list[SamplingParams],
                    chat_stop: bool = False) -> None:
        """Adds every prompt as one engine command (``params``: one for all, or one per prompt): all are
        accepted or none. On a validation error or cancellation (the client left) every one of them
        is aborted at once and the error re-raised."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        trackers = {rid: self.metrics.tracker() for rid in self.ids}
        try:
            await self.llm.add_requests(list(zip(self.ids, prompts, per_prompt)), chat_stop=chat_stop,
                                        stream=self.stream)
            self.trackers = trackers
        except BaseException:
            self.close()
            raise

    @property
    def finished(self) -> bool:
        return len(self.latest) == len(self.ids) and all(o.finished for o in self.latest.values())

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yields (newest cumulative) outputs as requests progress, until all have finished.

        Raises ``EngineInternalError`` (a 500, or an in-band stream error) when an internal error
        ended one of them; ``close()`` then aborts the others of this HTTP request.
        """
        while not self.finished:
            for out in await self.stream.get():
                tracker = self.trackers[out.request_id]
                if out.request_id not in self.latest:
                    tracker.accepted(len(out.prompt_token_ids))
                tracker.observe(out)
                self.latest[out.request_id] = out
                if out.error_id is not None:
                    raise EngineInternalError.request_failed(out.error_id)
                yield out

    async def run_to_completion(self) -> list[RequestOutput]:
        async for _ in self.outputs():
            pass
        return [self.latest[rid] for rid in self.ids]

    def prompt_index(self, request_id: str) -> int:
        return self._index[request_id]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # NOTE: only requests the engine accepted: a rejected caller-chosen id may belong to another
        # live request (an add cancelled mid-flight aborts itself in AsyncLLM.add_request).
        unfinished = [rid for rid in self.ids if rid in self.trackers
                      and not (rid in self.latest and self.latest[rid].finished)]
        self.llm.abort_nowait(unfinished)
        for rid in unfinished:
            self.trackers[rid].finish("abort")
        if self._on_close is not None:
            self._on_close()

    def usage(self, generated_override: int | None = None) -> tuple[int, int]:
        """(prompt tokens, generated tokens) over the outputs seen so far; each prompt counts once."""
        prompt = sum(len(o.prompt_token_ids) for o in self.latest.values())
        generated = sum(len(c.token_ids) for o in self.latest.values() for c in o.outputs)
        return prompt, generated if generated_override is None else generated_override

    def summary(self) -> str:
        if not self.latest:
            return f"prompts={len(self.ids)} accepted={len(self.trackers)} (no output)"
        prompt, generated = self.usage()
        reasons = sorted({c.finish_reason or "abort" for o in self.latest.values() for c in o.outputs}) or ["abort"]
        return f"prompts={len(self.ids)} prompt_tokens={prompt} completion_tokens={generated} finish={','.join(reasons)}"


@dataclass
class DeltaState:
    """What one streamed choice has sent so far (text characters and tokens)."""

    chars: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class Delta:
    text: str
    start_token: int  # first new token index
    end_token: int
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class DeltaTracker:
    """Turns cumulative completions into stream deltas.

    The engine's text of a running completion never shrinks: its output processor
    holds back what could still change (the characters a stop string could start
    in, an incomplete UTF-8 character). So each delta is the text added since the
    last one, and the concatenated deltas equal the final non-streamed text.
    """

    states: dict[tuple[int, int], DeltaState] = field(default_factory=dict)

    def state(self, prompt_idx: int, comp_idx: int) -> DeltaState:
        return self.states.setdefault((prompt_idx, comp_idx), DeltaState())

    def delta(self, prompt_idx: int, comp: CompletionOutput) -> Delta | None:
        st = self.state(prompt_idx, comp.index)
        if st.finished:
            return None
        text = comp.text
        end = len(text)
        if comp.finish_reason is not None:
            st.finished = True
        new_text = text[st.chars:end] if end > st.chars else ""
        start = st.tokens
        if not new_text and start == len(comp.token_ids) and comp.finish_reason is None:
            return None
        st.chars = max(st.chars, end)
        st.tokens = len(comp.token_ids)
        return Delta(new_text, start, st.tokens, comp.finish_reason, comp.stop_reason)


class ServingContext:
    """What the route handlers share: the engine, the served name(s), metrics and the in-flight limit."""

    def __init__(self, async_llm: AsyncLLM, model_names: list[str], metrics: ServerMetrics,
                 max_concurrent_requests: int, max_prompts_per_request: int = 1024,
                 return_tokens_as_token_ids: bool = False) -> None:
        self.llm = async_llm
        self.token_namer = TokenNamer(async_llm.tokenizer, return_tokens_as_token_ids)
        self.model_names = model_names
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.max_prompts_per_request = max_prompts_per_request
        self.in_flight = 0
        self.ready = False
        self.shutting_down = False

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist (this server serves {self.model_names[0]!r}).",
                           param="model", code="model_not_found")

    def check_num_prompts(self, num_prompts: int, param: str) -> None:
        """Refuses a request with more prompts than ``max_prompts_per_request`` (before any is tokenized)."""
        if num_prompts > self.max_prompts_per_request:
            raise APIError(400, f"{param} holds {num_prompts} prompts; this server takes at most "
                                f"{self.max_prompts_per_request} per request (--max-prompts-per-request)",
                           param=param, code="invalid_value")

    def new_generation(self, prefix: str, num_prompts: int, request_ids: list[str] | None = None) -> Generation:
        """Takes an in-flight slot (429 when none is left); the slot is released by ``Generation.close``.

        ``request_ids``: the engine request ids to use (one per prompt; default ``<prefix>-<uuid>[-i]``).
        """
        if self.shutting_down or not self.llm.is_running:
            raise APIError(503, "the server is shutting down" if self.shutting_down else "the engine is not running",
                           type="service_unavailable", code="service_unavailable")
        if self.in_flight >= self.max_concurrent_requests:
            self.metrics.requests["rejected"].inc()
            raise APIError(429, f"too many requests in flight (limit {self.max_concurrent_requests}); retry later",
                           type="rate_limit_exceeded", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

        def release() -> None:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

        return Generation(self.llm, self.metrics, f"{prefix}-{uuid.uuid4().hex}", num_prompts, on_close=release,
                          request_ids=request_ids)

    async def start(self, raw: Request, gen: Generation, prompts: list[PromptType],
                    params: SamplingParams | list[SamplingParams], chat_stop: bool = False) -> None:
        """``gen.start(...)``, abandoned (every prompt aborted at once) if the client disconnects meanwhile:
        tokenizing and adding thousands of prompts takes a while."""
        await _unless_disconnected(raw, gen.start(prompts, params, chat_stop=chat_stop), gen)

    async def respond(self, raw: Request, gen: Generation, stream: bool, events: Callable[[], AsyncIterator[str]],
                      build: Callable[[list[RequestOutput]], Any]) -> Response:
        """Streams ``events()`` as server-sent events, or runs the generation to completion and
        answers ``build(outputs)`` as JSON; either way the generation is closed at the end."""
        if stream:
            return SSEResponse(events(), on_close=gen.close)
        try:
            outs = await self.run_unless_disconnected(raw, gen)
        finally:
            gen.close()
        return JSONResponse(build(outs))

    async def run_unless_disconnected(self, raw: Request, gen: Generation) -> list[RequestOutput]:
        """Runs a non-streamed generation; a client that goes away aborts it (and frees its KV)."""
        return await _unless_disconnected(raw, gen.run_to_completion(), gen)


async def _unless_disconnected(raw: Request, work: Any, gen: Generation) -> Any:
    """Awaits ``work``; if the client disconnects first, cancels it, aborts the generation and
    raises :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            gen.close()
    if task not in done:
        raise ClientDisconnected()
    return task.result()


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def _until_disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
