"""``POST /v1/chat/completions``: messages through the chat template; whole responses (from the final
output) or SSE chunks (from ``DELTA`` outputs)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loopline.entrypoints.openai.generation import ChunkTracker, Generation, ServingContext, salted
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from loopline.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatLogProbs, ChatResponseMessage,
                                                  ChatStreamChoice, ChatTemplateInputs, DeltaMessage, UsageInfo)
from loopline.entrypoints.openai.sse import error_event, sse_model
from loopline.entrypoints.openai.tool_parsers import ToolCall, ToolParser, call_from_json, get_tool_parser
from loopline.errors import InvalidRequestError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams


async def render_chat(ctx: ServingContext, req: ChatTemplateInputs, conversation: list[dict[str, Any]],
                      add_special_tokens: bool, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of ``conversation`` with the request's template inputs; every template
    input must be one the template reads (400 otherwise: it would be silently ignored)."""
    if req.chat_template is not None and not ctx.trust_request_chat_template:
        raise InvalidRequestError("chat_template is not accepted: a request's template runs template code (loops) on "
                                  "the server; start it with --trust-request-chat-template to allow it",
                                  param="chat_template")
    pool = ctx.llm.tokenizers
    if pool is None:
        raise InvalidRequestError("chat needs a tokenizer (the engine runs with skip_tokenizer_init=True)",
                                  param="messages")
    kwargs = req.template_kwargs()

    def work(tok, chat: ChatEncoder) -> tuple[str, list[int]]:
        if req.chat_template_kwargs:
            chat.check_template_kwargs(req.chat_template_kwargs, "chat_template_kwargs", req.chat_template)
        for name in ("documents", "reasoning_effort"):
            if getattr(req, name, None) is not None:
                chat.check_template_kwargs({name: kwargs[name]}, name, req.chat_template)
        text = chat.render(conversation, req.add_generation_prompt, req.chat_template,
                           continue_final_message=req.continue_final_message, template_kwargs=kwargs, tools=tools)
        return text, list(tok.encode(text, add_special_tokens=add_special_tokens))

    try:
        return await pool.run(work)  # templates over long conversations take a while: off the event loop
    except InvalidRequestError:
        raise
    except Exception as e:  # template errors (e.g. a role the template refuses)
        # NOTE: a template's own raise_exception() text is meant for the client; anything else
        # (a bug, a tokenizer failure) is internal, so only its type is named.
        detail = str(e) if type(e).__name__ == "TemplateError" else type(e).__name__
        raise InvalidRequestError(f"the chat template could not render messages: {detail:.300}",
                                  param="messages") from e


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    parser_name = getattr(ctx, "tool_call_parser", None)
    auto = bool(getattr(ctx, "enable_auto_tool_choice", False) and parser_name)
    tool_mode = req.tool_mode(auto)
    params = req.to_sampling_params(ctx.llm.sampling_defaults)
    prompt_text, prompt_ids = await render_chat(ctx, req, req.conversation(), req.add_special_tokens,
                                                tools=req.tool_dicts())
    gen = ctx.new_generation("chatcmpl", 1, base_id=req.request_id)
    gen.user = req.user
    raw.state.generation = gen
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    try:
        await ctx.start(raw, gen, [salted(prompt_ids, req.cache_salt)], params, chat_stop=True,
                        kind=kind)  # closes itself on a bad request
    except InvalidRequestError as e:  # the engine's bounds name SamplingParams' field: name the one sent
        if e.param == "logprobs" and req.top_logprobs is not None:
            raise InvalidRequestError(str(e).replace("logprobs", "top_logprobs"), param="top_logprobs") from None
        raise
    view = _ChatView(ctx, req, gen, params, prompt_text, prompt_ids)
    view.tools = _Tools(tool_mode[0], tool_mode[1], parser_name, req.parallel_tool_calls is not False)
    return await ctx.respond(raw, gen, req.stream, view.stream, lambda outs: view.response(outs[0]).model_dump())


