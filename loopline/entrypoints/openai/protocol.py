"""OpenAI-compatible request and response models (pydantic) and their mapping to ``SamplingParams``.

Requests accept the OpenAI fields, vLLM's and loopline's extra fields: ``fields.py``
decides each one (honoured, or refused with a 400 naming it); an unknown field is
refused too, never silently ignored. Type errors come from pydantic; range errors
come from ``SamplingParams``, which names the offending field. All become HTTP 400
with an OpenAI error body.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loopline.entrypoints.openai.fields import SAMPLING_FIELDS, FieldRefused, check_fields
from loopline.errors import InvalidRequestError
from loopline.sampling_params import SamplingParams
from loopline.structured.params import StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send ``null`` for "use the default" (``"n": null``, ``"stream": null``)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].default is None}
        return data


class StrictRequest(OpenAIBaseModel):
    """A JSON request body: no coercion, so ``true`` is not an integer and ``"2"`` is not a number.

    NOTE: integers are still accepted for float fields (JSON has one number type); the RL
    routes keep the lax base model because their fields may come from a query string.
    """

    model_config = ConfigDict(extra="allow", strict=True)


# Chat roles the chat templates render ("tool": a tool's result, with the tool_call_id it answers).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128  # tools one request may offer
MAX_TOOL_BYTES = 64 * 1024  # one tool's JSON (name, description, parameters schema)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# --- errors ---------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --- requests -------------------------------------------------------------------------
class ClosedRequest(StrictRequest):
    """A request body whose every field is decided (``fields.FIELDS``): nothing unknown is accepted."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ROUTE: ClassVar[str | None] = None  # the route whose field table checks the body first

    @classmethod
    def check_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with its neutral refused fields dropped; a 400 for a refused or unknown field."""
        try:
            return check_fields(cls.ROUTE, data) if cls.ROUTE else data
        except FieldRefused as e:
            raise APIError(400, e.message, param=e.param, code=e.code) from None


class StreamOptions(ClosedRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ExtraSamplingFields(ClosedRequest):
    """loopline's extra request fields (not in OpenAI's API), shared by both endpoints."""

    top_k: int | None = None  # unset: the model's default (generation_config.json), else 0
    min_p: float | None = None  # unset: the model's default, else 0.0
    repetition_penalty: float | None = None  # unset: the model's default, else 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_mode: str | None = None  # loopline: threshold | fixed | lookahead (None: the engine's --exit-mode)
    lookahead_threshold: float | None = None  # loopline: the lookahead head's threshold (None: its calibrated one)
    latent_seed: int = 0  # loopline: Huginn's latent initial state's seed (docs/model-families.md)
    speculate: bool = True  # loopline: False keeps this request out of loop self-speculation
    priority: int = 0
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    logprobs_mode: str | None = None
    prompt_logprobs: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None  # prefix-cache pages are shared only between requests of equal salts


ALL_LOGPROBS = 1 << 30  # show every logprob the engine sent (logprobs -1, logprob_token_ids)
# SamplingParams fields the engine may not have yet (fields.ENGINE_FIELDS); passed only when set.
_ENGINE_KWARGS = ("min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                  "logprob_token_ids")
# The legacy guided_* fields and the StructuredOutputsParams field each one sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _CommonRequest(ExtraSamplingFields):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational: the request log line names it
    # SamplingParams fields that may be missing from the engine (fields.py refuses them then)
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    logprob_token_ids: list[int] | None = None
    # structured outputs (and their legacy aliases)
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
        if self.request_id is not None:
            check_request_id(self.request_id, "request_id")

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from exactly one of ``structured_outputs``, a non-text
        ``response_format`` or the ``guided_*`` fields (several: a 400 naming the second)."""
        sources: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            sources.append(("structured_outputs", dict(self.structured_outputs)))
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                sources.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                    raise InvalidRequestError("response_format json_schema needs json_schema.schema (an object)",
                                              param="response_format.json_schema")
                sources.append(("response_format", {"json": js["schema"]}))
            elif kind != "text":
                raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                          f"got {kind!r:.60}", param="response_format.type")
        for name, key in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                sources.append((name, {key: value}))
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in ("xgrammar", "auto"):
            raise InvalidRequestError(f"guided_decoding_backend must be 'xgrammar' or 'auto' (loopline's one grammar "
                                      f"backend), got {self.guided_decoding_backend!r:.60}",
                                      param="guided_decoding_backend")
        if len(sources) > 1:
            raise InvalidRequestError(f"{sources[0][0]} and {sources[1][0]} both constrain the output; send one",
                                      param=sources[1][0])
        if self.guided_whitespace_pattern is not None:
            spec = sources[0][1] if sources else {}
            if "json" not in spec and not spec.get("json_object"):
                raise InvalidRequestError("guided_whitespace_pattern needs a JSON constraint",
                                          param="guided_whitespace_pattern")
            spec["whitespace_pattern"] = self.guided_whitespace_pattern
        if not sources:
            return None
        name, spec = sources[0]
        try:
            return StructuredOutputsParams.from_dict(spec)
        except InvalidRequestError as e:
            if name == "structured_outputs":
                raise
            raise InvalidRequestError(f"{name}: {e}", param=name) from None

    def _engine_kwargs(self) -> dict[str, Any]:
        """The set fields among ``_ENGINE_KWARGS`` (``fields.py`` refused those the engine lacks)."""
        out: dict[str, Any] = {}
        for name in _ENGINE_KWARGS:
            value = getattr(self, name)
            if value is None or name not in SAMPLING_FIELDS:
                continue
            if name == "logit_bias":
                try:
                    value = {int(k): v for k, v in value.items()}
                except ValueError:
                    raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                              param="logit_bias") from None
            out[name] = value
        return out

    def _sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                  defaults: dict[str, Any] | None = None) -> SamplingParams:
        """``defaults``: the model's request defaults (``AsyncLLM.sampling_defaults``), for the fields
        the request leaves unset, as vLLM applies a model's generation_config."""
        self._check_unsupported()
        d = defaults or {}

        def pick(name: str, value: Any) -> Any:  # else the model's default, else SamplingParams' own
            return value if value is not None else d.get(name, SamplingParams.__dataclass_fields__[name].default)

        structured = self.structured()
        return SamplingParams(
            n=self.n, max_tokens=max_tokens if max_tokens is not None else d.get("max_tokens"),
            temperature=pick("temperature", self.temperature), top_p=pick("top_p", self.top_p),
            top_k=pick("top_k", self.top_k), min_p=pick("min_p", self.min_p), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, priority=self.priority,
            min_loops=self.min_loops, max_loops=self.max_loops, exit_threshold=self.exit_threshold,
            exit_mode=self.exit_mode, lookahead_threshold=self.lookahead_threshold, latent_seed=self.latent_seed,
            speculate=self.speculate, logprobs_mode=self.logprobs_mode, **({"structured_outputs": structured} if structured else {}),
            **self._engine_kwargs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""

    ROUTE: ClassVar[str | None] = "completions"
    prompt: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings and token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [_nonempty_text(p)]
        if isinstance(p, list) and p:
            if all(_is_int(t) for t in p):
                return [list(p)]
            if all(isinstance(s, str) for s in p):
                return [_nonempty_text(s) for s in p]
            if all(isinstance(s, list) for s in p):
                for ids in p:
                    if not ids or not all(_is_int(t) for t in ids):
                        raise InvalidRequestError("each token-id prompt must be a non-empty list of integers", param="prompt")
                return [list(ids) for ids in p]
        if p is None:
            raise InvalidRequestError("prompt is required", param="prompt")
        if isinstance(p, list) and not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids "
                                  "or a list of token-id lists", param="prompt")

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (it must be unset or equal to n)", param="best_of")
        if self.max_tokens is not None and _is_int(self.max_tokens) and self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 is allowed only with echo)", param="max_tokens")
        # echo with max_tokens=0 (eval harnesses scoring a prompt): generate one token and drop it.
        max_tokens = 1 if self.max_tokens == 0 else self.max_tokens
        if self.logprob_token_ids is not None and self.logprobs is None:
            raise InvalidRequestError("logprob_token_ids needs logprobs", param="logprob_token_ids")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        # as vLLM: logprob_token_ids replace the top logprobs
        logprobs = None if self.logprob_token_ids is not None else self.logprobs
        return self._sampling(max_tokens, logprobs, prompt_logprobs, defaults)

    @property
    def logprobs_shown(self) -> int:
        """How many ranked alternatives each ``top_logprobs`` entry shows (every one the engine sent for
        ``logprobs: -1`` or ``logprob_token_ids``)."""
        return ALL_LOGPROBS if self.logprob_token_ids is not None or self.logprobs == -1 else (self.logprobs or 0)


