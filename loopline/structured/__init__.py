"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

To constrain a request, give it ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``.
:func:`compile_constraint` (``loopline.structured.backend``) compiles one for a tokenizer and vocabulary
size (cached), raising ``InvalidRequestError`` naming the field when it does not compile: what a caller
that builds constraints (e.g. tool calling) validates with. ``StructuredOutputs``
(``loopline.structured.manager``) is an engine's side: matchers and token masks. Those two import torch
and, on first use, xgrammar, so they load on first access (``import loopline`` stays light).
"""
from __future__ import annotations

import importlib
from typing import Any

from loopline.structured.params import StructuredOutputsParams

_LAZY = {"compile_constraint": "loopline.structured.backend", "StructuredOutputs": "loopline.structured.manager"}

__all__ = ["StructuredOutputsParams", "compile_constraint", "StructuredOutputs"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loopline.structured' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
