"""``POST /generate``: token-in / token-out generation for RL trainers, shaped like SGLang's ``/generate``.

Request::

    {"input_ids": [ids] | [[ids], ...]   (or "text": str | [str]),
     "sampling_params": {...} | [{...} per prompt],
     "return_logprob": false, "top_logprobs_num": 0, "rid": "id" | ["id", ...], "stream": false}

``sampling_params`` takes vLLM's names and SGLang's where they differ
(``max_new_tokens`` = ``max_tokens``, ``sampling_seed`` = ``seed``,
``no_stop_trim`` = ``include_stop_str_in_output``, ``min_new_tokens`` = ``min_tokens``),
plus ``logprobs``, ``logprobs_mode``, ``logit_bias`` and the loop fields. Structured
outputs take SGLang's fields (``json_schema`` as JSON text or an object, ``regex``,
``ebnf``) or vLLM's ``structured_outputs`` object, one constraint per request;
SGLang's ``structural_tag`` is refused. Every completion comes back as::

    {"text", "output_ids", "output_token_logprobs" (flat, 1:1 with output_ids, or null),
     "exit_depths", "finish_reason", "stop_reason", "weight_version", "weight_versions",
     "seed", "index", "rid",
     "meta_info": {"id", "finish_reason": {"type": ...}, "prompt_tokens", "completion_tokens",
                   "weight_version" (a string, as SGLang's), "e2e_latency",
                   "output_token_logprobs": [[logprob, token_id, null], ...], "output_top_logprobs"}}

One prompt with ``n = 1`` answers one object; otherwise a list, prompt-major
(``n`` completions per prompt). With ``stream``: server-sent events, each the
cumulative object of one completion that progressed, then ``data: [DONE]`` (built
from ``CUMULATIVE`` outputs: each event is the whole completion anyway).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from loopline.engine import PromptType
from loopline.entrypoints.openai.generation import Generation, ServingContext
from loopline.entrypoints.openai.logprobs import finite
from loopline.entrypoints.openai.protocol import StrictRequest, check_request_id
from loopline.entrypoints.openai.sse import error_event, sse_event
from loopline.errors import InvalidRequestError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Fields a client may send that loopline cannot honour: refused when set, never ignored.
_UNSUPPORTED = ("structural_tag",)


_SGLANG_NAME = {"json": "json_schema", "regex": "regex", "grammar": "ebnf"}


class GenerateSamplingParams(StrictRequest):
    """``sampling_params`` of ``POST /generate`` (unknown fields are ignored, as elsewhere)."""

    max_new_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    sampling_seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logprobs_mode: str | None = None
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_mode: str | None = None
    lookahead_threshold: float | None = None
    priority: int = 0
    min_new_tokens: int | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs: SGLang's fields, or vLLM's object
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def to_sampling_params(self, default_logprobs: int | None, where: str = "sampling_params") -> SamplingParams:
        """The engine's ``SamplingParams``; ``where`` prefixes ``param`` in errors (``sampling_params[1]``)."""
        try:
            return self._to_sampling_params(default_logprobs)
        except InvalidRequestError as e:
            raise self.renamed(e, where) from None

    def renamed(self, e: InvalidRequestError, where: str = "sampling_params") -> InvalidRequestError:
        """``e`` (about an engine field) naming the field this object sent instead, under ``where``."""
        param, message = (e.param or "").removeprefix("sampling_params."), str(e).removeprefix("sampling_params.")
        sent = {"max_tokens": "max_new_tokens" if self.max_new_tokens is not None else "max_tokens",
                "seed": "sampling_seed" if self.seed is None and self.sampling_seed is not None else "seed",
                "min_tokens": "min_new_tokens" if self.min_tokens is None and self.min_new_tokens is not None
                else "min_tokens"}
        for kind, name in _SGLANG_NAME.items():
            if getattr(self, name) is not None and self.structured_outputs is None:
                sent[f"structured_outputs.{kind}"] = sent["structured_outputs"] = name
        if param in sent and sent[param] != param:  # name the field the client sent
            message, param = message.replace(param, sent[param], 1), sent[param]
        return InvalidRequestError(f"{where}.{message}", param=f"{where}.{param}" if param else where)

    def _to_sampling_params(self, default_logprobs: int | None) -> SamplingParams:
        extra = self.model_extra or {}
        for name in _UNSUPPORTED:
            if extra.get(name):
                raise InvalidRequestError(f"sampling_params.{name} is not supported", param=f"sampling_params.{name}")
        max_tokens = _same("max_new_tokens", self.max_new_tokens, "max_tokens", self.max_tokens)
        seed = _same("seed", self.seed, "sampling_seed", self.sampling_seed)
        min_tokens = _same("min_tokens", self.min_tokens, "min_new_tokens", self.min_new_tokens)
        return SamplingParams(
            n=self.n, max_tokens=DEFAULT_MAX_NEW_TOKENS if max_tokens is None else max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs if self.logprobs is not None else default_logprobs,
            logprobs_mode=self.logprobs_mode, priority=self.priority,
            min_loops=self.min_loops, max_loops=self.max_loops, exit_threshold=self.exit_threshold,
            exit_mode=self.exit_mode, lookahead_threshold=self.lookahead_threshold, min_tokens=min_tokens or 0, logit_bias=self.logit_bias, structured_outputs=self._structured())

    def _structured(self) -> dict[str, Any] | None:
        """The constraint as vLLM's ``structured_outputs`` object (``SamplingParams`` validates it);
        SGLang's fields map onto its kinds, and two constraints at once are refused naming both."""
        sglang = {kind: getattr(self, name) for kind, name in _SGLANG_NAME.items() if getattr(self, name) is not None}
        names = [_SGLANG_NAME[k] for k in sglang] + (["structured_outputs"] if self.structured_outputs else [])
        if len(names) > 1:
            raise InvalidRequestError(f"{names[-1]}: {' and '.join(names)} are set; send one constraint",
                                      param=names[-1])
        return sglang or self.structured_outputs


