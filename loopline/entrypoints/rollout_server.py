"""A token-in / token-out rollout server over :class:`AsyncLLM`, for trainer-framework adapters.

Framework-free: ``loopline.integrations.verl`` wraps it in a Ray actor and turns
its :class:`RolloutResult` into verl's ``TokenOutput``; the pieces here are
tested without verl or Ray.

* :func:`sampling_from_dict` reads a trainer's sampling dict (vLLM key names)
  into a :class:`loopline.SamplingParams`, with the rollout's length budget.
* :class:`RolloutServer` adds what a trainer's control flow needs on top of the
  engine's pause / sleep / weight calls: a generation gate that
  ``abort_all_requests`` closes (later requests are held, or refused with
  ``reject``) and ``resume_generation`` opens; sleep, KV release and weight
  updates that keep the engine paused while anything is down; the trainer's
  ``global_steps`` on every result.

The engine stays paused while any reason to pause holds (the gate, sleep, a
released KV pool, an open weight update): the engine itself holds requests
that arrive while it is paused and starts them, in order, at resume.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from loopline.config import EngineArgs
from loopline.entrypoints.async_llm import AsyncLLM
from loopline.errors import EngineStateError, InvalidRequestError
from loopline.sampling_params import SamplingParams

logger = logging.getLogger("loopline.rl")

# sampling-dict keys a loop model adds to vLLM's, read when present
LOOP_KEYS = ("min_loops", "max_loops", "exit_threshold")


@dataclass(frozen=True)
class RolloutLimits:
    """The trainer's length budget: ``prompt_length`` and ``response_length`` (tokens),
    ``max_model_len`` (prompt + response, at most the model's context)."""

    prompt_length: int
    response_length: int
    max_model_len: int

    def default_max_tokens(self, prompt_len: int) -> int:
        """``min(response_length, prompt_length + response_length - prompt_len)``, clamped to
        ``[1, max_model_len - prompt_len]`` (a multi-turn prompt may exceed ``prompt_length``)."""
        n = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        return max(1, min(n, self.max_model_len - prompt_len))


def sampling_from_dict(params: Mapping[str, Any], prompt_len: int, limits: RolloutLimits,
                       loop_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """A trainer's sampling dict as loopline parameters.

    Read: ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1 = off), ``repetition_penalty``,
    ``logprobs`` (a bool: the sampled token's logprob), ``max_tokens`` or ``max_new_tokens``,
    ``ignore_eos``, ``seed`` (None: the engine draws one), ``structured_outputs`` (vLLM's object: the
    response must match a JSON schema, regex, choice or grammar) and the loop fields ``min_loops``,
    ``max_loops``, ``exit_threshold`` (default: ``loop_defaults``, else the checkpoint's). Other
    keys are ignored. Out-of-range values raise ``InvalidRequestError`` naming the key.
    """
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    if max_tokens is None:
        max_tokens = limits.default_max_tokens(prompt_len)
    logprobs = params.get("logprobs", False)
    if logprobs is not None and not isinstance(logprobs, (bool, int)):
        raise InvalidRequestError(f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
    loops = {k: v for k, v in {**(loop_defaults or {}), **{k: params[k] for k in LOOP_KEYS if k in params}}.items()
             if v is not None}
    # (values go to SamplingParams as sent: it checks their types and ranges, naming the key)
    return SamplingParams(
        n=1, max_tokens=max_tokens, temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
        top_k=params.get("top_k", -1), repetition_penalty=params.get("repetition_penalty", 1.0),
        seed=params.get("seed"), ignore_eos=params.get("ignore_eos", False), logprobs=0 if logprobs else None,
        structured_outputs=params.get("structured_outputs"), detokenize=False, **loops)


# engine_kwargs keys that are not EngineArgs fields
EXTRA_KEYS = (*LOOP_KEYS, "engine_process", "bucket_bytes", "server_num_cpus")


@dataclass(frozen=True)
class EngineOptions:
    """One rollout replica's engine: ``engine_args``, the length budget, the default loop fields and
    whether the engine loop runs in an engine process of its own (``engine_process``) or on a thread."""

    engine_args: EngineArgs
    limits: RolloutLimits
    loop_defaults: dict[str, Any] = field(default_factory=dict)
    engine_process: bool = False

    def build(self) -> AsyncLLM:
        if self.engine_process:
            return AsyncLLM(self.engine_args)
        from loopline.engine import LLMEngine

        return AsyncLLM(engine=LLMEngine(self.engine_args))


def engine_options(model_path: str, *, dtype: str, logprobs_mode: str, prompt_length: int, response_length: int,
                   max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int | None,
                   gpu_memory_utilization: float, enforce_eager: bool, enable_prefix_caching: bool, seed: int,
                   extra: Mapping[str, Any] | None = None) -> EngineOptions:
    """A trainer's rollout settings as :class:`EngineOptions`.

    ``extra`` (verl: ``rollout.engine_kwargs.loopline``) holds any :class:`EngineArgs` field (it wins
    over the trainer's value), the default loop fields ``min_loops`` / ``max_loops`` /
    ``exit_threshold``, ``engine_process`` (bool), and adapter keys (``bucket_bytes``,
    ``server_num_cpus``) ignored here. An unknown key raises ``InvalidRequestError`` naming it.
    """
    extra = dict(extra or {})
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in extra if k not in fields and k not in EXTRA_KEYS)
    if unknown:
        raise InvalidRequestError(f"engine_kwargs.loopline: unknown key(s) {unknown}; allowed: EngineArgs fields "
                                  f"and {list(EXTRA_KEYS)}", param=unknown[0])
    if max_model_len is None:
        max_model_len = prompt_length + response_length
    layout = extra.get("kv_layout", "last_exited")
    args = {
        "model": model_path, "skip_tokenizer_init": True, "dtype": dtype, "seed": seed,
        "logprobs_mode": logprobs_mode, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "gpu_memory_utilization": gpu_memory_utilization,
        "enforce_eager": enforce_eager, "disable_log_stats": True,
        # loopline caches prefixes in the last_exited layout only
        "enable_prefix_caching": bool(enable_prefix_caching) and layout == "last_exited",
        **{k: v for k, v in extra.items() if k in fields},
    }
    if not torch.cuda.is_available():
        args.pop("gpu_memory_utilization")
    engine_args = EngineArgs(**args)
    limits = RolloutLimits(prompt_length=int(prompt_length), response_length=int(response_length),
                           max_model_len=int(engine_args.max_model_len or max_model_len))
    loops = {k: extra[k] for k in LOOP_KEYS if extra.get(k) is not None}
    return EngineOptions(engine_args, limits, loops, bool(extra.get("engine_process", False)))


@dataclass
class RolloutResult:
    """One finished generation: the response tokens, their logprobs (None unless asked), exit depths,
    ``stop_reason`` (``"completed"`` for a stop or length end, ``"aborted"`` for an abort, with the
    tokens produced so far), the weight version that produced it and the trainer's ``global_steps``."""

    token_ids: list[int]
    log_probs: list[float] | None
    exit_depths: list[int]
    stop_reason: str
    finish_reason: str
    weight_version: int
    global_steps: int | None


class RequestRejected(EngineStateError):
    """A request arrived while generation was blocked with ``reject_request=True``."""


class RolloutServer:
    """Trainer-facing control over one :class:`AsyncLLM` (see the module docstring)."""

    def __init__(self, llm: AsyncLLM, limits: RolloutLimits, loop_defaults: Mapping[str, Any] | None = None) -> None:
        self.llm = llm
        self.limits = limits
        self.loop_defaults = dict(loop_defaults or {})
        self.global_steps: int | None = None
        self._pause_reasons: set[str] = set()  # "abort" | "sleep" | "kv" | "update"
        self._reject = False
        self._control = asyncio.Lock()  # control calls one at a time, in arrival order
        self._ids = itertools.count()
        self._update_version: int | None = None

    # --- generation ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: Mapping[str, Any], request_id: str
                       ) -> RolloutResult:
        """Runs one request to its end. While generation is blocked it is held (started at resume),
        or refused with :class:`RequestRejected` after ``abort_all_requests(reject_request=True)``."""
        if self._reject and "abort" in self._pause_reasons:
            raise RequestRejected("generation is blocked (abort_all_requests(reject_request=True)); "
                                  "the request was not started")
        prompt_ids = [int(t) for t in prompt_ids]
        params = sampling_from_dict(sampling_params, len(prompt_ids), self.limits, self.loop_defaults)
        # NOTE: the caller's id may repeat across turns; the engine needs ids unique among live requests
        out = await self.llm.generate_tokens(prompt_ids, params, f"{request_id}#{next(self._ids)}")
        c = out.outputs[0]
        return RolloutResult(
            token_ids=list(c.token_ids), log_probs=list(c.token_logprobs) if params.logprobs is not None else None,
            exit_depths=[int(d) for d in c.exit_depths], stop_reason="aborted" if c.finish_reason == "abort" else "completed",
            finish_reason=c.finish_reason, weight_version=int(out.weight_version), global_steps=self.global_steps)

    # --- the gate -------------------------------------------------------------------------------
    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Ends every in-flight request now (``"aborted"``, tokens kept); later ones are held until
        :meth:`resume_generation`, or refused with ``reject_request``."""
        async with self._control:
            self._reject = bool(reject_request)
            self._pause_reasons.add("abort")
            await self.llm.pause_generation("abort")

    async def resume_generation(self) -> None:
        async with self._control:
            self._reject = False
            await self._lift("abort")

    # --- memory ---------------------------------------------------------------------------------
    async def sleep(self) -> None:
        """Frees the weights and the KV pool (loopline's ``sleep(2)``) after in-flight requests end."""
        async with self._control:
            await self._pause("sleep")
            await self.llm.sleep(2)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores ``"weights"`` and/or ``"kv_cache"`` (default both)."""
        async with self._control:
            await self.llm.wake_up(list(tags) if tags is not None else None)
            await self._lift_if_awake()

    async def release_kv_cache(self) -> None:
        """Frees the KV pool, weights kept (loopline's ``sleep(1)``); held requests wait."""
        async with self._control:
            await self._pause("kv")
            await self.llm.sleep(1)

    async def resume_kv_cache(self) -> None:
        async with self._control:
            await self.llm.wake_up(["kv_cache"])
            await self._lift_if_awake()

    async def clear_kv_cache(self) -> None:
        """Drops reusable (prefix-cached) KV."""
        async with self._control:
            await self.llm.reset_prefix_cache()

    # --- weights --------------------------------------------------------------------------------
    async def start_weight_update(self) -> int:
        """Opens an update to the next version (committed + 1); generation stays paused until it ends."""
        async with self._control:
            await self._pause("update")
            version = await self.llm.get_weight_version() + 1
            try:
                await self.llm.start_weight_update(version)
            except BaseException:
                await self._lift("update")
                raise
            self._update_version = version
            return version

    async def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """One bucket of ``(HF name, tensor)``, validated whole before any copy."""
        if self._update_version is None:
            raise EngineStateError("no weight update in progress; call start_weight_update() first")
        try:
            return await self.llm.update_weights(weights)
        except BaseException:
            await self._end_update(failed=True)
            raise

    async def finish_weight_update(self, global_steps: int | None = None) -> int:
        """Commits the update (every parameter exactly once), clears reusable KV and records ``global_steps``."""
        if self._update_version is None:
            raise EngineStateError("no weight update in progress; call start_weight_update() first")
        try:
            version = await self.llm.finish_weight_update()
        except BaseException:
            await self._end_update(failed=True)
            raise
        if global_steps is not None:
            self.global_steps = int(global_steps)
        self._pause_reasons.discard("weights")  # a complete update repaired what a failed one left
        await self._end_update(failed=False)
        return int(version)

    async def abort_weight_update(self) -> None:
        if self._update_version is not None:
            await self._end_update(failed=True)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    async def get_weight_version(self) -> int:
        return int(await self.llm.get_weight_version())

    # --- internals ------------------------------------------------------------------------------
    async def _end_update(self, failed: bool) -> None:
        async with self._control:
            if self._update_version is None:
                return
            self._update_version = None
            if failed:
                try:
                    await self.llm.abort_weight_update()
                except EngineStateError:  # the failing call already closed it
                    pass
            await self._lift("update")

    async def _pause(self, reason: str) -> None:
        """Adds a reason to pause; the first one drains in-flight requests (``"wait"``)."""
        first = not self._pause_reasons
        self._pause_reasons.add(reason)
        if first or not await self.llm.is_paused():
            await self.llm.pause_generation("wait")

    async def _lift(self, reason: str) -> None:
        self._pause_reasons.discard(reason)
        if not self._pause_reasons and await self.llm.is_paused():
            try:
                await self.llm.resume_generation()
            except EngineStateError as e:  # partially updated weights: held until a complete update lands
                logger.warning("generation stays paused: %s", e)
                self._pause_reasons.add("weights")

    async def _lift_if_awake(self) -> None:
        if not await self.llm.is_sleeping():
            self._pause_reasons.discard("sleep")
            await self._lift("kv")
