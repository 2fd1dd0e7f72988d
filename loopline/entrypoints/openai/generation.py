"""One HTTP generation request: its engine requests, their shared output stream, metrics and cleanup.

A request with several prompts becomes one engine request per prompt, all
delivering into one :class:`OutputStream`. A streamed response asks the engine
for deltas (``RequestOutputKind.DELTA``: each output holds what was added since
the previous one, and an SSE chunk is formatted from it directly), a whole
response for the final output only (``FINAL_ONLY``: built once). Metrics and
usage follow every delta either way (the stream's ``on_delta``). ``close()`` is
synchronous and idempotent, so it is safe in ``finally`` blocks that run under
cancellation (a client that disconnects): it aborts every unfinished engine
request, which frees its KV, and records it as aborted.
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
from loopline.engine.deltas import OutputDelta
from loopline.entrypoints.async_llm import AsyncLLM, OutputStream
from loopline.entrypoints.openai.logprobs import TokenNamer
from loopline.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from loopline.entrypoints.openai.protocol import APIError, PromptTokensDetails, UsageInfo
from loopline.entrypoints.openai.sse import SSEResponse
from loopline.errors import EngineInternalError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams


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
        self.stream = OutputStream(on_delta=self._observe)
        self.trackers: dict[str, RequestTracker] = {}
        self.accepted = False  # the engine took the requests
        self.done: set[str] = set()  # requests whose final output was read
        self.final: dict[str, RequestOutput] = {}  # their final outputs
        # usage, from every delta: prompt tokens of the requests with an output, generated tokens,
        # and each finished choice's finish reason
        self._prompt_tokens: dict[str, int] = {}
        self._generated = 0
        self._cached: dict[str, int] = {}  # prefix-cache hits of each request's prompt
        self._reasons: dict[tuple[str, int], str] = {}
        self._on_close = on_close
        self._closed = False
        self.user: str | None = None  # the request's ``user`` field, for the log line

    async def start(self, prompts: list[PromptType], params: SamplingParams | list[SamplingParams],
                    chat_stop: bool = False, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        """Adds every prompt as one engine command (``params``: one for all, or one per prompt; ``kind``:
        the outputs to read, for all): all are accepted or none. On a validation error or cancellation
        (the client left) every one of them is aborted at once and the error re-raised."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        of_kind = {id(p): p.clone(output_kind=kind) for p in per_prompt}
        # NOTE: before the add: deltas may arrive before the add's acknowledgement reaches this task
        self.trackers = {rid: self.metrics.tracker() for rid in self.ids}
        try:
            await self.llm.add_requests([(rid, prompt, of_kind[id(p)]) for rid, prompt, p in
                                         zip(self.ids, prompts, per_prompt)], chat_stop=chat_stop, stream=self.stream)
            self.accepted = True
        except BaseException:
            self.close()
            raise

    def _observe(self, delta: OutputDelta) -> None:
        """Every delta of every request, as it arrives (streamed or not): metrics and usage."""
        tracker = self.trackers[delta.request_id]
        if delta.head is not None:
            tracker.accepted(len(delta.head[1]))
            self._prompt_tokens[delta.request_id] = len(delta.head[1])
        tracker.observe(delta)
        if delta.num_cached_tokens:
            self._cached[delta.request_id] = max(self._cached.get(delta.request_id, 0), delta.num_cached_tokens)
        for c in delta.outputs:
            self._generated += len(c.token_ids)
            if c.finish_reason is not None:
                self._reasons[delta.request_id, c.index] = c.finish_reason

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.ids)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yields outputs (of the kind ``start`` asked for) as requests progress, until all have finished.

        Raises ``EngineInternalError`` (a 500, or an in-band stream error) when an internal error
        ended one of them; ``close()`` then aborts the others of this HTTP request.
        """
        while not self.finished:
            for out in await self.stream.get():
                if out.finished:
                    self.done.add(out.request_id)
                    self.final[out.request_id] = out
                if out.error_id is not None:
                    raise EngineInternalError.request_failed(out.error_id)
                yield out

    async def run_to_completion(self) -> list[RequestOutput]:
        """The final outputs, in prompt order (whole with ``FINAL_ONLY``, the default of ``start``)."""
        async for _ in self.outputs():
            pass
        return [self.final[rid] for rid in self.ids]

    def prompt_index(self, request_id: str) -> int:
        return self._index[request_id]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # NOTE: only requests the engine accepted: a rejected caller-chosen id may belong to another
        # live request (an add cancelled mid-flight aborts itself in AsyncLLM.add_request).
        unfinished = [rid for rid in self.ids if self.accepted and rid not in self.done]
        self.llm.abort_nowait(unfinished)
        for rid in unfinished:
            self.trackers[rid].finish("abort")
        if self._on_close is not None:
            self._on_close()

    def usage(self, generated_override: int | None = None) -> tuple[int, int]:
        """(prompt tokens, generated tokens) over the outputs seen so far; each prompt counts once."""
        prompt = sum(self._prompt_tokens.values())
        return prompt, self._generated if generated_override is None else generated_override

    def usage_info(self, generated_override: int | None = None) -> UsageInfo:
        """The response's ``usage`` (see :meth:`usage`); ``prompt_tokens_details.cached_tokens``: the
        prompt tokens the prefix cache served, over the requests seen so far."""
        prompt, generated = self.usage(generated_override)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached.values())))

    def summary(self) -> str:
        user = f" user={self.user!r:.80}" if self.user is not None else ""  # repr: no forged log lines
        if not self._prompt_tokens:
            return f"prompts={len(self.ids)} accepted={len(self.ids) if self.accepted else 0} (no output){user}"
        prompt, generated = self.usage()
        # a choice that has no finish reason (or none yet) was aborted
        unfinished = any(rid not in self.done for rid in self._prompt_tokens)
        reasons = sorted(set(self._reasons.values()) | ({"abort"} if unfinished else set()))
        return (f"prompts={len(self.ids)} prompt_tokens={prompt} completion_tokens={generated} "
                f"finish={','.join(reasons)}{user}")


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far."""

    tokens: int = 0  # generated tokens sent (the index of the next chunk's first token)
    ids: list[int] = field(default_factory=list)  # those tokens (kept only where logprob offsets need them)
    started: bool = False
    finished: bool = False