class GenerateRequest(StrictRequest):
    """``POST /generate`` (SGLang's shape, token ids in)."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] = Field(
        default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | list[str] | None = None
    stream: bool = False

    def prompts(self) -> tuple[list[PromptType], bool]:
        """``(prompts, single)``: token-id prompts (or texts), and whether one prompt came unbatched."""
        if (self.input_ids is None) == (self.text is None):
            raise InvalidRequestError("give exactly one of input_ids or text", param="input_ids")
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else list(self.text)
            if not texts or not all(texts):
                raise InvalidRequestError("text must be a non-empty string or a non-empty list of them", param="text")
            return texts, isinstance(self.text, str)
        ids = self.input_ids
        if not ids:
            raise InvalidRequestError("input_ids must not be empty", param="input_ids")
        if isinstance(ids[0], int):
            return [{"prompt_token_ids": list(ids)}], True
        if any(not p for p in ids):
            raise InvalidRequestError("each prompt in input_ids must be a non-empty list of token ids", param="input_ids")
        return [{"prompt_token_ids": list(p)} for p in ids], False

    def request_ids(self, num_prompts: int) -> list[str] | None:
        if self.rid is None:
            return None
        rids = [self.rid] if isinstance(self.rid, str) else list(self.rid)
        if len(rids) != num_prompts:
            raise InvalidRequestError(f"rid must give one id per prompt ({num_prompts}), got {len(rids)}", param="rid")
        for rid in rids:
            check_request_id(rid, "rid")
        if len(set(rids)) != len(rids):
            raise InvalidRequestError("rid entries must be distinct", param="rid")
        return rids

    def sampling(self, num_prompts: int) -> list[SamplingParams]:
        if not 0 <= self.top_logprobs_num <= 20:
            raise InvalidRequestError(f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}",
                                      param="top_logprobs_num")
        default_logprobs = self.top_logprobs_num if self.return_logprob else None
        per_prompt = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        if isinstance(self.sampling_params, list) and len(per_prompt) != num_prompts:
            raise InvalidRequestError(f"sampling_params must be one object, or one per prompt ({num_prompts}), "
                                      f"got {len(per_prompt)}", param="sampling_params")
        many = isinstance(self.sampling_params, list)
        params = [p.to_sampling_params(default_logprobs, f"sampling_params[{i}]" if many else "sampling_params")
                  for i, p in enumerate(per_prompt)]
        return params if len(params) == num_prompts else params * num_prompts


async def create_generate(ctx: ServingContext, req: GenerateRequest, raw: Request) -> Response:
    prompts, single = req.prompts()
    ctx.check_num_prompts(len(prompts), "input_ids" if req.input_ids is not None else "text")
    params = req.sampling(len(prompts))
    rids = req.request_ids(len(prompts))
    gen = ctx.new_generation("gen", len(prompts), request_ids=rids)
    raw.state.generation = gen
    start = time.monotonic()
    try:
        kind = RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY
        await ctx.start(raw, gen, prompts, params, kind=kind)  # a validation error propagates (it closed itself)
    except InvalidRequestError as e:
        if e.param == "request_id":  # name the field the client sent
            raise InvalidRequestError(str(e), param="rid") from None
        if (e.param or "").startswith("structured_outputs") and not isinstance(req.sampling_params, list):
            raise req.sampling_params.renamed(e) from None  # a constraint that does not compile
        raise

    def build(outs: list[RequestOutput]) -> Any:
        items = [completion_json(out, c, p, start) for out, p in zip(outs, params) for c in out.outputs]
        return items[0] if single and len(items) == 1 else items

    return await ctx.respond(raw, gen, req.stream, lambda: _stream(gen, params, start), build)


async def _stream(gen: Generation, params: list[SamplingParams], start: float) -> AsyncIterator[str]:
    sent: dict[tuple[str, int], int] = {}  # tokens already sent per completion
    try:
        async for out in gen.outputs():
            p = params[gen.prompt_index(out.request_id)]
            for c in out.outputs:
                key = (out.request_id, c.index)
                if key in sent and sent[key] == len(c.token_ids) and c.finish_reason is None:
                    continue
                sent[key] = len(c.token_ids)
                yield sse_event(completion_json(out, c, p, start))
    except Exception as e:  # headers are sent: report in-band
        yield error_event(e, "stream")
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


def completion_json(out: RequestOutput, c: CompletionOutput, params: SamplingParams, start: float) -> dict[str, Any]:
    """One completion in ``/generate``'s response shape (see the module docstring)."""
    lps = [finite(x) for x in c.token_logprobs] if c.logprobs is not None else None
    meta: dict[str, Any] = {
        "id": out.request_id, "finish_reason": _sglang_finish_reason(c), "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(c.token_ids), "weight_version": str(out.weight_version),
        "e2e_latency": time.monotonic() - start,
    }
    if lps is not None:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(lps, c.token_ids)]
        if params.logprobs:
            meta["output_top_logprobs"] = [
                [[finite(v.logprob), t, None] for t, v in sorted(step.items(), key=lambda kv: -kv[1].logprob)
                 if v.rank is not None and v.rank <= params.logprobs] for step in c.logprobs]
    return {
        "text": c.text, "output_ids": c.token_ids, "output_token_logprobs": lps, "exit_depths": c.exit_depths,
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "weight_version": out.weight_version,
        "weight_versions": c.weight_versions, "seed": c.seed, "index": c.index, "rid": out.request_id,
        "meta_info": meta,
    }


def _sglang_finish_reason(c: CompletionOutput) -> dict[str, Any] | None:
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
        return {"type": "stop", "matched": matched}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    return None


def _same(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None and value != alias_value:
        raise InvalidRequestError(f"sampling_params.{name} ({value}) and its alias {alias} ({alias_value}) differ",
                                  param=f"sampling_params.{name}")
    return value if value is not None else alias_value
