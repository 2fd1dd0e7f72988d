"""Chat prompts: the checkpoint's chat template, plus the ``<think>\\n`` the -Thinking variants expect.

Ouro-1.4B-Thinking and Ouro-2.6B-Thinking never open a reasoning block on
their own: their prompts must end with ``<|im_start|>assistant\\n<think>\\n``,
and their chat template does not add it (docs/design.md, 'Outputs'). :class:`ChatEncoder`
is the one place that renders chat prompts, for ``LLM.chat`` and for the HTTP
chat endpoint (and ``/tokenize`` with ``messages``): on a Thinking checkpoint
it appends ``<think>\\n`` after the assistant prefix when the rendered prompt
does not already end with an open ``<think>``.

A checkpoint counts as a Thinking variant when its directory name, its
``config.json`` ``_name_or_path`` or one of its ``architectures`` contains
"thinking" (any case). NOTE: the tokenizer is no evidence: base Ouro shares
the vocabulary, ``<think>`` included (it sometimes samples it itself).

Tools (``render(..., tools=...)``): a template that reads ``tools`` gets them (and the
messages as sent: ``tool`` messages, assistant ``tool_calls``), as ``apply_chat_template``
passes them. A template that does not (the bundled demo model's) gets the hermes-style
fallback instead (:func:`tools_fallback`): a system-prompt preamble listing the tools in
``<tools></tools>`` and asking for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(merged into the first system message, or a new one first); assistant ``tool_calls`` become
``<tool_call>`` blocks in their content and ``tool`` messages become ``user`` messages holding
``<tool_response>...</tool_response>`` (Qwen2.5's rendering of the same).

Every render runs under the budgets of :mod:`loopline.entrypoints.template_budget` (time, output
size, no unbounded single operation), the checkpoint's template and a request's alike.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from loopline.entrypoints.template_budget import TemplateBudgetError, bounded_render, check_template_source
from loopline.errors import InvalidRequestError

logger = logging.getLogger("loopline.api")

THINK_TOKEN = "<think>"
THINK_PREFIX = THINK_TOKEN + "\n"


def is_thinking_checkpoint(model_path: str | None, config_extra: dict[str, Any]) -> bool:
    """Whether the checkpoint is a -Thinking variant (see the module docstring for the rule)."""
    names = [Path(model_path).name if model_path else None, config_extra.get("_name_or_path")]
    architectures = config_extra.get("architectures")
    if isinstance(architectures, (list, tuple)):
        names += list(architectures)
    return any(isinstance(n, str) and "thinking" in n.lower() for n in names)


class ChatEncoder:
    """Turns a conversation into prompt token ids through the chat template (Thinking-aware)."""

    def __init__(self, tokenizer: Any, model_path: str | None, config_extra: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.thinking = tokenizer is not None and is_thinking_checkpoint(model_path, config_extra or {})

    @classmethod
    def for_engine(cls, engine: Any, tokenizer: Any = None) -> "ChatEncoder":
        """The encoder of an ``LLMEngine`` (``tokenizer``: a copy to use instead of the engine's)."""
        tok = tokenizer if tokenizer is not None else engine.tokenizer
        return cls(tok, engine.config.model_path, engine.model_config.extra)

    def render(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
               chat_template: str | None = None, *, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text: the template's rendering, with ``<think>\\n`` appended on Thinking checkpoints.

        ``continue_final_message``: the last message stays open (the model continues it);
        ``template_kwargs``: more template variables (``documents``, ``chat_template_kwargs``), each
        one the template uses (:meth:`check_template_kwargs`); ``tools``: OpenAI function tools (the
        template's own rendering when it reads ``tools``, else the hermes fallback: module docstring)."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("chat needs a tokenizer (the engine runs with skip_tokenizer_init=True)",
                                      param="messages")
        if not isinstance(conversation, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                         for m in conversation):
            raise InvalidRequestError("messages must be a list of {'role', 'content'} dicts", param="messages")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise InvalidRequestError("the checkpoint has no chat template", param="messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      param="continue_final_message")
        self.check_budgets(chat_template)
        extra: dict[str, Any] = dict(template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        if "tools" in self.template_variables(chat_template):
            if tools:
                extra["tools"] = tools
            conversation = [_with_argument_objects(m) for m in conversation]
        elif tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in conversation):
            conversation = tools_fallback(conversation, tools or [])
        text = bounded_render(lambda: tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            **extra))
        if self.thinking and add_generation_prompt and not text.rstrip().endswith(THINK_TOKEN):
            text += THINK_PREFIX
        return text

    def encode(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
               chat_template: str | None = None, *, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of :meth:`render`'s text (``add_special_tokens``: the tokenizer's on top of the template's)."""
        text = self.render(conversation, add_generation_prompt, chat_template,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs, tools=tools)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def template_variables(self, chat_template: str | None = None) -> frozenset[str]:
        """The variables the chat template (``chat_template`` or the checkpoint's) reads from its inputs."""
        source = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        if not isinstance(source, str):
            return frozenset()
        _check_source(source, chat_template is not None)  # NOTE: first: compiling (below) folds constants
        return _template_variables(source)

    def check_budgets(self, chat_template: str | None = None) -> None:
        """Refuses a request's template (``chat_template``) with an operation of unbounded size
        (:func:`~loopline.entrypoints.template_budget.check_template_source`); the checkpoint's (every one
        of them), which the operator chose, is only logged once if it has one (it still renders under the
        time and output budgets)."""
        source = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        for one in (source.values() if isinstance(source, dict) else [source]):  # named templates: every one
            if isinstance(one, str):
                _check_source(one, chat_template is not None)

    def check_template_kwargs(self, kwargs: dict[str, Any], param: str, chat_template: str | None = None) -> None:
        """Refuses (naming ``param.<key>``) a template input the template does not use or one that
        a request field sets: an input the template never reads would be silently ignored."""
        used = self.template_variables(chat_template)
        for key in kwargs:
            if param == "chat_template_kwargs" and key in RESERVED_TEMPLATE_INPUTS:
                raise InvalidRequestError(f"{param}: {key!r} is not a template input to set here "
                                          "(use the request field of that name, if any)", param=f"{param}.{key}")
            if key not in used:
                raise InvalidRequestError(f"{param}: the chat template does not use {key!r:.80} "
                                          f"(it reads: {sorted(used - RESERVED_TEMPLATE_INPUTS)})",
                                          param=f"{param}.{key}" if param != key else param)


# Template inputs set by request fields (or by apply_chat_template itself): never through chat_template_kwargs.
RESERVED_TEMPLATE_INPUTS = frozenset({"messages", "conversation", "add_generation_prompt", "continue_final_message",
                                      "tools", "documents", "chat_template", "tokenize", "return_dict", "tokenizer",
                                      "padding", "truncation", "max_length", "return_tensors",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


@functools.lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"the chat template does not parse: {e}", param="chat_template") from None


def hermes_preamble(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that offers ``tools`` in hermes style (templates that do not render ``tools``)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"You may call functions. Their signatures:\n<tools>\n{listed}\n</tools>\nFor each call, reply with "
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _arguments(arguments: Any) -> Any:
    """A call's arguments as a JSON value (OpenAI sends them as a JSON string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls' ``arguments`` as JSON objects (as vLLM hands them to templates,
    which write them with ``tojson``)."""
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments", {}))}}
             if isinstance(c.get("function"), dict) else c for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def tools_fallback(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``conversation`` for a template without tools support: the hermes preamble in the system
    message, assistant ``tool_calls`` as ``<tool_call>`` blocks, ``tool`` messages as ``user``
    messages holding ``<tool_response>`` blocks (plain role/content messages only)."""
    out: list[dict[str, Any]] = []
    for m in conversation:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": _arguments(
                    fn.get("arguments", {}))}, ensure_ascii=False) + "\n</tool_call>")
            content = "\n".join(([content] if content else []) + blocks)
        out.append({k: v for k, v in {**m, "content": content}.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        preamble = hermes_preamble(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _check_source(source: str, from_request: bool) -> None:
    """:func:`check_template_source` for a request's template; for the operator's (the checkpoint's or
    ``--chat-template``) a warning, once: a model's own template may multiply by a computed count (an
    indent), and refusing it would refuse every chat."""
    if from_request:
        check_template_source(source)
        return
    try:
        check_template_source(source)
    except TemplateBudgetError as e:
        _warn_once(str(e))


@functools.lru_cache(maxsize=16)
def _warn_once(message: str) -> None:
    logger.warning("%s; it is the server's own template, so it runs (under the render time and output budgets)",
                   message)
