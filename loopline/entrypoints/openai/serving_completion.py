"""``POST /v1/completions``: non-streamed responses (from final outputs) and SSE streams (from ``DELTA`` outputs)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from loopline.entrypoints.openai.generation import ChunkTracker, Generation, ServingContext, salted
from loopline.engine import PromptType
from loopline.entrypoints.openai.logprobs import TextOffsets, completion_logprobs, vllm_prompt_logprobs
from loopline.entrypoints.openai.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest,
                                                  CompletionResponse, UsageInfo)
from loopline.entrypoints.openai.sse import error_event, sse_model
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    params = req.to_sampling_params(ctx.llm.sampling_defaults)
    prompts: list[PromptType] = list(req.prompts())
    ctx.check_num_prompts(len(prompts), "prompt")
    if req.add_special_tokens and ctx.tokenizer_adds_special_tokens() and any(isinstance(p, str) for p in prompts):
        # the engine tokenizes text without special tokens: this tokenizer adds some, so tokenize here
        texts = [p for p in prompts if isinstance(p, str)]
        ids = iter(await ctx.llm.tokenizers.encode_many(texts, add_special_tokens=True))
        prompts = [{"prompt": p, "prompt_token_ids": next(ids)} if isinstance(p, str) else p for p in prompts]
    if req.cache_salt is not None:
        prompts = [salted(p, req.cache_salt) for p in prompts]
    gen = ctx.new_generation("cmpl", len(prompts), base_id=req.request_id)
    gen.user = req.user
    raw.state.generation = gen
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    await ctx.start(raw, gen, prompts, params, kind=kind)  # a validation error propagates (the generation closed itself)
    view = _CompletionView(ctx, req, gen, params)
    return await ctx.respond(raw, gen, req.stream, view.stream, lambda outs: view.response(outs).model_dump())


class _CompletionView:
    """Formats one completion request's engine outputs (final ones whole, or ``DELTA`` ones as chunks)."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, gen: Generation, params: SamplingParams) -> None:
        self.ctx, self.req, self.gen, self.params = ctx, req, gen, params
        self.n = req.n
        self.echo_only = req.echo and req.max_tokens == 0  # one token was generated; drop it
        self.created = int(time.time())
        self.id = gen.id
        self._text_offsets: dict[tuple[str, int], TextOffsets] = {}

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.ctx.llm.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _generated(self, comp: CompletionOutput):
        """(token ids, logprob entries, exit depths) of ``comp``'s generated tokens (all of them, or a
        ``DELTA``'s new ones)."""
        if self.echo_only:
            return [], [], []
        return comp.token_ids, comp.logprobs if comp.logprobs is not None else [], comp.exit_depths

    def _prompt_part(self, out: RequestOutput):
        ids = out.prompt_token_ids
        return ids, list(out.prompt_logprobs) if out.prompt_logprobs is not None else [None] * len(ids)

    def _logprobs(self, out: RequestOutput, comp: CompletionOutput, ids: list[int], entries: list,
                  first: bool, start: int, all_ids: list[int]) -> CompletionLogProbs:
        """Logprobs of ``ids`` (the echoed prompt when ``first`` and echo, then generated tokens from
        ``start``), with offsets into the choice's whole text (prompt + completion under echo);
        ``all_ids``: the choice's generated tokens so far."""
        namer = self.ctx.token_namer.for_request(self.req.return_tokens_as_token_ids)
        base, offsets = 0, []
        if self.req.echo:
            prompt_ids = out.prompt_token_ids
            base = len(self._prompt_text(out))
            if first:
                offsets = namer.text_offsets(prompt_ids, 0, len(prompt_ids))
        n_gen = len(ids) - len(offsets)
        # one TextOffsets per choice, kept across stream chunks: each chunk costs its own tokens only
        key = (out.request_id, comp.index)
        gen = self._text_offsets.setdefault(key, namer.offsets(self.params.skip_special_tokens))
        offsets += [base + o for o in gen.of(all_ids, start, start + n_gen)]
        return completion_logprobs(namer, ids, entries, offsets, self.req.logprobs_shown)

    def _usage(self) -> UsageInfo:
        return self.gen.usage_info(0 if self.echo_only else None)

    def _prompt_logprobs(self, out: RequestOutput):
        """vLLM's ``prompt_logprobs`` when the request asked for them (``null`` otherwise)."""
        if self.req.prompt_logprobs is None:
            return None
        namer = self.ctx.token_namer.for_request(self.req.return_tokens_as_token_ids)
        return vllm_prompt_logprobs(out.prompt_logprobs, namer)

    # --- whole response -------------------------------------------------------------------
    def response(self, outs: list[RequestOutput]) -> CompletionResponse:
        req = self.req
        choices = []
        for p, out in enumerate(outs):
            for comp in out.outputs:
                ids, entries, depths = self._generated(comp)
                text = "" if self.echo_only else comp.text
                logprobs = None
                if req.echo:
                    prompt_ids, prompt_entries = self._prompt_part(out)
                    ids, entries, text = prompt_ids + ids, prompt_entries + entries, self._prompt_text(out) + text
                if req.logprobs is not None:
                    logprobs = self._logprobs(out, comp, ids, entries, first=True, start=0, all_ids=comp.token_ids)
                choices.append(CompletionChoice(
                    index=p * self.n + comp.index, text=text, logprobs=logprobs,
                    finish_reason="length" if self.echo_only else comp.finish_reason, stop_reason=comp.stop_reason,
                    exit_depths=depths, prompt_logprobs=self._prompt_logprobs(out),
                    prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None,
                    token_ids=self._generated(comp)[0] if req.return_token_ids else None))
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                  usage=self._usage())

    # --- stream ---------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        req, gen = self.req, self.gen
        chunks = ChunkTracker()
        try:
            async for out in gen.outputs():  # DELTA outputs: each completion holds what it added
                p = gen.prompt_index(out.request_id)
                for comp in out.outputs:  # one choice per chunk (as vLLM)
                    c = chunks.chunk(p, comp)
                    if c is None:
                        continue
                    ids, entries, depths = self._generated(comp)
                    text = "" if self.echo_only else comp.text
                    if c.first and req.echo:
                        prompt_ids, prompt_entries = self._prompt_part(out)
                        ids, entries, text = prompt_ids + ids, prompt_entries + entries, self._prompt_text(out) + text
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self._logprobs(out, comp, ids, entries, first=c.first and req.echo,
                                                  start=c.start_token, all_ids=chunks.token_ids(p, comp))
                    finish = comp.finish_reason and ("length" if self.echo_only else comp.finish_reason)
                    choice = CompletionChoice(
                        index=p * self.n + comp.index, text=text, logprobs=logprobs, finish_reason=finish,
                        stop_reason=comp.stop_reason, exit_depths=depths,
                        prompt_logprobs=self._prompt_logprobs(out) if c.first else None,
                        prompt_token_ids=out.prompt_token_ids if req.return_token_ids and c.first else None,
                        token_ids=self._generated(comp)[0] if req.return_token_ids else None)
                    yield sse_model(CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name,
                                                       choices=[choice],
                                                       usage=self._usage() if req.continuous_usage else None))
            if req.include_usage:
                yield sse_model(CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name,
                                                   choices=[], usage=self._usage()))
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield error_event(e, "stream")
        finally:
            gen.close()
        yield "data: [DONE]\n\n"
