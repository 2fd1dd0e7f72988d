"""``POST /v1/chat/completions``: messages through the chat template; whole responses (from the final
output) or SSE chunks (from ``DELTA`` outputs)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from loopline.entrypoints.openai.generation import ChunkTracker, Generation, ServingContext
from loopline.entrypoints.openai.logprobs import chat_logprobs
from loopline.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatLogProbs, ChatResponseMessage,
                                                  ChatStreamChoice, DeltaMessage, UsageInfo)
from loopline.entrypoints.openai.sse import error_event, sse_model
from loopline.errors import InvalidRequestError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    params = req.to_sampling_params(ctx.llm.sampling_defaults)
    try:
        conversation, pool = req.conversation(), ctx.llm.tokenizers
        if pool is None:  # no tokenizer: encode_chat raises the clear error
            prompt_ids = ctx.llm.encode_chat(conversation, add_generation_prompt=req.add_generation_prompt)
        else:  # templates over long conversations take a while: off the event loop
            prompt_ids = await pool.encode_chat(conversation, add_generation_prompt=req.add_generation_prompt)
    except InvalidRequestError:
        raise
    except Exception as e:  # template errors (e.g. a role the template refuses)
        # NOTE: a template's own raise_exception() text is meant for the client; anything else
        # (a bug, a tokenizer failure) is internal, so only its type is named.
        detail = str(e) if type(e).__name__ == "TemplateError" else type(e).__name__
        raise InvalidRequestError(f"the chat template could not render messages: {detail:.300}",
                                  param="messages") from e
    gen = ctx.new_generation("chatcmpl", 1)
    raw.state.generation = gen
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    await ctx.start(raw, gen, [{"prompt_token_ids": prompt_ids}], params, chat_stop=True,
                    kind=kind)  # closes itself on a bad request
    view = _ChatView(ctx, req, gen, params)
    return await ctx.respond(raw, gen, req.stream, view.stream, lambda outs: view.response(outs[0]).model_dump())


class _ChatView:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, gen: Generation, params: SamplingParams) -> None:
        self.ctx, self.req, self.gen, self.params = ctx, req, gen, params
        self.created = int(time.time())
        self.top_k = req.top_logprobs or 0

    def _logprobs(self, comp: CompletionOutput) -> ChatLogProbs | None:
        """Logprobs of ``comp``'s tokens (all of them, or a ``DELTA``'s new ones)."""
        if not self.req.logprobs or comp.logprobs is None:
            return None
        namer = self.ctx.token_namer.for_request(self.req.return_tokens_as_token_ids)
        return ChatLogProbs(content=chat_logprobs(namer, comp.token_ids, comp.logprobs, self.top_k))

    def _usage(self) -> UsageInfo:
        prompt, generated = self.gen.usage()
        return UsageInfo(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        ids = self.req.return_token_ids
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=self._logprobs(c),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason, exit_depths=c.exit_depths,
                              token_ids=c.token_ids if ids else None) for c in out.outputs]
        return ChatCompletionResponse(id=self.gen.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(), prompt_token_ids=out.prompt_token_ids if ids else None)

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse_model(ChatCompletionChunk(id=self.gen.id, created=self.created, model=self.ctx.model_name,
                                             choices=choices, usage=usage))

    async def stream(self) -> AsyncIterator[str]:
        chunks = ChunkTracker()
        try:
            yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                               for i in range(self.params.n)])
            async for out in self.gen.outputs():  # DELTA outputs: each completion holds what it added
                choices = []
                for comp in out.outputs:
                    if chunks.chunk(0, comp) is None:
                        continue
                    choices.append(ChatStreamChoice(
                        index=comp.index, delta=DeltaMessage(content=comp.text), logprobs=self._logprobs(comp),
                        finish_reason=comp.finish_reason, stop_reason=comp.stop_reason, exit_depths=comp.exit_depths,
                        token_ids=comp.token_ids if self.req.return_token_ids else None))
                if choices:
                    yield self._chunk(choices)
            if self.req.include_usage:
                yield self._chunk([], self._usage())
        except Exception as e:  # headers are sent: report in-band
            yield error_event(e, "stream")
        finally:
            self.gen.close()
        yield "data: [DONE]\n\n"