class TextPart(ClosedRequest):
    """One part of a message's ``content`` list: only text parts are supported."""

    type: Literal["text"]
    text: str


class ToolCallFunction(ClosedRequest):
    name: str
    arguments: str  # a JSON string (OpenAI's shape)


class ToolCallIn(ClosedRequest):
    """An assistant message's earlier tool call (passed to the chat template)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(ClosedRequest):
    """One chat message: a known role and its content (a string or text parts); assistant messages
    may carry ``tool_calls`` (then content may be null), ``tool`` messages the ``tool_call_id`` they answer."""

    role: str
    tool_call_id: str | None = Field(default=None, validate_default=True)
    tool_calls: list[ToolCallIn] | None = None
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {list(CHAT_ROLES)}, got {role!r}")
        return role

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: Any, info: Any) -> Any:
        role = info.data.get("role")
        if value is not None and role != "tool":
            raise ValueError("tool_call_id belongs on messages with role 'tool'")
        if value is None and role == "tool":
            raise ValueError("messages with role 'tool' need tool_call_id")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value: Any, info: Any) -> Any:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("tool_calls belong on messages with role 'assistant'")
        return value

    @field_validator("content")
    @classmethod
    def _has_content(cls, content: Any, info: Any) -> Any:
        if content is None and not info.data.get("tool_calls"):
            raise ValueError("content is required (a string or a list of text parts)")
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or [])

    def as_dict(self) -> dict[str, Any]:
        """The template's view: role, content and (when sent) name, tool_call_id, tool_calls."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class FunctionDefinition(ClosedRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"function names are 1 to 64 letters, digits, '_', '.' or '-', got {name!r:.80}")
        return name


