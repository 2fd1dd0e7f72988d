"""``POST /v1/chat/completions``: messages through the chat template; whole responses (from the final
output) or SSE chunks (from ``DELTA`` outputs)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loopline.entrypoints.openai.generation import ChunkTracker, Generation, ServingContext
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from loopline.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatLogProbs, ChatResponseMessage,
                                                  ChatStreamChoice, ChatTemplateInputs, DeltaMessage, UsageInfo)
from loopline.entrypoints.openai.sse import error_event, sse_model
from loopline.errors import InvalidRequestError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams


async def render_chat(ctx: ServingContext, req: ChatTemplateInputs, conversation: list[dict[str, str]],
                      add_special_tokens: bool) -> tuple[str, list[int]]:
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
                           continue_final_message=req.continue_final_message, template_kwargs=kwargs)
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
    params = req.to_sampling_params(ctx.llm.sampling_defaults)
    prompt_text, prompt_ids = await render_chat(ctx, req, req.conversation(), req.add_special_tokens)
    gen = ctx.new_generation("chatcmpl", 1, base_id=req.request_id)
    gen.user = req.user
    raw.state.generation = gen
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    try:
        await ctx.start(raw, gen, [{"prompt_token_ids": prompt_ids}], params, chat_stop=True,
                        kind=kind)  # closes itself on a bad request
    except InvalidRequestError as e:  # the engine's bounds name SamplingParams' field: name the one sent
        if e.param == "logprobs" and req.top_logprobs is not None:
            raise InvalidRequestError(str(e).replace("logprobs", "top_logprobs"), param="top_logprobs") from None
        raise
    view = _ChatView(ctx, req, gen, params, prompt_text, prompt_ids)
    return await ctx.respond(raw, gen, req.stream, view.stream, lambda outs: view.response(outs[0]).model_dump())


class _ChatView:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, gen: Generation, params: SamplingParams,
                 prompt_text: str, prompt_ids: list[int]) -> None:
        self.ctx, self.req, self.gen, self.params = ctx, req, gen, params
        self.prompt_text, self.prompt_ids = prompt_text, prompt_ids
        self.created = int(time.time())
        self.top_k = req.logprobs_shown
        self.role = req.response_role()
        self.echo = req.echoed()

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
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(role=self.role, content=self.echo + c.text),
                              logprobs=self._logprobs(c), finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                              exit_depths=c.exit_depths, token_ids=c.token_ids if ids else None) for c in out.outputs]
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
                    yield self._chunk([ChatStreamChoice(
                        index=comp.index, delta=DeltaMessage(content=comp.text), logprobs=self._logprobs(comp),
                        finish_reason=comp.finish_reason, stop_reason=comp.stop_reason, exit_depths=comp.exit_depths,
                        token_ids=comp.token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield self._chunk([], self._usage())
        except Exception as e:  # headers are sent: report in-band
            yield error_event(e, "stream")
        finally:
            self.gen.close()
        yield "data: [DONE]\n\n"
