"""``AsyncLLM``: one continuously batched :class:`LLMEngine` shared by many asyncio callers.

The engine runs in an :class:`~loopline.runtime.core.EngineCore` loop
that is the only code touching it; ``AsyncLLM`` reaches it through a client
strategy (``runtime.client``): :class:`MPClient`, the default, runs the loop in an
engine process of its own (``loopline.distributed.dp.DPClient`` routes over several
such replicas when ``data_parallel_size > 1``), so the GPU launches of each step never wait for
this process's event loop to release the GIL; :class:`InProcClient`, used when
an existing ``engine=`` is given, runs the same loop on a background thread.
Either way commands (add / abort / control calls) are applied in arrival
order between steps, and each step's outputs come back as one message of
deltas (what each request added) that the client hands to the requests'
output streams (:class:`OutputStream`), which build the ``RequestOutput`` objects their readers ask
for (``SamplingParams.output_kind``: cumulative by default, deltas, or the final
output only). A stream merges what its reader has not taken yet into one output
per request: a slow consumer never makes the engine wait or queues unbounded history.

The RL control calls (``pause_generation``, ``resume_generation``, the weight
updates, ``reset_prefix_cache``, ``sleep`` / ``wake_up``; see docs/rl.md) are the
verbs of ``engine/verbs.py``, inherited as async methods that all go through
:meth:`AsyncLLM.control_call`; they are queued like adds and aborts, and their
exceptions reach the caller unchanged.

No request stops the engine: a failing ``add_request`` fails that add, a failing
``step()`` fails the requests to blame and frees their KV; only a device fault,
a step failing again and again or a dead engine process stops it, and
``health_problem()`` then says why. Text prompts are tokenized on a
:class:`TokenizerPool`, never on the event loop or in the engine loop.

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
import copy
import logging
import uuid
from dataclasses import dataclass, replace
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from torch import Tensor

from loopline.config import EngineArgs
from loopline.distributed.launch import make_client
from loopline.engine import LLMEngine, PromptType
from loopline.engine.deltas import OutputBuilder, OutputDelta
from loopline.engine.verbs import VERBS, verb_mixin
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.runtime.client import EngineClient, InProcClient
from loopline.runtime.protocol import EngineInfo, EngineSnapshot, StepRecord
from loopline.entrypoints.tokenizer_pool import TokenizerPool
from loopline.errors import EngineInternalError, InvalidRequestError
from loopline.models.loader import load_tokenizer
from loopline.outputs import RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("loopline.async")

__all__ = ["AsyncLLM", "OutputStream", "EngineSnapshot", "StepRecord", "EngineInfo", "ReplicaState"]


@dataclass(frozen=True)
class ReplicaState:
    """One engine replica as the health route and the metrics see it (``problem``: ``None`` if it serves)."""

    index: int
    snapshot: EngineSnapshot
    problem: str | None
    name: str  # /health's and the metrics' name for it: "0", "1", ...; "prefill-0", "decode-0" for PD workers


class OutputStream:
    """Outputs of one or more requests, filled by the engine client, read on the event loop.

    The client puts each request's deltas as they arrive; ``get()`` waits until at least one
    request has an output and returns one output per such request, as its ``output_kind`` asks:
    the whole completion so far (``CUMULATIVE``), what was added since the previous ``get()``
    (``DELTA``), or the final output (``FINAL_ONLY``). ``on_delta(delta)`` (optional) sees every
    :class:`~loopline.engine.deltas.OutputDelta` as it arrives, whatever the kind (the server's
    metrics follow non-streamed requests token by token that way).
    """

    def __init__(self, on_delta: Callable[[OutputDelta], None] | None = None) -> None:
        self._builder = OutputBuilder()
        self._ready: dict[str, None] = {}  # requests with an output to take, in the order they got one
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._on_delta = on_delta

    def _put(self, delta: OutputDelta) -> None:  # on the event loop
        if self._on_delta is not None:
            try:
                self._on_delta(delta)
            except Exception:  # an observer (metrics) must never cost the request its output
                logger.exception("output observer %r failed", self._on_delta)
        if self._builder.add(delta):
            self._ready[delta.request_id] = None
            self._event.set()

    def _fail(self, error: BaseException) -> None:  # on the event loop
        self._error = error
        self._event.set()

    @property
    def num_requests(self) -> int:
        """Requests the stream keeps output state for (a request's goes with its final output)."""
        return len(self._builder)

    async def get(self) -> list[RequestOutput]:
        await self._event.wait()
        self._event.clear()
        if self._ready:
            ready, self._ready = self._ready, {}
            return [self._builder.take(rid) for rid in ready]
        assert self._error is not None
        raise self._error


# The control verbs as async AsyncLLM methods (``await llm.sleep(2)``), from engine/verbs.py.
AsyncVerbs = verb_mixin("AsyncVerbs", asynchronous=True, loop_verbs=True)


class AsyncLLM(AsyncVerbs):
    """Async front end of one :class:`LLMEngine` (in an engine process, or on a thread over ``engine``).

    ``generate()`` is an async generator of ``RequestOutput``s (cumulative unless the request's
    ``output_kind`` asks for deltas or the final output only); a
    consumer that stops early (``break``, ``aclose()``, cancellation) aborts its
    request, which frees its KV at once. Validation errors from the engine's
    ``add_request`` reach the caller unchanged (``InvalidRequestError``).
    """

    def __init__(self, engine_args: EngineArgs | None = None, *, engine: LLMEngine | None = None,
                 client: EngineClient | None = None) -> None:
        """``engine_args``: engine process(es) built from them (the default); ``engine``: the loop on a
        thread over that engine; ``client``: an engine client the caller built (e.g. a
        ``DPClient`` over replicas it started, with a router of its own)."""
        if sum(x is not None for x in (engine_args, engine, client)) > 1:
            raise InvalidRequestError("give at most one of engine_args, engine and client", param="engine_args")
        self._client: EngineClient = (client if client is not None else InProcClient(engine) if engine is not None
                                      else make_client(engine_args or EngineArgs()))
        info = self._client.info
        self.config, self.model_config = info.config, info.model_config
        if engine is not None:
            # NOTE: the front end gets its own tokenizer copy: the engine thread detokenizes
            # concurrently, and one HF fast tokenizer must not be used from two threads at once.
            tokenizer = engine.tokenizer
            self.tokenizer = copy.deepcopy(tokenizer)
        else:
            tokenizer = None if self.config.skip_tokenizer_init else load_tokenizer(self.config.tokenizer
                                                                                    or self.config.model_path,
                                                                                    self.config.chat_template)
            self.tokenizer = tokenizer
        self._chat = ChatEncoder(self.tokenizer, self.config.model_path, self.model_config.extra)
        # Tokenization of large inputs runs here, off the event loop and out of the engine loop.
        self.tokenizers = (TokenizerPool(tokenizer, self.config.model_path, self.model_config.extra)
                           if tokenizer is not None else None)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLM":
        return cls(engine_args)

    # --- read-only facts about the engine -----------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """The engine object (only with the in-process client: ``AsyncLLM(engine=...)``)."""
        return self._client.engine

    @property
    def client(self) -> EngineClient:
        """The engine client this front end drives: one engine (``InProcClient``, ``MPClient``),
        data-parallel replicas (``DPClient``) or prefill/decode workers (``PDClient``)."""
        return self._client

    @property
    def info(self) -> EngineInfo:
        return self._client.info

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges after its latest step (published with every engine message)."""
        return self._client.snapshot

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's request defaults (generation_config.json; ``{}`` with ``generation_config="vllm"``):
        the HTTP server fills unset request fields from them."""
        return dict(self._client.info.sampling_defaults)

    async def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's defaults (vLLM's name)."""
        return SamplingParams(**self.sampling_defaults)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def is_running(self) -> bool:
        client = self._client
        return client.is_alive() and not client.stopping and client.dead is None

    @property
    def errored(self) -> bool:
        return self._client.dead is not None and not self._client.stopping

    def weights_state(self) -> str:
        """``"committed"``, ``"updating"`` (an update is open) or ``"partially_updated"`` (a failed
        update left some tensors new: generation is refused until a complete update lands)."""
        return self._client.snapshot.weights_state

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (``None``: healthy): stopped, failed, or holding
        partially updated weights. Safe to call from any thread (it reads flags only). With
        data-parallel replicas: ``None`` while one replica serves (``replicas()`` says which do)."""
        return _problem(self._client)

    def replicas(self) -> list[ReplicaState]:
        """Every engine replica (one without data parallelism; each prefill and decode worker with them):
        its gauges and why it cannot serve, if so."""
        return [ReplicaState(i, _gauges_of(c), _problem(c), c.label or str(i))
                for i, c in enumerate(self._client.replicas())]

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """``fn(StepRecord)`` is called after every step that ran rows, on the thread that receives the
        engine's messages (not the event loop); keep it cheap."""
        self._client.add_step_listener(fn)

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
        engine loop). A caller cancelled while waiting (a client that went away) aborts every
        one of them at once.
        """
        loop = asyncio.get_running_loop()
        stream = stream or OutputStream()
        requests = await self._pretokenize(list(requests))
        ack = loop.create_future()
        self._client.add(requests, chat_stop, stream, ack)
        try:
            await ack
        except asyncio.CancelledError:
            self.abort_nowait([rid for rid, _, _ in requests])  # some may have been added before the caller left
            raise
        return stream

    async def _pretokenize(self, requests: list[tuple[str, PromptType, SamplingParams]]
                           ) -> list[tuple[str, PromptType, SamplingParams]]:
        """Text prompts become ``{"prompt": text, "prompt_token_ids": ids}`` (what the engine would compute;
        a prompt dict's other keys stay)."""
        texts = [i for i, (_, p, _) in enumerate(requests) if _text_of(p)]
        if not texts or self.tokenizers is None or self._client.stopping or self._client.dead is not None:
            return requests  # the engine reports what is wrong with them (or that it stopped)
        try:
            ids = await self.tokenizers.encode_many([_text_of(requests[i][1]) for i in texts])
        except Exception as e:  # e.g. a lone surrogate from a Python caller
            raise InvalidRequestError("the prompt could not be tokenized (it must be valid Unicode text)",
                                      param="prompt") from e
        for i, prompt_ids in zip(texts, ids):
            rid, prompt, params = requests[i]
            if prompt_ids:  # an empty encoding: the engine's own error message
                extra = prompt if isinstance(prompt, dict) else {}  # e.g. its cache_salt
                requests[i] = (rid, {**extra, "prompt": _text_of(prompt), "prompt_token_ids": prompt_ids}, params)
        return requests

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str, *,
                       chat_stop: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it progresses, the last one ``finished``: cumulative
        (the default), or as ``sampling_params.output_kind`` asks (only what was added since the
        previous output, or only the final output); raises ``EngineInternalError`` if an internal
        error ended it (``RequestOutput.error_id``)."""
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
        params = (sampling_params or SamplingParams()).clone(output_kind=RequestOutputKind.FINAL_ONLY)
        async for out in self.generate({"prompt_token_ids": prompt_token_ids}, params, rid):
            final = out
        assert final is not None and final.finished
        return final

    async def abort(self, request_id: str | list[str]) -> None:
        self.abort_nowait(request_id)

    # --- RL control (engine/verbs.py, docs/rl.md): each runs in the engine loop between steps ----
    async def control_call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """Runs a control verb in the engine loop, between two steps (``await llm.sleep(2)`` is
        ``await llm.control_call("sleep", 2)``); over several engines (data-parallel replicas,
        prefill/decode workers) on each of them, their answers combined by the verb's rule."""
        spec = VERBS.lookup(verb)
        args = spec.bind(args, kwargs)
        if spec.materialize is not None:
            i = [p.name for p in spec.params].index(spec.materialize)
            args = (*args[:i], _materialized(args[i]), *args[i + 1:])
        return await asyncio.wrap_future(self._client.call(spec.name, args, spec.until_drained(args)))

    def abort_nowait(self, request_id: str | list[str]) -> None:
        """Aborts requests without awaiting (safe in ``finally`` blocks and from any thread)."""
        self._client.abort([request_id] if isinstance(request_id, str) else list(request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Aborts every unfinished request (their streams get ``finish_reason="abort"``) and stops the engine
        (its thread, or its process)."""
        self._client.stopping = True
        self._client.shutdown(timeout)
        if self.tokenizers is not None:
            self.tokenizers.shutdown()


def _problem(client: EngineClient) -> str | None:
    if client.stopping:
        return "the engine is shutting down"
    if client.dead is not None:
        return f"the engine stopped: {client.dead}"
    if not client.is_alive():
        return "the engine stopped"
    if client.snapshot.weights_state == "partially_updated":
        return ("the weights are partially updated (a weight update failed after copying some tensors); "
                "generation is refused until a complete update lands")
    return None


def _gauges_of(client: EngineClient) -> EngineSnapshot:
    """The engine's snapshot; once it stopped, with what it holds (requests, KV pages) at 0: its last
    snapshot would otherwise stay on /metrics forever. The running totals stay (counters never go down)."""
    snap = client.snapshot
    if client.dead is None and client.is_alive():
        return snap
    return replace(snap, num_running=0, num_waiting=0, kv_used_blocks=0, num_unfinished=0, num_generating=0)


def _materialized(items: Any) -> Any:
    """An iterable argument as a list (a dict as its items), consumed here on the caller's thread;
    anything else unchanged (the engine refuses it with its own error)."""
    if isinstance(items, dict):
        return list(items.items())
    if isinstance(items, Iterable) and not isinstance(items, (str, bytes, Tensor)):
        return list(items)
    return items


def _text_of(prompt: PromptType) -> str | None:
    """The text of a text prompt that still needs token ids (``None`` otherwise)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None
