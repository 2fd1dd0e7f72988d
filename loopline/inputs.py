"""Prompt types of ``LLM.generate`` (vLLM's names): a ``TextPrompt`` or a ``TokensPrompt`` dict, a plain
string, or a list of token ids.

>>> from loopline.inputs import TokensPrompt
>>> TokensPrompt(prompt_token_ids=[1, 2, 3])
{'prompt_token_ids': [1, 2, 3]}
"""
from __future__ import annotations

from typing import Any, TypedDict

from loopline.errors import InvalidRequestError

#: vLLM prompt fields for other modalities; loopline's models read text only, so these are refused
#: (never silently dropped: the answer would ignore the image).
MULTI_MODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A text prompt (``prompt``), tokenized by the engine's tokenizer."""

    cache_salt: str  # prefix-cache pages are shared only among requests with the same salt
    multi_modal_data: Any  # refused: loopline serves text-only models


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    """A prompt given as token ids (``prompt_token_ids``); ``prompt``, when given, is only reported back."""

    prompt: str
    cache_salt: str
    multi_modal_data: Any  # refused: loopline serves text-only models


def check_text_only(prompt: dict[str, Any]) -> None:
    """Refuses a prompt dict that carries data for another modality, naming the field."""
    for key in MULTI_MODAL_KEYS:
        if prompt.get(key) is not None:
            raise InvalidRequestError(f"{key} is not supported: loopline serves text-only models (give prompt or "
                                      "prompt_token_ids only)", param=key)
