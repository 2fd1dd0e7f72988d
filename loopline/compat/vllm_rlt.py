"""``vllm_rlt`` on loopline: the module vime's native rollout backend imports, served by loopline's engine.

vime's ``NativeEngine`` (``--rollout-backend vllm-rlt``) imports ``LLM, CacheConfig, ExecutionConfig,
SchedulerConfig, SamplingParams`` from a module named ``vllm_rlt`` (upstream 0z5a/vllm-rlt). Point
that import here, with nothing else changed::

    import sys, loopline.compat.vllm_rlt
    sys.modules["vllm_rlt"] = loopline.compat.vllm_rlt

or put a one-line ``vllm_rlt.py`` (``from loopline.compat.vllm_rlt import *``) on the path, which
also works in the Ray actor process vime creates (docs/rl.md, "vime (vllm-rlt backend)").

What this module adds over :class:`loopline.LLMEngine` is the vllm-rlt spelling only: the frozen
:class:`SamplingParams` with its defaults (greedy, ``seed=0``, ``min_loops=2``), a flat
:class:`RequestOutput` with ``log_probs``, strictly increasing weight versions, a device/backend
fallback for CPU-only machines. Sampling, logprobs (docs/rl.md §2) and the validate-before-mutate
weight updates (§4) are the engine's own.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loopline.config import EngineArgs
from loopline.errors import EngineStateError, InvalidRequestError, WeightUpdateError
from loopline.sampling_params import SamplingParams as LooplineParams
from loopline.sampling_params import _float_in, _int_in  # the engine's own range checks

logger = logging.getLogger("loopline")

__all__ = ["LLM", "CacheConfig", "ExecutionConfig", "SchedulerConfig", "SamplingParams", "RequestOutput"]

_MAX_SEED = 2**63  # exclusive
_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float16": "float16", "fp16": "float16", "half": "float16", "auto": "auto"}


# --- configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheConfig:
    """KV cache. ``num_blocks``: pages in the pool (None: loopline sizes it from memory). A batch
    that does not fit waits for pages; only a request that could never fit is refused."""

    num_blocks: int | None = None
    block_size: int = 16
    layout: str = "last_exited"  # or "shared" (docs/rl.md §2)
    enable_prefix_caching: bool = False


@dataclass(frozen=True)
class ExecutionConfig:
    """``cuda_graphs``: capture CUDA graphs for decode (False: eager). Ignored on the CPU."""

    cuda_graphs: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_seqs``: requests running at once; the rest wait. ``max_num_batched_tokens``: one
    step's token budget (None: loopline's default for the device)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None


# --- sampling -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    """vllm-rlt's sampling parameters (frozen; ``dataclasses.replace`` makes variants).

    ``temperature=0``: greedy. ``top_k=-1``: off. ``seed=None``: the engine draws one (reported in
    ``RequestOutput.sampling_params``). ``logprobs``: None or 0 (the sampled token's logprob only).
    ``logprobs_mode``: ``"raw"`` (``log_softmax(logits)``) or ``"processed"``
    (``log_softmax(logits / T)``, T = 1 when greedy). Loops: a token exits after loop r when
    ``r == max_loops`` (None: the model's depth) or, with ``exit_threshold < 1`` and
    ``r >= min_loops``, once the gate's cumulative exit probability reaches ``exit_threshold``;
    ``exit_threshold=1`` is fixed depth. ``latent_seed`` has no meaning for Ouro and must be None.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = 0
    latent_seed: int | None = None
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    stop_token_ids: tuple[int, ...] = ()
    min_loops: int = 2
    max_loops: int | None = None
    exit_threshold: float = 1.0
    ignore_eos: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # hashable, like the rest
        else:
            raise InvalidRequestError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}",
                                      param="stop_token_ids")
        for t in self.stop_token_ids:
            _int_in("stop_token_ids", t, 0, None)
        _int_in("max_tokens", self.max_tokens, 1, None)
        _float_in("temperature", self.temperature, 0.0, None)
        _float_in("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _float_in("exit_threshold", self.exit_threshold, 0.0, 1.0)
        if self.top_k != -1:
            _int_in("top_k", self.top_k, 1, None)
        if self.seed is not None:
            _int_in("seed", self.seed, 0, _MAX_SEED - 1)
        if self.latent_seed is not None:
            raise InvalidRequestError("latent_seed has no meaning for Ouro models; it must be None", param="latent_seed")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or self.logprobs != 0):
            raise InvalidRequestError(f"logprobs must be None or 0 (the sampled token only), got {self.logprobs!r}",
                                      param="logprobs")
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise InvalidRequestError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}",
                                      param="logprobs_mode")
        _int_in("min_loops", self.min_loops, 1, None)
        if self.max_loops is not None:
            _int_in("max_loops", self.max_loops, self.min_loops, None)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", param="ignore_eos")
        _int_in("priority", self.priority, -(2**31), 2**31 - 1)

    def to_loopline(self, num_loops: int) -> Any:
        """The :class:`loopline.SamplingParams` of this request on a model of ``num_loops`` loops."""
        max_loops = num_loops if self.max_loops is None else self.max_loops
        min_loops = min(self.min_loops, max_loops)  # the default 2 on a one-loop model
        threshold = self.exit_threshold
        if threshold == 0.0:  # every cumulative probability reaches 0: exit at min_loops
            max_loops, threshold = min_loops, 1.0
        return LooplineParams(n=1, max_tokens=self.max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
                        top_k=self.top_k, seed=self.seed, stop_token_ids=list(self.stop_token_ids),
                        ignore_eos=self.ignore_eos, logprobs=self.logprobs, logprobs_mode=_LOGPROBS_MODES[self.logprobs_mode],
                        min_loops=min_loops, max_loops=max_loops, exit_threshold=float(threshold),
                        priority=self.priority, detokenize=False)


