"""loopline: an inference and serving engine for looped language models (Ouro).

The public names are imported on first use (PEP 562), so ``import loopline``
(and ``loopline --help`` / ``--version``) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "EngineArgs": "loopline.config",
    "AsyncLLM": "loopline.entrypoints.async_llm",
    "LLM": "loopline.entrypoints.llm",
    "CompletionOutput": "loopline.outputs",
    "Logprob": "loopline.outputs",
    "RequestOutput": "loopline.outputs",
    "RequestOutputKind": "loopline.sampling_params",
    "SamplingParams": "loopline.sampling_params",
    "TextPrompt": "loopline.inputs",
    "TokensPrompt": "loopline.inputs",
}

__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Logprob", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
