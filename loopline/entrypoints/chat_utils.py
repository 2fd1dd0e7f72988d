"""Chat prompts: the checkpoint's chat template, plus the ``<think>\\n`` the -Thinking variants expect.

Ouro-1.4B-Thinking and Ouro-2.6B-Thinking never open a reasoning block on
their own: their prompts must end with ``<|im_start|>assistant\\n<think>\\n``,
and their chat template does not add it (DESIGN.md §5). :class:`ChatEncoder`
is the one place that renders chat prompts, for ``LLM.chat`` and for the HTTP
chat endpoint (and ``/tokenize`` with ``messages``): on a Thinking checkpoint
it appends ``<think>\\n`` after the assistant prefix when the rendered prompt
does not already end with an open ``<think>``.

A checkpoint counts as a Thinking variant when its directory name, its
``config.json`` ``_name_or_path`` or one of its ``architectures`` contains
"thinking" (any case). NOTE: the tokenizer is no evidence: base Ouro shares
the vocabulary, ``<think>`` included (it sometimes samples it itself).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from loopline.errors import InvalidRequestError

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
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text: the template's rendering, with ``<think>\\n`` appended on Thinking checkpoints.

        ``continue_final_message``: the last message stays open (the model continues it);
        ``template_kwargs``: more template variables (``documents``, ``chat_template_kwargs``), each
        one the template uses (:meth:`check_template_kwargs`)."""
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
        extra: dict[str, Any] = dict(template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **extra)
        if self.thinking and add_generation_prompt and not text.rstrip().endswith(THINK_TOKEN):
            text += THINK_PREFIX
        return text

    def encode(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
               chat_template: str | None = None, *, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False) -> list[int]:
        """Token ids of :meth:`render`'s text (``add_special_tokens``: the tokenizer's on top of the template's)."""
        text = self.render(conversation, add_generation_prompt, chat_template,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def template_variables(self, chat_template: str | None = None) -> frozenset[str]:
        """The variables the chat template (``chat_template`` or the checkpoint's) reads from its inputs."""
        source = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        if not isinstance(source, str):
            return frozenset()
        return _template_variables(source)

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
