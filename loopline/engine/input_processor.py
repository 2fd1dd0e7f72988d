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
from loopline.core.exit_policy import RequestExit
from loopline.core.request import Request
from loopline.errors import CapacityError, InvalidRequestError
from loopline.inputs import check_text_only
from loopline.kv.manager import KVCacheManager
from loopline.models.family import family_of
from loopline.sampling_params import BAD_WORD_MAX_TOKENS, SamplingParams

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
    def __init__(self, config: EngineConfig, model_config: Any, tokenizer: Any, exit_policy: RequestExit,
                 kv: KVCacheManager, eos_token_ids: frozenset[int], chat_end_ids: list[int]) -> None:
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.exit_policy, self.kv = exit_policy, kv
        self._eos, self._chat_eos = eos_token_ids, eos_token_ids | set(chat_end_ids)
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        limit = config.max_logprobs
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < -1:
            raise InvalidRequestError(f"max_logprobs must be -1 (no cap: the whole vocabulary) or an integer >= 0, "
                                      f"got {limit!r}", param="max_logprobs")
        # the largest logprobs / prompt_logprobs a request may ask for (-1: the vocabulary)
        self.max_logprobs = model_config.vocab_size if limit == -1 else limit

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                chat_stop: bool = False) -> ProcessedRequest:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}", param="sampling_params")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        prompt_text, ids = self._tokenize(prompt)
        salt = _cache_salt(prompt)
        ids = self._truncate(ids, params.truncate_prompt_tokens)
        cfg = self.model_config
        family = family_of(cfg)
        params.validate_for_model(self.config.num_loops, cfg.vocab_size, "the engine's max_num_loops")
        threshold = family.default_threshold(cfg) if params.exit_threshold is None else params.exit_threshold
        max_loops = params.max_loops or min(cfg.num_loops, self.config.num_loops)
        key = family.prompt_kv_key(cfg, family.prefill_loops(cfg, max_loops), params.latent_seed)
        if key is not None:  # what the prompt's KV depends on besides its tokens
            salt = key if salt is None else f"{salt};{key}"
        if params.structured_outputs is not None:  # compiled now (cached): a bad constraint changes nothing
            from loopline.structured.backend import compile_constraint  # (imports xgrammar on first use)
            compile_constraint(self.tokenizer, cfg.vocab_size, params.structured_outputs)
        self.exit_policy.validate(params)
        # -1 asks for the whole vocabulary (vLLM); resolved to its size, then capped by max_logprobs
        num = {name: getattr(params, name) for name in ("logprobs", "prompt_logprobs")}
        for name, value in num.items():
            value = cfg.vocab_size if value == -1 else value
            if value is not None and value > self.max_logprobs:
                if getattr(params, name) == -1:
                    raise InvalidRequestError(f"{name}=-1 (the whole vocabulary, {cfg.vocab_size} tokens) needs the "
                                              f"engine's max_logprobs to be -1 or >= {cfg.vocab_size}, it is "
                                              f"{self.config.max_logprobs}", param=name)
                raise InvalidRequestError(f"{name} must be -1 or in [0, {self.max_logprobs}] (max_logprobs), "
                                          f"got {value}", param=name)
            num[name] = value
        if params.logprob_token_ids is not None:  # it replaces the top k: one entry per id
            num["logprobs"] = len(params.logprob_token_ids)
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
        bad_words = self._bad_words(params.bad_words) if params.bad_words else None
        # the ids that end the request: what min_tokens suppresses, and what the depth pipeline stops at
        stop_ids = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))))
        if params.allowed_token_ids is not None:  # a row with no token left would sample from nothing
            never = {w[0] for w in bad_words or () if len(w) == 1}
            if set(params.allowed_token_ids) <= never | (set(stop_ids) if params.min_tokens else set()):
                raise InvalidRequestError("allowed_token_ids leaves no token to sample: every one is a bad word "
                                          "or suppressed by min_tokens", param="allowed_token_ids")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        # NOTE: the one place a request's defaults are decided; everything downstream reads `effective`
        effective = params.clone(seed=seed, max_tokens=max_tokens, **num,
                                 lookahead_threshold=self.exit_policy.lookahead_threshold(params),
                                 _stop_ids=stop_ids, _bad_words_token_ids=bad_words, _cache_salt=salt,
                                 logprobs_mode=params.logprobs_mode or self.config.logprobs_mode,
                                 max_loops=max_loops, exit_threshold=threshold)
        prefill = family.prefill_loops(cfg, max_loops)
        children = [Request(child_request_id(request_id, i), ids, effective, seed + i, max_tokens, eos,
                            next(self._arrivals), prefill_loops=prefill) for i in range(params.n)]
        return ProcessedRequest(request_id, prompt_text, ids, effective, children)

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: up to max_model_len, vLLM)."""
        if keep is None:
            return ids
        max_len = self.config.max_model_len
        if keep == -1:
            keep = max_len
        elif keep > max_len:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or in [1, {max_len}] (max_model_len), "
                                      f"got {keep}", param="truncate_prompt_tokens")
        return ids[-keep:]

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids (vLLM's rule): the word as it starts a text, and, where it tokenizes
        to as many tokens with another first one, as it follows a space. The sampler bans a sequence's
        last token whenever its other tokens were just generated (a one-token word: always)."""
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need the tokenizer (the engine runs with skip_tokenizer_init=True)",
                                      param="bad_words")
        vocab = self.model_config.vocab_size
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:
                raise InvalidRequestError(f"bad_words entry {word!r:.40} tokenizes to no tokens", param="bad_words")
            seqs = [plain]
            if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
                seqs.append(spaced)
            for seq in seqs:
                if len(seq) > BAD_WORD_MAX_TOKENS:
                    raise InvalidRequestError(f"bad_words entries must tokenize to at most {BAD_WORD_MAX_TOKENS} tokens, "
                                              f"{word!r:.40} has {len(seq)}", param="bad_words")
                if any(not 0 <= t < vocab for t in seq):
                    raise InvalidRequestError(f"bad_words entry {word!r:.40} tokenizes to ids outside the model's "
                                              f"vocabulary ({vocab})", param="bad_words")
                if seq not in out:
                    out.append(seq)
        return tuple(out)

    def next_arrival_seq(self) -> int:
        """An arrival number for a request that arrives another way (a prefill worker's handoff)."""
        return next(self._arrivals)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            check_text_only(prompt)
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


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's field): requests share prefix-cache pages only with requests
    of the same salt, so tenants that do not know each other's salt cannot probe each other's prompts."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r:.60}", param="cache_salt")
    return salt