class ChatTool(ClosedRequest):
    """An OpenAI function tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatTemplateInputs(ClosedRequest):
    """The fields that are chat template inputs (chat completions and ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The extra template variables: ``chat_template_kwargs`` plus the chat fields that are template inputs."""
        out = dict(self.chat_template_kwargs or {})
        for name in ("documents", "reasoning_effort"):
            value = getattr(self, name, None)
            if value is not None:
                out[name] = value
        return out


class ChatCompletionRequest(_CommonRequest, ChatTemplateInputs):
    """``POST /v1/chat/completions``: ``messages`` go through the checkpoint's chat template."""

    ROUTE: ClassVar[str | None] = "chat"
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    return_prompt_text: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _bounded_tools(cls, tools: Any) -> Any:
        if tools is None:
            return tools
        if len(tools) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
        names = set()
        for t in tools:
            if len(json.dumps(t.model_dump(exclude_none=True))) > MAX_TOOL_BYTES:
                raise ValueError(f"tool {t.function.name!r} is over {MAX_TOOL_BYTES} bytes of JSON")
            if t.function.name in names:
                raise ValueError(f"two tools are named {t.function.name!r}")
            names.add(t.function.name)
        return tools

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template (and the fallback preamble) sees them; None when there are none."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_mode(self, auto_enabled: bool) -> tuple[str, str | None]:
        """``(mode, function name)``: mode ``none`` (no tools, or answer in text), ``auto`` (the server's
        parser extracts calls), ``required`` or ``named`` (a constraint makes the output calls).
        Unset with tools: ``auto`` on a server started with --enable-auto-tool-choice, else ``none``."""
        choice = self.tool_choice
        if choice is not None and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if not self.tools:
            return "none", None
        if choice is None:
            return ("auto" if auto_enabled else "none"), None
        if choice in ("none", "auto", "required"):
            if choice == "auto" and not auto_enabled:
                raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                          "to be set (server flags)", param="tool_choice")
            return choice, None
        if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "function"} \
                and isinstance(choice.get("function"), dict) and set(choice["function"]) == {"name"}:
            name = choice["function"]["name"]
            if not any(t.function.name == name for t in self.tools):
                raise InvalidRequestError(f"tool_choice names function {name!r:.80}, which is not among tools",
                                          param="tool_choice.function.name")
            return "named", name
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                  '{"type": "function", "function": {"name": ...}}', param="tool_choice")

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of ``required`` (a JSON array of ``{name, arguments}``, one item at most
        when ``parallel_tool_calls`` is false) or a named function (its parameters schema); compact JSON."""
        mode, name = self.tool_mode(auto_enabled=True)
        tools = {t.function.name: (t.function.parameters or {"type": "object"}) for t in self.tools or []}
        if mode == "named":
            schema: dict[str, Any] = tools[name]
        elif mode == "required":
            items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False} for n, params in tools.items()]
            schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
        else:
            return None
        try:
            # compact JSON: a model free to emit whitespace may spend every token on it
            return StructuredOutputsParams.from_dict({"json": schema, "disable_any_whitespace": True})
        except InvalidRequestError as e:
            raise InvalidRequestError(f"tools: {e}", param="tools") from None

    def structured(self) -> StructuredOutputsParams | None:
        own = super().structured()
        tool = self.tool_constraint()
        if tool is not None and own is not None:
            raise InvalidRequestError("tool_choice 'required' or a named function constrains the output, and so does "
                                      "a structured-outputs field: send one", param="tool_choice")
        return tool or own

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return [m.as_dict() for m in self.messages]

    def response_role(self, generation_role: str = "assistant") -> str:
        """vLLM's: ``generation_role`` (the server's ``--response-role``) after a generation prompt, else the
        last message's role (it is continued)."""
        return generation_role if self.add_generation_prompt or not self.messages else self.messages[-1].role

    def echoed(self, generation_role: str = "assistant") -> str:
        """With ``echo``: the last message's content when it has the response's role (else nothing)."""
        if self.echo and self.messages and self.messages[-1].role == self.response_role(generation_role):
            return self.messages[-1].text()
        return ""

    @property
    def logprobs_shown(self) -> int:
        """How many ranked alternatives each token's ``top_logprobs`` shows."""
        return ALL_LOGPROBS if self.logprob_token_ids is not None or self.top_logprobs == -1 else (self.top_logprobs or 0)

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise InvalidRequestError("logprob_token_ids needs logprobs=true", param="logprob_token_ids")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        try:
            logprobs = (self.top_logprobs or 0) if self.logprobs and self.logprob_token_ids is None else None
            return self._sampling(max_tokens, logprobs, self.prompt_logprobs, defaults=defaults)
        except InvalidRequestError as e:  # name the field the client sent
            if e.param == "max_tokens" and self.max_completion_tokens is not None:
                raise InvalidRequestError(str(e).replace("max_tokens", "max_completion_tokens"),
                                          param="max_completion_tokens") from None
            if e.param == "logprobs":
                raise InvalidRequestError(str(e).replace("logprobs", "top_logprobs"), param="top_logprobs") from None
            raise


