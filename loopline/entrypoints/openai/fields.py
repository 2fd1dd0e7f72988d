"""Every request field of ``/v1/completions``, ``/v1/chat/completions`` and ``/tokenize``: honoured or refused.

One table per route (:data:`FIELDS`) decides each field a client may send: the
OpenAI fields, vLLM's fields (its ``CompletionRequest`` / ``ChatCompletionRequest``
/ ``TokenizeChatRequest``, including legacy names clients still send) and
loopline's own. A field is

* honoured: it reaches ``SamplingParams`` or the request handling, or
* refused: sending it with any value other than the ``neutral`` ones (values
  that change nothing, such as ``use_beam_search: false``; ``null`` always is)
  is an HTTP 400 naming the field (``param``) and saying why.

A field that is in no table is refused too (400, ``code: unknown_field``):
nothing a client sends is silently ignored. NOTE: OpenAI's client sends only
the fields a caller sets, so refusing unknown names costs compatibility only
for callers that already asked for something loopline would not do.

Some fields map onto ``SamplingParams`` fields that the engine may not have yet
(:data:`ENGINE_FIELDS`): they are honoured when ``dataclasses.fields(SamplingParams)``
has them at import time, and refused ("not supported by this engine") otherwise.
``docs/serving.md`` lists the same decisions (a test keeps the two equal).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loopline.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class FieldRule:
    """The decision for one request field: ``honoured``, and what it does or why it is refused."""

    name: str
    honoured: bool
    note: str
    neutral: tuple = ()  # refused fields: values that change nothing (accepted and dropped); null always is
    engine: str | None = None  # the SamplingParams field it needs (honoured only when the engine has it)


def _ok(name: str, note: str) -> FieldRule:
    return FieldRule(name, True, note)


def _no(name: str, note: str, *neutral: Any) -> FieldRule:
    return FieldRule(name, False, note, tuple(neutral))


def _engine(name: str, note: str, *neutral: Any) -> FieldRule:
    """A field that maps onto ``SamplingParams.<name>``: honoured when the engine has it (``build_fields``)."""
    return FieldRule(name, True, note, tuple(neutral), engine=name)


def _resolve(rule: FieldRule, sampling_fields: frozenset[str]) -> FieldRule:
    if rule.engine is None or rule.engine in sampling_fields:
        return rule
    return dataclasses.replace(rule, honoured=False,
                               note=f"not supported by this engine (SamplingParams has no {rule.engine}); {rule.note}")


# --- shared by both generation routes --------------------------------------------------------
_SAMPLING = [
    _ok("model", "must name the served model (404 otherwise)"),
    _ok("max_tokens", "SamplingParams.max_tokens"),
    _ok("n", "SamplingParams.n"),
    _ok("temperature", "SamplingParams.temperature (unset: the model's generation_config, else 1.0)"),
    _ok("top_p", "SamplingParams.top_p (unset: the model's default)"),
    _ok("top_k", "SamplingParams.top_k (unset: the model's default)"),
    _ok("min_p", "SamplingParams.min_p (unset: the model's default)"),
    _ok("repetition_penalty", "SamplingParams.repetition_penalty (unset: the model's default)"),
    _ok("presence_penalty", "SamplingParams.presence_penalty"),
    _ok("frequency_penalty", "SamplingParams.frequency_penalty"),
    _ok("seed", "SamplingParams.seed (choice i uses seed + i)"),
    _ok("stop", "SamplingParams.stop"),
    _ok("stop_token_ids", "SamplingParams.stop_token_ids"),
    _ok("ignore_eos", "SamplingParams.ignore_eos"),
    _ok("include_stop_str_in_output", "SamplingParams.include_stop_str_in_output"),
    _ok("skip_special_tokens", "SamplingParams.skip_special_tokens"),
    _ok("prompt_logprobs", "SamplingParams.prompt_logprobs; the response carries them in vLLM's shape"),
    _ok("priority", "SamplingParams.priority (with --scheduling-policy priority)"),
    _ok("stream", "server-sent events"),
    _ok("stream_options", "include_usage (a last usage chunk) and continuous_usage_stats (usage on every chunk)"),
    _ok("user", "informational: written to the request's log line (it changes no output)"),
    _ok("request_id", "the response id becomes cmpl- or chatcmpl- followed by it; the engine request ids follow it"),
    _ok("return_token_ids", "token_ids per choice, prompt_token_ids (streams: in the first chunk)"),
    _ok("return_tokens_as_token_ids", "logprob tokens named token_id:<id> (unset: the server's flag)"),
    _engine("min_tokens", "SamplingParams.min_tokens", 0),
    _engine("logit_bias", "SamplingParams.logit_bias (keys: token ids as strings)", {}),
    _engine("allowed_token_ids", "SamplingParams.allowed_token_ids"),
    _engine("bad_words", "SamplingParams.bad_words", []),
    _engine("truncate_prompt_tokens", "SamplingParams.truncate_prompt_tokens (keeps the last N prompt tokens)"),
    _engine("logprob_token_ids", "SamplingParams.logprob_token_ids"),
    _ok("structured_outputs", "SamplingParams.structured_outputs (json, regex, choice, grammar, json_object)"),
    _ok("response_format", "text: no constraint; json_object / json_schema: SamplingParams.structured_outputs"),
    _ok("guided_json", "legacy alias of structured_outputs.json"),
    _ok("guided_regex", "legacy alias of structured_outputs.regex"),
    _ok("guided_choice", "legacy alias of structured_outputs.choice"),
    _ok("guided_grammar", "legacy alias of structured_outputs.grammar"),
    _ok("guided_whitespace_pattern", "legacy alias of structured_outputs.whitespace_pattern (with a JSON constraint)"),
    _ok("guided_decoding_backend", "only 'xgrammar' or 'auto' (loopline's one grammar backend)"),
    # loopline's own fields
    _ok("min_loops", "loopline: SamplingParams.min_loops"),
    _ok("max_loops", "loopline: SamplingParams.max_loops"),
    _ok("exit_threshold", "loopline: SamplingParams.exit_threshold"),
    _ok("exit_mode", "loopline: SamplingParams.exit_mode (threshold, fixed, lookahead; unset: the engine's)"),
    _ok("lookahead_threshold", "loopline: SamplingParams.lookahead_threshold (exit_mode lookahead)"),
    _ok("latent_seed", "loopline: SamplingParams.latent_seed (Huginn's latent initial state; default 0)"),
    _ok("logprobs_mode", "loopline: SamplingParams.logprobs_mode"),
    _ok("speculate", "loopline: SamplingParams.speculate (false: no loop self-speculation for this request)"),
    _ok("cache_salt", "the prompt's prefix-cache salt: cached pages are shared only between requests of equal salts"),
    # refused
    _no("use_beam_search", "beam search is not supported", False),
    _no("length_penalty", "only beam search uses it, and beam search is not supported", 1.0, 1),
    _no("watermarking", "watermarking is not supported", False),
    _no("spaces_between_special_tokens", "detokenization never inserts spaces between special tokens", True),
    _no("truncation_side", "truncate_prompt_tokens keeps the last tokens ('left') only", "left"),
    _no("session_id", "loopline keeps no per-session state"),
    _no("kv_transfer_params", "no KV-transfer connector (disaggregation is loopline's own, see docs)"),
    _no("ec_transfer_params", "no encoder-cache transfer (text-only models)"),
    _no("vllm_xargs", "no custom extensions read extra arguments", {}),
    _no("repetition_detection", "repetition detection is not supported"),
    _no("thinking_token_budget", "thinking budgets are not supported", -1),
    _no("stream_interval", "streams send every step's progress (interval 1 only)", 1),
    _no("routed_experts_prompt_start", "looped models have no routed experts", 0),
    _no("return_token_offsets", "only vLLM's render endpoints return offsets; loopline has none", False),
    _no("return_mm_kwargs", "no multimodal inputs (text-only models)", True),
    _no("logits_processors", "custom logits processors are not supported", []),
]

COMPLETION_FIELDS = [
    _ok("prompt", "a string, strings, token ids or token-id lists"),
    _ok("echo", "the prompt (and with logprobs its logprobs) before the completion"),
    _ok("logprobs", "SamplingParams.logprobs (0..20), legacy completions format"),
    _ok("best_of", "only unset or equal to n (400 otherwise: no server-side best-of selection)"),
    _ok("add_special_tokens", "text prompts tokenized with the tokenizer's special tokens (default true, as vLLM)"),
    _no("suffix", "insertion (fill-in-the-middle) is not supported"),
    _no("prompt_embeds", "embedding prompts are not supported"),
]

CHAT_FIELDS = [
    _ok("messages", "rendered by the checkpoint's chat template"),
    _ok("logprobs", "SamplingParams.logprobs with top_logprobs (chat format)"),
    _ok("top_logprobs", "SamplingParams.logprobs (0..20; needs logprobs=true)"),
    _ok("max_completion_tokens", "SamplingParams.max_tokens (wins over max_tokens)"),
    _ok("echo", "the last message's content is prepended when it has the response's role (vLLM's meaning)"),
    _ok("add_generation_prompt", "chat template input (default true)"),
    _ok("continue_final_message", "chat template input: the last message stays open and is continued"),
    _ok("add_special_tokens", "special tokens added on top of the template's (default false)"),
    _ok("chat_template_kwargs", "chat template inputs (each key must be a variable the template uses)"),
    _ok("documents", "chat template input (400 when the template does not use documents)"),
    _ok("reasoning_effort", "chat template input (400 when the template does not use reasoning_effort)"),
    _ok("chat_template", "only with --trust-request-chat-template (templates run loops: 400 otherwise)"),
    _ok("return_prompt_text", "prompt_text (the rendered template) in the response or the first chunk"),
    _ok("tools", "OpenAI function tools (at most 128), passed to the chat template (or the hermes fallback preamble)"),
    _ok("tool_choice", "none, auto (needs --enable-auto-tool-choice and --tool-call-parser), required or a named "
                       "function (both enforced with a JSON-schema constraint); needs tools"),
    _ok("parallel_tool_calls", "false: at most one tool call"),
    _no("include_reasoning", "no reasoning parser: reasoning stays in content", True),
    _no("mm_processor_kwargs", "no multimodal inputs (text-only models)", {}),
    _no("media_io_kwargs", "no multimodal inputs (text-only models)", {}),
    _no("max_repetition_pattern_size", "repetition detection is not supported", 0),
    _no("min_repetition_pattern_size", "repetition detection is not supported", 0),
    _no("repetition_min_count", "repetition detection is not supported", 0),
]

TOKENIZE_FIELDS = [
    _ok("model", "must name the served model (404 otherwise)"),
    _ok("prompt", "text to tokenize (or messages)"),
    _ok("messages", "a conversation, rendered by the chat template"),
    _ok("add_special_tokens", "default true for prompt, false for messages (as vLLM)"),
    _ok("add_generation_prompt", "chat template input (default true)"),
    _ok("continue_final_message", "chat template input"),
    _ok("chat_template_kwargs", "chat template inputs (each key must be a variable the template uses)"),
    _ok("chat_template", "only with --trust-request-chat-template"),
    _ok("return_token_strs", "token_strs: each token's string"),
    _no("tools", "/tokenize does not render tools yet (/v1/chat/completions does)", []),
    _no("mm_processor_kwargs", "no multimodal inputs (text-only models)", {}),
]


def _table(rules: list[FieldRule]) -> dict[str, FieldRule]:
    out: dict[str, FieldRule] = {}
    for r in rules:
        assert r.name not in out, f"{r.name} decided twice"
        out[r.name] = r
    return out


def build_fields(sampling_fields: frozenset[str] = SAMPLING_FIELDS) -> dict[str, dict[str, FieldRule]]:
    """The tables for an engine whose ``SamplingParams`` has ``sampling_fields``."""
    rules = {"completions": [*COMPLETION_FIELDS, *_SAMPLING], "chat": [*CHAT_FIELDS, *_SAMPLING],
             "tokenize": TOKENIZE_FIELDS}
    return {route: _table([_resolve(r, sampling_fields) for r in rs]) for route, rs in rules.items()}


FIELDS: dict[str, dict[str, FieldRule]] = build_fields()
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize"}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


class FieldRefused(ValueError):
    """A request field that is refused (``code`` ``unsupported_field``) or unknown (``unknown_field``);
    ``param`` names it. The request models answer it with a 400 (``protocol.ClosedRequest.check_fields``)."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_fields(route: str, data: dict[str, Any],
                 fields: dict[str, dict[str, FieldRule]] | None = None) -> dict[str, Any]:
    """``data`` without its neutral refused fields; raises :class:`FieldRefused` naming the first field
    that is refused (with a value that would change something) or unknown."""
    table = (fields or FIELDS)[route]
    out = {}
    for key, value in data.items():
        rule = table.get(key)
        if rule is None:
            raise FieldRefused(f"unknown field {key!r:.80}: {ROUTES[route]} takes the OpenAI and vLLM fields listed "
                               "in docs/serving.md (an unknown field is refused, never ignored)",
                               param=str(key)[:80], code="unknown_field")
        if rule.honoured:
            out[key] = value
        elif not _is_neutral(value, rule.neutral):
            raise FieldRefused(f"{key} is not supported: {rule.note}", param=key, code="unsupported_field")
    return out


def markdown_table(route: str, fields: dict[str, dict[str, FieldRule]] | None = None) -> str:
    """The doc's table of ``route``'s fields (``docs/serving.md`` holds these, kept equal by a test)."""
    lines = ["| field | decision |", "|---|---|"]
    for name, rule in sorted((fields or FIELDS)[route].items()):
        if rule.engine:  # the same text whether or not this engine has the field yet
            what = f"{rule.note.split('; ', 1)[-1]} (a 400 on an engine without SamplingParams.{rule.engine})"
            decision = "honoured"
        else:
            what, decision = rule.note, "honoured" if rule.honoured else "**refused**"
        lines.append(f"| `{name}` | {decision}: {what.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)