# --- outputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestOutput:
    """One finished request. ``log_probs`` (this spelling): one per token with ``logprobs=0``, else None;
    ``exit_depths``: the loops each token ran; ``weight_version``: the committed version that generated it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    exit_depths: list[int]
    finished: bool
    finish_reason: str  # "stop" (EOS or a stop token) | "length" (max_tokens)
    text: str
    log_probs: list[float] | None
    weight_version: int
    sampling_params: SamplingParams


# --- the engine ---------------------------------------------------------------------------------
def _resolve_device(device: Any) -> str:
    device = str(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("vllm_rlt.LLM: device %r requested but no CUDA device is visible; running on the CPU", device)
        return "cpu"
    return device


def _resolve_dtype(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise InvalidRequestError(f"dtype must be float32, bfloat16 or float16, got {dtype}", param="dtype")
        return _DTYPE_NAMES[dtype]
    name = _DTYPE_ALIASES.get(str(dtype).removeprefix("torch.").lower()) if isinstance(dtype, str) else None
    if name is None:
        raise InvalidRequestError(f"dtype must be a torch.dtype or one of {sorted(_DTYPE_ALIASES)}, got {dtype!r}",
                                  param="dtype")
    return name


class LLM:
    """vllm-rlt's ``LLM`` over :class:`loopline.engine.LLMEngine` (token ids in, token ids out).

    ``model``: a checkpoint directory, or an :class:`~loopline.models.ouro.OuroForCausalLM`.
    ``device="cuda"`` falls back to the CPU (with a warning) when no CUDA device is visible, and
    ``attention_backend="triton"`` to the torch path on the CPU. ``llm.engine`` is the loopline
    engine; ``llm.engine.model`` the served module (Hugging Face parameter names).
    """

    def __init__(self, model: str | os.PathLike | nn.Module, *, device: Any = "cuda", dtype: Any = torch.bfloat16,
                 attention_backend: str = "triton", execution_config: ExecutionConfig | None = None,
                 cache_config: CacheConfig | None = None, scheduler_config: SchedulerConfig | None = None) -> None:
        from loopline.engine import LLMEngine

        if attention_backend not in ("torch", "triton"):
            raise InvalidRequestError(f"attention_backend must be 'torch' or 'triton', got {attention_backend!r}",
                                      param="attention_backend")
        execution_config = execution_config or ExecutionConfig()
        cache_config = cache_config or CacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        device = _resolve_device(device)
        if device == "cpu" and attention_backend == "triton":
            attention_backend = "torch"  # Triton kernels need a GPU
        module = model if isinstance(model, nn.Module) else None
        args = EngineArgs(
            model=None if module is not None else os.fspath(model), skip_tokenizer_init=True, device=device,
            dtype=_resolve_dtype(dtype), attention_backend=attention_backend, enforce_eager=not execution_config.cuda_graphs,
            num_kv_blocks=cache_config.num_blocks, block_size=cache_config.block_size, kv_layout=cache_config.layout,
            enable_prefix_caching=cache_config.enable_prefix_caching, max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            # seed=None requests draw from the engine's RNG: OS entropy, so two engines never draw alike.
            seed=int.from_bytes(os.urandom(8), "little") >> 1, disable_log_stats=True)
        self.engine = LLMEngine(args, model=module)
        self.execution_config, self.cache_config, self.scheduler_config = execution_config, cache_config, scheduler_config
        self._num_loops = self.engine.model_config.total_ut_steps
        self._ids = itertools.count()
        self._closed = False

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs every prompt (a list of token ids) to completion; one output per prompt, in input order."""
        engine = self._engine()
        if engine.is_paused:  # held requests would wait for a resume this call never sees
            raise EngineStateError("generation is paused; call resume_generation() first")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts must be a non-empty list of token-id lists", param="prompts")
        prompts = [list(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError(f"sampling_params must be one vllm_rlt.SamplingParams or one per prompt "
                                      f"({len(prompts)})", param="sampling_params")
        version = engine.get_weight_version()
        ids = [f"rlt-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        done: dict[str, Any] = {}
        try:
            for rid, prompt, sp in zip(ids, prompts, params):
                engine.add_request(rid, {"prompt_token_ids": prompt}, sp.to_loopline(self._num_loops))
                added.append(rid)
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            engine.abort_request([r for r in added if r not in done])  # nothing of this call stays queued
            raise
        return [self._output(done[rid], sp, version) for rid, sp in zip(ids, params)]

    def _output(self, out: Any, sp: SamplingParams, version: int) -> RequestOutput:
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            raise EngineStateError(f"request {out.request_id} ended with {c.finish_reason!r}")
        eff = out.sampling_params
        effective = dataclasses.replace(sp, seed=eff.seed, max_loops=eff.max_loops, min_loops=eff.min_loops)
        assert out.weight_version == version, (out.weight_version, version)  # no update can land inside generate()
        return RequestOutput(request_id=out.request_id, prompt_token_ids=list(out.prompt_token_ids),
                             token_ids=list(c.token_ids), exit_depths=list(c.exit_depths), finished=True,
                             finish_reason=c.finish_reason, text=c.text or "",
                             log_probs=c.token_logprobs if sp.logprobs is not None else None,
                             weight_version=int(out.weight_version), sampling_params=effective)

    # --- control -----------------------------------------------------------------------------
    def pause_generation(self) -> None:
        """Stops generation (idempotent); ``generate`` refuses until ``resume_generation``."""
        self._engine().pause_generation("abort")

    def resume_generation(self) -> None:
        """Lifts a pause; refused while the weights are partially updated."""
        self._engine().resume_generation()

    def reset_prefix_cache(self) -> None:
        self._engine().reset_prefix_cache()

    # --- weights (docs/rl.md §4: each call validated whole before any copy) ---------------------
    def get_weight_version(self) -> int:
        return int(self._engine().get_weight_version())

    def start_weight_update(self, version: int) -> None:
        """Opens an update to ``version``, which must be strictly newer than the committed one."""
        engine = self._engine()
        committed = engine.get_weight_version()
        if isinstance(version, bool) or not isinstance(version, int) or version <= committed:
            raise WeightUpdateError(f"version must be an integer > the committed version {committed}, got {version!r}",
                                    param="version")
        engine.start_weight_update(version)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One shard of ``(HF name, tensor)`` pairs; an unknown name, a duplicate, a wrong shape, a
        non-float dtype or a non-finite value raises ``WeightUpdateError`` (a ``ValueError``) naming it."""
        return self._engine().update_weights(weights)

    def finish_weight_update(self) -> int:
        """Commits the update if every parameter arrived exactly once; returns the new version."""
        return int(self._engine().finish_weight_update())

    def close(self) -> None:
        """Releases the engine; the object serves nothing afterwards."""
        if not self._closed:
            self._closed = True
            on_cuda = self.engine.config.device.type == "cuda"
            self.engine = None  # the last reference to the engine, its weights and its KV pool
            if on_cuda:
                torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _engine(self) -> Any:
        if self._closed:
            raise EngineStateError("this LLM was closed")
        return self.engine