class TokenizeRequest(ChatTemplateInputs):
    """``POST /tokenize``: ``prompt`` (a string) or ``messages`` (through the chat template)."""

    ROUTE: ClassVar[str | None] = "tokenize"
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for prompt, false for messages (vLLM's defaults)
    return_token_strs: bool = False


class DetokenizeRequest(ClosedRequest):
    model: str | None = None
    tokens: list[int]


# --- responses ------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served (Generation.usage_info)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


# vLLM's prompt_logprobs: per prompt token (the first is null) {token id: {logprob, rank, decoded_token}}
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] = Field(default_factory=list)  # loopline: loop at which each token exited
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (streams: in the first chunk)
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # {id, type: function, function: {name, arguments}}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] = Field(default_factory=list)
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # {index, id, type, function: {name, arguments}}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] = Field(default_factory=list)
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunk
    prompt_text: str | None = None  # with return_prompt_text: in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loopline"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


MAX_REQUEST_ID_LEN = 256


def check_request_id(rid: Any, param: str) -> str:
    """A client-chosen request id: a non-empty printable ASCII string of at most 256 characters.

    NOTE: ids are logged and echoed; control characters would forge log lines.
    """
    if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID_LEN or not rid.isascii() \
            or not rid.isprintable():
        raise InvalidRequestError(f"{param} entries must be non-empty printable ASCII strings of at most "
                                  f"{MAX_REQUEST_ID_LEN} characters, got {rid!r:.80}", param=param)
    return rid


def _nonempty_text(s: str) -> str:
    if not s:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return s


class APIError(Exception):
    """An error the server answers with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()
