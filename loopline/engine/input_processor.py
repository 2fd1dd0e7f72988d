"""Request validation and prompt processing: every check a request passes before the engine takes it.

``InputProcessor.process`` validates the sampling parameters against the
model and the engine limits, tokenizes the prompt, resolves the effective
parameters (seed, loop bounds, logprobs mode) and builds one scheduler
``Request`` per completion (``n``). It raises ``InvalidRequestError`` /
``CapacityError`` naming the field and changes nothing on bad input.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from loopline.config import EngineConfig
from loopline.core.exit_policy import ExitPolicy
from loopline.core.request import Request
from loopline.errors import CapacityError, InvalidRequestError
from loopline.kv.manager import KVCacheManager
from loopline.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def child_request_id(request_id: str, index: int) -> str:
    """The scheduler's id of completion ``index`` of a request. Always suffixed, so that it can never
    equal another request's child id: ``rsplit("#", 1)`` gives back ``(request_id, index)``."""
    return f"{request_id}#{index}"


def parent_request_id(child_id: str) -> str:
    """The id given to ``add_request`` of the request a scheduler id belongs to."""
    return child_id.rsplit("#", 1)[0]


@dataclass
class ProcessedRequest:
    """A validated request, ready for the output processor and the scheduler."""

    request_id: str
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: SamplingParams  # effective: seed, max_tokens, loop bounds and logprobs mode resolved
    children: list[Request]


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: Any, tokenizer: Any, exit_policy: ExitPolicy,
                 kv: KVCacheManager, eos_token_ids: frozenset[int], chat_end_ids: list[int]) -> None:
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.exit_policy, self.kv = exit_policy, kv
        self._eos, self._chat_eos = eos_token_ids, eos_token_ids | set(chat_end_ids)
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                chat_stop: bool = False) -> ProcessedRequest:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}", param="sampling_params")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        prompt_text, ids = self._tokenize(prompt)
        cfg = self.model_config
        params.validate_for_model(cfg.total_ut_steps, cfg.vocab_size)
        if params.structured_outputs is not None:  # never silently unconstrained
            raise InvalidRequestError("structured_outputs are not supported by this engine yet",
                                      param="structured_outputs")
        self.exit_policy.validate(params)
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequestError(f"{name} must be <= max_logprobs ({limit}), got {value}", param=name)
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise CapacityError(f"prompt has {len(ids)} tokens; max_model_len is {max_len} (prompt + output)", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise CapacityError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_len})", param="max_tokens")
        if not self.kv.fits_ever(len(ids) + max_tokens):
            raise CapacityError(
                f"request needs {self.kv.blocks_needed(len(ids) + max_tokens)} KV blocks but the pool has "
                f"{self.kv.pool.num_blocks}; lower max_tokens or raise num_kv_blocks", param="max_tokens")
        eos = self._chat_eos if chat_stop else self._eos
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        # NOTE: the one place a request's defaults are decided; everything downstream reads `effective`
        effective = params.clone(seed=seed, max_tokens=max_tokens,
                                 logprobs_mode=params.logprobs_mode or self.config.logprobs_mode,
                                 max_loops=params.max_loops or cfg.total_ut_steps,
                                 exit_threshold=cfg.early_exit_threshold if params.exit_threshold is None else params.exit_threshold)
        children = [Request(child_request_id(request_id, i), ids, effective, seed + i, max_tokens, eos,
                            next(self._arrivals)) for i in range(params.n)]
        return ProcessedRequest(request_id, prompt_text, ids, effective, children)

    def next_arrival_seq(self) -> int:
        """An arrival number for a request that arrives another way (a prefill worker's handoff)."""
        return next(self._arrivals)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init=True): pass prompt_token_ids", param="prompt")
            return prompt, self._check_ids(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(f"prompt must be a string, token ids or a dict, got {type(prompt).__name__}", param="prompt")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError("prompt_token_ids must be a non-empty list of integers", param="prompt_token_ids")
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt_token_ids entries must be integers in [0, {vocab}), got {t!r}", param="prompt_token_ids")
        return list(ids)