class _ChatView:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, gen: Generation, params: SamplingParams,
                 prompt_text: str, prompt_ids: list[int]) -> None:
        self.ctx, self.req, self.gen, self.params = ctx, req, gen, params
        self.prompt_text, self.prompt_ids = prompt_text, prompt_ids
        self.created = int(time.time())
        self.top_k = req.logprobs_shown
        self.role = req.response_role(ctx.response_role)
        self.echo = req.echoed(ctx.response_role)
        self.tools = _Tools("none", None, None, True)

    def _logprobs(self, comp: CompletionOutput) -> ChatLogProbs | None:
        """Logprobs of ``comp``'s tokens (all of them, or a ``DELTA``'s new ones)."""
        if not self.req.logprobs or comp.logprobs is None:
            return None
        namer = self.ctx.token_namer.for_request(self.req.return_tokens_as_token_ids)
        return ChatLogProbs(content=chat_logprobs(namer, comp.token_ids, comp.logprobs, self.top_k))

    def _usage(self) -> UsageInfo:
        return self.gen.usage_info()

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        req, ids = self.req, self.req.return_token_ids
        choices = []
        for c in out.outputs:
            content, calls = self.tools.extract(c.text)
            content = self.echo + content if content is not None else (self.echo or None)
            choices.append(ChatChoice(
                index=c.index, message=ChatResponseMessage(role=self.role, content=content,
                                                           tool_calls=[call.as_dict() for call in calls]),
                logprobs=self._logprobs(c), finish_reason=_finish(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason, exit_depths=c.exit_depths, token_ids=c.token_ids if ids else None))
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            namer = self.ctx.token_namer.for_request(req.return_tokens_as_token_ids)
            prompt_logprobs = vllm_prompt_logprobs(out.prompt_logprobs, namer)
        return ChatCompletionResponse(id=self.gen.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(), prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=out.prompt_token_ids if ids else None,
                                      prompt_text=self.prompt_text if req.return_prompt_text else None)

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None, **first: Any) -> str:
        if usage is None and choices and self.req.continuous_usage:
            usage = self._usage()
        return sse_model(ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.ctx.model_name,
                                             choices=choices, usage=usage, **first))

    async def stream(self) -> AsyncIterator[str]:
        req = self.req
        chunks = ChunkTracker()
        try:
            for i in range(self.params.n):  # one choice per chunk (as vLLM): the role first
                first = {}
                if i == 0:
                    first = {"prompt_token_ids": self.prompt_ids if req.return_token_ids else None,
                             "prompt_text": self.prompt_text if req.return_prompt_text else None}
                yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role=self.role, content=""))], **first)
            if self.echo:
                for i in range(self.params.n):
                    yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=self.echo))])
            async for out in self.gen.outputs():  # DELTA outputs: each completion holds what it added
                for comp in out.outputs:
                    if chunks.chunk(0, comp) is None:
                        continue
                    content, calls, called = self.tools.stream(comp.index, comp.text, comp.finish_reason is not None)
                    yield self._chunk([ChatStreamChoice(
                        index=comp.index, delta=DeltaMessage(content=content, tool_calls=calls),
                        logprobs=self._logprobs(comp), finish_reason=_finish(comp.finish_reason, called),
                        stop_reason=comp.stop_reason, exit_depths=comp.exit_depths,
                        token_ids=comp.token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield self._chunk([], self._usage())
        except Exception as e:  # headers are sent: report in-band
            yield error_event(e, "stream")
        finally:
            self.gen.close()
        yield "data: [DONE]\n\n"


def _finish(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for a choice that ended normally with tool calls (a cut-off one keeps ``length``)."""
    return "tool_calls" if called and reason == "stop" else reason


class _Tools:
    """A chat request's tool-call handling: ``mode`` ``none`` (text), ``auto`` (the server's parser
    extracts calls from the text), ``required`` (the constrained output is a JSON array of
    ``{name, arguments}``) or ``named`` (the constrained output is ``name``'s arguments)."""

    def __init__(self, mode: str, name: str | None, parser_name: str | None, parallel: bool) -> None:
        self.mode, self.name, self.parser_name, self.parallel = mode, name, parser_name, parallel
        self._streams: dict[int, Any] = {}  # per choice: its parser (auto), buffer (required) or call id (named)
        self._called: dict[int, bool] = {}

    def _limit(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole completion; text that does not parse stays content."""
        if self.mode == "auto":
            content, calls = get_tool_parser(self.parser_name).extract(text)
            return content, self._limit(calls)
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [ToolCall(self.name, text.strip())]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            calls = [call_from_json(i) for i in items] if isinstance(items, list) else [None]
            if not calls or any(c is None for c in calls):
                return text, []
            return None, self._limit(calls)
        return text, []

    def stream(self, index: int, text: str, last: bool) -> tuple[str | None, list[dict[str, Any]], bool]:
        """(content delta, tool-call deltas, whether the choice has called a tool) of one streamed delta."""
        if self.mode == "auto":
            parser: ToolParser = self._streams.setdefault(index, get_tool_parser(self.parser_name))
            piece = parser.feed(text)
            content, calls = piece.content, piece.tool_calls
            if last:
                content += parser.finish().content
            if not self.parallel:
                calls = [c for c in calls if c["index"] == 0]
            return content, calls, parser.calls_sent > 0
        if self.mode == "named":
            out: list[dict[str, Any]] = []
            if text:
                if index not in self._streams:
                    self._streams[index] = ToolCall(self.name, "")
                    out.append({"index": 0, **self._streams[index].as_dict()})
                    out[0]["function"]["arguments"] = text
                else:
                    out.append({"index": 0, "function": {"arguments": text}})
            return None, out, index in self._streams
        if self.mode == "required":
            self._streams[index] = self._streams.get(index, "") + text
            if not last:
                return None, [], False
            content, calls = self.extract(self._streams[index])
            return content, [{"index": i, **c.as_dict()} for i, c in enumerate(calls)], bool(calls)
        return text, [], False
