"""SamplingParams: vLLM field names plus the loop fields of looped models."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from loopline.errors import InvalidRequestError
from loopline.structured.params import StructuredOutputsParams

# Seeds are int64 (the sampler keys its counter-based randomness on them); choice i of n uses
# seed + i, so the largest seed leaves room for n - 1 more.
_MIN_SEED, _MAX_SEED = -(2**63), 2**63 - 1
# Integer fields with no natural upper bound still get one, so a huge JSON number is a clear
# 400 here instead of an OverflowError when it is staged into an int32/int64 tensor.
_MAX_INT32 = 2**31 - 1
# The sampler stages float fields as float32: a larger value would become inf on the device.
_MAX_FLOAT32 = 3.4028234663852886e38
MAX_N = 1024
# logprobs / prompt_logprobs: -1 (the whole vocabulary) or a count; the engine's max_logprobs caps it
# (engine/input_processor.py), this only bounds the type.
# logprob_token_ids: at most this many ids (vLLM's MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128
# bad_words: at most this many words of at most this many characters; a word's tokenization may be at
# most BAD_WORD_MAX_TOKENS tokens (the device keeps each slot's last BAD_WORD_MAX_TOKENS - 1 tokens).
MAX_BAD_WORDS, MAX_BAD_WORD_LEN, BAD_WORD_MAX_TOKENS = 128, 256, 16
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias in [-100, 100]
# Stop strings are matched against the text after every token on the engine thread: bound
# their number and length so one request cannot slow every other one down.
MAX_STOP_STRINGS, MAX_STOP_LEN, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
# Per-request logprobs mode: vLLM's names, plus the short forms vime sends.
_LOGPROBS_MODES = {"raw_logprobs": "raw_logprobs", "processed_logprobs": "processed_logprobs",
                   "raw": "raw_logprobs", "processed": "processed_logprobs"}

# Exit policies a request may pick (loopline.core.exit_policy); "trace" is the engine's only.
REQUEST_EXIT_MODES = ("threshold", "fixed", "lookahead")


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's names): ``CUMULATIVE`` (the default) -- each output is
    the whole completion so far; ``DELTA`` -- each output holds only what was added since the
    previous one (the text, tokens, logprobs and exit depths; the prompt fields are the
    request's); ``FINAL_ONLY`` -- one output, the whole completion, once the request finished."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request (docs/design.md, 'Outputs').

    Loop fields: ``min_loops`` / ``max_loops`` bound a generated token's depth;
    ``exit_threshold`` is the exit rule's threshold on the cumulative exit
    probability (``None``: the checkpoint's ``early_exit_threshold``; 1.0 means
    fixed depth). ``exit_depths`` replays given per-token depths instead of the
    rule (the engine's ``exit_mode="trace"``).

    ``exit_mode``: this request's exit policy, ``"threshold"`` (the gate), ``"fixed"`` (every token
    runs ``max_loops``) or ``"lookahead"`` (a head beside the weights fixes each token's exit two loops
    ahead: docs/lookahead.md); ``None``: the engine's ``exit_mode``. ``lookahead_threshold``: the
    lookahead head's probability threshold in [0, 1] (``None``: the head's calibrated one).

    ``logprobs_mode``: ``"raw_logprobs"`` or ``"processed_logprobs"`` (also
    ``"raw"`` / ``"processed"``) for this request's logprobs; ``None`` uses the
    engine's ``logprobs_mode``.

    ``output_kind``: whole outputs each time (the default), only what each step added, or the
    final output only (:class:`RequestOutputKind`).

    vLLM's logits fields, applied on the device by the sampler: ``min_tokens`` (EOS and
    ``stop_token_ids`` suppressed, stop strings ignored, until the completion has that many tokens),
    ``logit_bias`` (token id -> bias in [-100, 100], added to the raw logits), ``allowed_token_ids``
    (only these may be sampled), ``bad_words`` (never generated: see ``InputProcessor``).
    ``logprobs`` / ``prompt_logprobs`` of -1 ask for the whole vocabulary; ``logprob_token_ids``
    reports the logprobs of these ids (with the sampled token's) instead of the top k.
    ``truncate_prompt_tokens``: keep the prompt's last k tokens (-1: up to ``max_model_len``).
    ``best_of``: only unset or equal to ``n``.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    priority: int = 0
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_depths: list[int] | None = None
    exit_mode: str | None = field(default=None, metadata={"cli": False})  # the CLI has the engine's --exit-mode
    lookahead_threshold: float | None = field(default=None, metadata={"cli": False})
    # the seed of a family's random latent initial state (Huginn; docs/model-families.md): 0 by default,
    # so a prompt's KV is a function of its tokens; part of the prefix-cache key
    latent_seed: int = field(default=0, metadata={"cli": False})
    # False: this request never runs loop self-speculation's rounds (docs/speculation.md)
    speculate: bool = field(default=True, metadata={"cli": False})
    logprobs_mode: str | None = field(default=None, metadata={"cli": False})  # the CLI has the engine's --logprobs-mode
    output_kind: RequestOutputKind = field(default=RequestOutputKind.CUMULATIVE, metadata={"cli": False})
    # what the output must match (JSON schema, regex, choice, grammar); a dict is read as its fields
    structured_outputs: StructuredOutputsParams | None = field(default=None, metadata={"cli": False})
    min_tokens: int = field(default=0, metadata={"cli": False})
    logit_bias: dict[int, float] | None = field(default=None, metadata={"cli": False})
    allowed_token_ids: list[int] | None = field(default=None, metadata={"cli": False})
    bad_words: list[str] | None = field(default=None, metadata={"cli": False})
    truncate_prompt_tokens: int | None = field(default=None, metadata={"cli": False})
    logprob_token_ids: list[int] | None = field(default=None, metadata={"cli": False})
    best_of: int | None = field(default=None, metadata={"cli": False})
    # Resolved by the engine (InputProcessor), never set by a caller: the token ids that end the
    # request (stop_token_ids and, unless ignore_eos, EOS: what min_tokens suppresses, and what the
    # depth pipeline enters no lane behind), each bad word's token ids, and the prompt's cache_salt
    # (vLLM puts it on the prompt; it travels with the request from here on).
    _stop_ids: tuple[int, ...] | None = field(default=None, repr=False, metadata={"cli": False})
    _bad_words_token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False, metadata={"cli": False})
    _cache_salt: str | None = field(default=None, repr=False, metadata={"cli": False})
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}", param="stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
                                      param="stop_token_ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        for name in ("allowed_token_ids", "bad_words", "logprob_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise InvalidRequestError(f"{name} must be a list, got {value!r:.60}", param=name)
            if value is not None:
                setattr(self, name, list(value))
        if self.logit_bias is not None:
            self.logit_bias = _token_bias(self.logit_bias)
        self._validate()

    # --- validation ---------------------------------------------------------------------
    def _validate(self) -> None:
        """Type and range of every field that does not need the checkpoint (see ``validate_for_model``)."""
        _int_in("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, _MAX_INT32)
        _float_in("temperature", self.temperature, 0.0, _MAX_FLOAT32)
        _float_in("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= _MAX_INT32):
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or an integer in [1, vocab size], got {self.top_k!r}",
                                      param="top_k")
        _float_in("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int_in("seed", self.seed, _MIN_SEED, _MAX_SEED - (self.n - 1))  # n - 1: choice i uses seed + i
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                                      param="stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN:
                raise InvalidRequestError(f"stop must be strings of 1 to {MAX_STOP_LEN} characters, got {s!r:.60}",
                                          param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                                      f"got {len(self.stop_token_ids)}", param="stop_token_ids")
        for t in self.stop_token_ids:
            _int_in("stop_token_ids", t, 0, _MAX_INT32)
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (vLLM)
            _int_in(name, getattr(self, name), -1, _MAX_INT32, optional=True)
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens if self.max_tokens is not None else _MAX_INT32)
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise InvalidRequestError(f"best_of must be unset or equal to n ({self.n}): this engine returns every "
                                      f"completion it samples, got {self.best_of!r}", param="best_of")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens) or not (
                self.truncate_prompt_tokens == -1 or 1 <= self.truncate_prompt_tokens <= _MAX_INT32)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (up to max_model_len) or an integer >= 1, "
                                      f"got {self.truncate_prompt_tokens!r}", param="truncate_prompt_tokens")
        for bias in (self.logit_bias or {}).values():
            _float_in("logit_bias", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids must not be empty (unset: every token)",
                                          param="allowed_token_ids")
            for t in self.allowed_token_ids:
                _int_in("allowed_token_ids", t, 0, _MAX_INT32)
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise InvalidRequestError(f"bad_words must hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}",
                                          param="bad_words")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_LEN:
                    raise InvalidRequestError(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_LEN} "
                                              f"characters, got {w!r:.60}", param="bad_words")
        if self.logprob_token_ids is not None:
            if not 1 <= len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise InvalidRequestError(f"logprob_token_ids must hold 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, "
                                          f"got {len(self.logprob_token_ids)}", param="logprob_token_ids")
            for t in self.logprob_token_ids:
                _int_in("logprob_token_ids", t, 0, _MAX_INT32)
            if len(set(self.logprob_token_ids)) != len(self.logprob_token_ids):
                raise InvalidRequestError("logprob_token_ids must not repeat an id", param="logprob_token_ids")
            if self.logprobs is not None and self.logprobs != len(self.logprob_token_ids):
                raise InvalidRequestError(f"logprob_token_ids replaces the top logprobs: logprobs must be unset or "
                                          f"len(logprob_token_ids) ({len(self.logprob_token_ids)}), got {self.logprobs}",
                                          param="logprob_token_ids")
        _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_in("repetition_penalty", self.repetition_penalty, 0.0, _MAX_FLOAT32, lo_open=True)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}", param=name)
        _int_in("priority", self.priority, -(2**31), _MAX_INT32)
        _int_in("min_loops", self.min_loops, 1, _MAX_INT32)
        _int_in("latent_seed", self.latent_seed, 0, 2**32 - 1)
        if self.max_loops is not None:
            if _is_int(self.max_loops) and self.max_loops < self.min_loops:
                raise InvalidRequestError(f"max_loops ({self.max_loops}) must be >= min_loops ({self.min_loops})",
                                          param="max_loops")
            _int_in("max_loops", self.max_loops, self.min_loops, _MAX_INT32)
        if self.exit_threshold is not None:
            _float_in("exit_threshold", self.exit_threshold, 0.0, 1.0, lo_open=True)
        if self.exit_mode is not None and self.exit_mode not in REQUEST_EXIT_MODES:
            raise InvalidRequestError(f"exit_mode must be one of {list(REQUEST_EXIT_MODES)} or None (the engine's), "
                                      f"got {self.exit_mode!r}", param="exit_mode")
        if self.lookahead_threshold is not None:
            _float_in("lookahead_threshold", self.lookahead_threshold, 0.0, 1.0)
        if self.logprobs_mode is not None:
            mode = _LOGPROBS_MODES.get(self.logprobs_mode) if isinstance(self.logprobs_mode, str) else None
            if mode is None:
                raise InvalidRequestError(f"logprobs_mode must be one of {list(_LOGPROBS_MODES)} or None, "
                                          f"got {self.logprobs_mode!r}", param="logprobs_mode")
            self.logprobs_mode = mode
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError(f"output_kind must be a RequestOutputKind ({', '.join(k.name for k in RequestOutputKind)}), "
                                      f"got {self.output_kind!r}", param="output_kind")
        if self.exit_depths is not None:
            if not isinstance(self.exit_depths, (list, tuple)) or not self.exit_depths:
                raise InvalidRequestError("exit_depths must be a non-empty list of loop counts", param="exit_depths")
            for d in self.exit_depths:
                _int_in("exit_depths", d, 1, _MAX_INT32)
            self.exit_depths = list(self.exit_depths)

    def validate_for_model(self, total_ut_steps: int, vocab_size: int, bound: str = "the model's total_ut_steps") -> None:
        """Checks that need the checkpoint: loop bounds (``total_ut_steps``: the most loops allowed, named by
        ``bound``) and token ids."""
        R = total_ut_steps
        if self.min_loops > R:
            raise InvalidRequestError(f"min_loops must be in [1, {R}] ({bound}), got {self.min_loops}", param="min_loops")
        if self.max_loops is not None and self.max_loops > R:
            raise InvalidRequestError(f"max_loops must be in [min_loops, {R}] ({bound}), got {self.max_loops}", param="max_loops")
        for d in self.exit_depths or []:
            if d > R:
                raise InvalidRequestError(f"exit_depths entries must be in [1, {R}], got {d}", param="exit_depths")
        if self.top_k > vocab_size:
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or in [1, {vocab_size}] (the vocab size), "
                                      f"got {self.top_k}", param="top_k")
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids", "logit_bias"):
            for t in getattr(self, name) or ():
                if t >= vocab_size:
                    raise InvalidRequestError(f"{name} token ids must be in [0, {vocab_size}), got {t}", param=name)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise InvalidRequestError(f"{name} must be -1 (the whole vocabulary) or in [0, {vocab_size}] "
                                          f"(the vocab size), got {value}", param=name)

    # --- derived ------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra" and not f.name.startswith("_")}

    # --- what the sampler needs (host-side flags of the batch) ---------------------------
    @property
    def uses_min_tokens(self) -> bool:
        return self.min_tokens > 0 and bool(self._stop_ids)


def _token_bias(value: Any) -> dict[int, float]:
    """``logit_bias`` with int keys: JSON's string keys ("123") are read as token ids."""
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must be a mapping of token id to bias, got {value!r:.60}", param="logit_bias")
    out = {}
    for key, bias in value.items():
        tid = key
        if isinstance(key, str):
            try:
                tid = int(key.strip())
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r:.40}", param="logit_bias") from None
        if not _is_int(tid) or not 0 <= tid <= _MAX_INT32:
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, vocab size), got {key!r:.40}",
                                      param="logit_bias")
        if tid in out:
            raise InvalidRequestError(f"logit_bias names token {tid} twice", param="logit_bias")
        out[tid] = bias
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # NOTE: True is an int in Python


def _int_in(name: str, value: Any, lo: int | None, hi: int | None, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise InvalidRequestError(f"{name} must be in {rng}, got {value}", param=name)


def _float_in(name: str, value: Any, lo: float | None, hi: float | None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    if bad_lo or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        raise InvalidRequestError(f"{name} must be in {left}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], got {value}", param=name)