@dataclass
class Chunk:
    """A choice's next stream chunk: the ``DELTA`` completion it is made of, where its tokens start."""

    comp: CompletionOutput  # text, token ids, logprobs and exit depths added since the previous chunk
    start_token: int  # index of its first token in the whole completion
    first: bool  # the choice's first chunk


@dataclass
class ChunkTracker:
    """Turns ``DELTA`` outputs into stream chunks, per choice.

    The engine never takes reported text back: it holds back what could still change (the
    characters a stop string could start in, an incomplete UTF-8 character). So each delta's text
    is what its chunk adds, and the concatenated chunks equal the final non-streamed text.
    """

    states: dict[tuple[int, int], ChoiceState] = field(default_factory=dict)

    def chunk(self, prompt_idx: int, comp: CompletionOutput) -> Chunk | None:
        """The chunk of ``comp`` (a ``DELTA`` completion), or ``None``: nothing new, or finished already."""
        st = self.states.setdefault((prompt_idx, comp.index), ChoiceState())
        if st.finished:
            return None
        if comp.finish_reason is not None:
            st.finished = True
        elif not comp.text and not comp.token_ids:
            return None
        chunk = Chunk(comp, st.tokens, not st.started)
        st.started = True
        st.tokens += len(comp.token_ids)
        return chunk

    def token_ids(self, prompt_idx: int, comp: CompletionOutput) -> list[int]:
        """Every token of the choice so far, ``comp``'s included (once per chunk: logprob text offsets)."""
        st = self.states[prompt_idx, comp.index]
        st.ids += comp.token_ids
        return st.ids


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
        self._adds_special: bool | None = None
        self.trust_request_chat_template = False  # a request's own chat_template is refused unless set
        self.response_role = "assistant"  # a chat response's role after a generation prompt (--response-role)
        self.ready = False
        self.shutting_down = False

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def tokenizer_adds_special_tokens(self) -> bool:
        """Whether the tokenizer adds special tokens (a BOS) to text when asked to (vLLM's default for
        completions); the engine tokenizes text without them."""
        if self._adds_special is None:
            tok = self.llm.tokenizer
            self._adds_special = tok is not None and (list(tok.encode("a", add_special_tokens=True))
                                                      != list(tok.encode("a", add_special_tokens=False)))
        return self._adds_special

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

    def new_generation(self, prefix: str, num_prompts: int, request_ids: list[str] | None = None,
                       base_id: str | None = None) -> Generation:
        """Takes an in-flight slot (429 when none is left); the slot is released by ``Generation.close``.

        ``request_ids``: the engine request ids to use (one per prompt; default ``<prefix>-<uuid>[-i]``);
        ``base_id``: the client's ``request_id`` (the response id is then ``<prefix>-<base_id>``).
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

        return Generation(self.llm, self.metrics, f"{prefix}-{base_id or uuid.uuid4().hex}", num_prompts,
                          on_close=release, request_ids=request_ids)

    async def start(self, raw: Request, gen: Generation, prompts: list[PromptType],
                    params: SamplingParams | list[SamplingParams], chat_stop: bool = False, *,
                    kind: RequestOutputKind) -> None:
        """``gen.start(...)``, abandoned (every prompt aborted at once) if the client disconnects meanwhile:
        tokenizing and adding thousands of prompts takes a while."""
        await _unless_disconnected(raw, gen.start(prompts, params, chat_stop=chat_stop, kind=kind), gen)

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


def salted(prompt: PromptType, cache_salt: str | None) -> PromptType:
    """``prompt`` as a prompt dict carrying the request's ``cache_salt`` (unchanged when there is none
    and it already is a dict)."""
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif not isinstance(prompt, dict):
        prompt = {"prompt_token_ids": list(prompt)}
    return prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}


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
