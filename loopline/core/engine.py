"""The engine: add_request / step / abort_request, one step on one screen.

``step()``: ``scheduler.schedule() -> runner.execute() -> scheduler.update()``,
then the output processor turns new tokens into ``RequestOutput``s and
decides stop strings.
"""
from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loopline.attention import get_attention_backend
from loopline.config import EngineArgs, EngineConfig, resolve_device, resolve_dtype
from loopline.core.exit_policy import make_exit_policy
from loopline.core.contracts import RunnerOutput, SchedulerOutput
from loopline.core.output_processor import OutputProcessor
from loopline.core.queue import make_queue
from loopline.core.request import Request
from loopline.core.scheduler import (AheadProgress, Preemption, Progress, Scheduler, make_allocation,
                                     make_scheduling_mode)
from loopline.core.stat_logger import StatLogger
from loopline.errors import CapacityError, EngineStateError, InvalidRequestError, WeightUpdateError
from loopline.kv.layout import make_layout
from loopline.kv.manager import KVCacheManager
from loopline.models.loader import CONFIG_FILE, iter_checkpoint, load_config, load_model, load_tokenizer
from loopline.models.ouro import OuroForCausalLM
from loopline.outputs import RequestOutput
from loopline.rl.lifecycle import PAUSE_MODES, WAKE_TAGS, GenerationControl
from loopline.rl.weights import WeightUpdater, check_checkpoint_files
from loopline.sampling_params import SamplingParams
from loopline.worker.memory_profile import peak_step_bytes
from loopline.worker.model_runner import ModelRunner
from loopline.worker.sampler import Sampler

logger = logging.getLogger("loopline")

PromptType = str | list[int] | dict[str, Any]
# config.json fields a published checkpoint must share with the served model
_ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps")
_CPU_KV_GB = 1.0


@dataclass
class EngineStats:
    """Counters since start (benchmarks and /metrics read them)."""

    steps: int = 0
    rows: int = 0
    scheduled_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    loops_of_generated: int = 0  # sum of exit depths
    finished_requests: int = 0
    step_time_s: float = 0.0
    prefill_steps: int = 0  # steps with at least one prefill chunk, and their host time
    prefill_step_time_s: float = 0.0
    exit_depth_counts: dict[int, int] = field(default_factory=dict)

    @property
    def rows_per_step(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    @property
    def mean_exit_depth(self) -> float:
        return self.loops_of_generated / self.generated_tokens if self.generated_tokens else 0.0


class LLMEngine:
    """Lower-level streaming engine (vLLM names): ``add_request``, ``step``, ``abort_request``."""

    def __init__(self, args: EngineArgs, model: OuroForCausalLM | None = None) -> None:
        args.validate()
        model_path = args.model
        if model_path is None and (model is None or not args.skip_tokenizer_init):
            from loopline.models.tiny import default_checkpoint  # the bundled model (or its tokenizer)
            model_path = str(default_checkpoint())
        model_cfg = load_config(model_path) if model is None else model.config
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, model_cfg.torch_dtype, device)
        max_len = args.max_model_len or model_cfg.max_position_embeddings
        if max_len > model_cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"max_model_len must be <= the model's max_position_embeddings ({model_cfg.max_position_embeddings}), got {max_len}",
                param="max_model_len")
        self.config = EngineConfig(args, model_path, device, dtype, max_len, model_cfg.total_ut_steps)
        self.model_config = model_cfg
        self.model = model.to(device=device, dtype=dtype).eval() if model is not None else load_model(model_path, dtype, device)
        self._select_kernels(args.kernel_backend, device)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer or model_path)
        layout = make_layout(args.kv_layout, model_cfg.total_ut_steps)
        backend = get_attention_backend(args.attention_backend, device)
        num_blocks = self._num_kv_blocks(args, device, dtype, backend)
        self.kv = KVCacheManager(num_blocks, args.block_size, layout, args.enable_prefix_caching)
        self.exit_policy = make_exit_policy(args.exit_mode, model_cfg.total_ut_steps, model_cfg.early_exit_threshold)
        block_bytes = ModelRunner.kv_bytes_per_block(model_cfg, args.block_size, dtype)
        preemption = Preemption(int(args.swap_space * 2**30 // block_bytes)) if args.enable_preemption else None
        self._async = args.async_scheduling
        self.scheduler = Scheduler(self.kv, self.exit_policy,
                                   make_scheduling_mode("refill" if self._async else args.scheduling_mode),
                                   make_queue(args.scheduling_policy), args.max_num_seqs, args.max_num_batched_tokens,
                                   model_cfg.total_ut_steps, allocation=make_allocation(args.kv_allocation),
                                   preemption=preemption, watermark_blocks=int(args.kv_watermark * num_blocks),
                                   progress=AheadProgress() if self._async else Progress())
        self.runner = ModelRunner(self.model, layout, backend, num_blocks,
                                  args.block_size, args.max_num_seqs, Sampler(args.logprobs_mode), device, dtype)
        self._pending: tuple[SchedulerOutput, Callable[[], RunnerOutput]] | None = None  # async: step in flight
        if self._async:
            self.runner.enable_async(max_len, no_refill=args.scheduling_mode == "no_refill",
                                     per_token_exits=self.exit_policy.per_token)
        if device.type == "cuda" and not args.enforce_eager and self.runner.backend.name == "triton":
            self.runner.capture_graphs(min(max_len, args.max_seq_len_to_capture), args.max_num_batched_tokens)
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._stat_logger = None if args.disable_log_stats else StatLogger(args.log_stats_interval)
        self.weight_version: Any = 0
        self.weights = WeightUpdater(self.model)  # full-weight updates (loopline.rl)
        self.control = GenerationControl()  # pause / sleep state (loopline.rl)
        self._seed_rng = random.Random(args.seed)
        self._arrivals = itertools.count()
        self._eos = frozenset(model_cfg.eos_token_ids)

    def _select_kernels(self, name: str, device: torch.device) -> None:
        if name == "auto":
            name = "triton" if device.type == "cuda" else "torch"
        if name == "triton":
            from loopline.kernels.fused import TritonOps, triton

            if triton is None or (device.type != "cuda" and not os.environ.get("TRITON_INTERPRET")):
                raise InvalidRequestError("kernel_backend='triton' needs the triton package and CUDA (or TRITON_INTERPRET=1)",
                                          param="kernel_backend")
            self.model.use_ops(TritonOps())

    def _num_kv_blocks(self, args: EngineArgs, device: torch.device, dtype: torch.dtype, backend) -> int:
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, args.block_size, dtype)
        if args.kv_cache_memory_gb is not None:
            budget = args.kv_cache_memory_gb * 2**30
        elif device.type == "cuda":
            # Profiling pass: the largest step's activations must fit beside the pool.
            peak = peak_step_bytes(self.model, backend, args.max_num_batched_tokens, args.max_num_seqs,
                                   args.block_size, dtype, device)
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1.0 - args.gpu_memory_utilization) * total - peak
        else:
            budget = _CPU_KV_GB * 2**30
        blocks = int(budget // per_block)
        if blocks <= 0:
            raise CapacityError(f"no memory left for the KV cache (one block needs {per_block} bytes)", param="kv_cache_memory_gb")
        return blocks

    # --- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    *, chat_stop: bool = False) -> None:
        """Validates and queues a request; raises ``InvalidRequestError`` and changes nothing on bad input.

        While generation is paused the request is held and starts at ``resume_generation()``.
        """
        if not self.control.is_paused:
            self._check_may_generate()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}", param="sampling_params")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if self.outputs.has(request_id):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        prompt_text, ids = self._tokenize(prompt)
        cfg = self.model_config
        params.validate_for_model(cfg.total_ut_steps, cfg.vocab_size)
        self.exit_policy.validate(params)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequestError(f"logprobs must be <= max_logprobs ({self.config.max_logprobs}), got {params.logprobs}", param="logprobs")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise InvalidRequestError(f"prompt_logprobs must be <= max_logprobs ({self.config.max_logprobs})", param="prompt_logprobs")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise CapacityError(f"prompt has {len(ids)} tokens; max_model_len is {max_len} (prompt + output)", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise CapacityError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_len})", param="max_tokens")
        if not self.kv.fits_ever(len(ids) + max_tokens - 1):
            raise CapacityError(
                f"request needs {self.kv.blocks_needed(len(ids) + max_tokens - 1)} KV blocks but the pool has "
                f"{self.kv.pool.num_blocks}; lower max_tokens or raise num_kv_blocks", param="max_tokens")
        eos = self._eos | set(self.outputs.chat_end_ids) if chat_stop else self._eos
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        effective = params.clone(seed=seed, max_tokens=max_tokens,
                                 logprobs_mode=params.logprobs_mode or self.config.logprobs_mode,
                                 max_loops=params.max_loops or cfg.total_ut_steps,
                                 exit_threshold=cfg.early_exit_threshold if params.exit_threshold is None else params.exit_threshold)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, ids, effective, seed + i, max_tokens, eos, next(self._arrivals),
                                    spare_positions=1 if self._async else 0))
        self.outputs.add(request_id, prompt_text, ids, effective, [c.request_id for c in children], self.weight_version)
        for child in children:
            if not self.control.hold(child):
                self.scheduler.add_request(child)
        self.stats.prompt_tokens += len(ids) * params.n

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

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Aborts requests (unknown ids are ignored); their KV is freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for child in self.outputs.children(rid):
                req = self.scheduler.finish_request(child, "abort") or self.control.drop_held(child)
                if req is not None:
                    self.outputs.on_finished(req)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt page (pages in use stay with their requests)."""
        self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.control.held) or self._pending is not None

    def has_runnable_requests(self) -> bool:
        """Whether ``step()`` can advance a request: some are in the scheduler and no ``"keep"``
        pause freezes them (requests held by a pause wait for ``resume_generation()``)."""
        busy = self.scheduler.has_unfinished() or self._pending is not None  # async: results still to read
        return busy and not self.control.frozen

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) + len(self.control.held)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one loop for every scheduled row; returns outputs of requests that progressed."""
        t0 = time.perf_counter()
        if self._step_blocked():  # paused with mode "keep", or no usable weights / KV
            return self.outputs.collect()
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.num_running and not sched.preempted_request_ids:
            victim = self.scheduler.blocked_victim()  # nothing can progress: fail one request, clearly
            logger.error("KV cache and swap space exhausted: aborting request %s", victim.request_id)
            self.scheduler.finish_request(victim.request_id, "abort", "kv cache and swap space exhausted")
            self.outputs.on_finished(victim)
            sched = self.scheduler.schedule()
        if self._async:
            # Launch this step, then read the previous one while the device runs it.
            wait = self.runner.launch(sched)
            previous, self._pending = self._pending, ((sched, wait) if sched.rows else None)
            if previous is not None:
                self._apply_results(previous[0], previous[1]())
        else:
            self._apply_results(sched, self.runner.execute(sched))
        self.stats.steps += 1 if sched.rows else 0
        self.stats.rows += len(sched.rows)
        self.stats.scheduled_tokens += sched.num_tokens
        elapsed = time.perf_counter() - t0
        self.stats.step_time_s += elapsed
        if any(r.is_prefill for r in sched.rows):
            self.stats.prefill_steps += 1
            self.stats.prefill_step_time_s += elapsed
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(self)
        return self.outputs.collect()

    def _apply_results(self, sched: SchedulerOutput, result: RunnerOutput) -> None:
        touched = self.scheduler.update(sched, result)
        for rid, entries in result.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(rid, entries)
        for req in touched:
            tok = req.output[-1]
            self.stats.generated_tokens += 1
            self.stats.loops_of_generated += tok.exit_depth
            self.stats.exit_depth_counts[tok.exit_depth] = self.stats.exit_depth_counts.get(tok.exit_depth, 0) + 1
            stop = self.scheduler.check_stop(req) or self.outputs.check_stop_strings(req)
            if stop is not None:
                self.scheduler.finish_request(req.request_id, *stop)
                self.stats.finished_requests += 1
            self.outputs.on_token(req, self.weight_version)

    # --- RL: weight updates, pause / resume, sleep (the logic lives in loopline.rl) -------
    def get_weight_version(self) -> int:
        """The committed weight version (0 for the weights loaded at start)."""
        return self.weight_version

    def start_weight_update(self, version: int) -> None:
        """Opens a full-weight update to ``version`` (>= the committed one; equal re-publishes).

        The engine must be idle or paused with nothing generating (``"abort"``, a drained
        ``"wait"``, or ``"keep"``, whose frozen requests continue on the new weights).
        """
        if self.scheduler.has_unfinished() and not self.control.frozen:
            raise EngineStateError(
                f"weight updates need an idle or paused engine, but {len(self.scheduler.requests)} request(s) are "
                "generating; pause_generation('abort' | 'keep'), or 'wait' until is_drained, first")
        if self.control.weights_asleep:
            raise EngineStateError("the weights are asleep (sleep(level=2)); wake_up(tags=['weights']) first")
        self.weights.start(version, self.weight_version)

    def update_weights(self, weights: Any) -> int:
        """Validates, then copies in place, one batch of ``(HF name, tensor)`` pairs (call once per shard)."""
        return self.weights.update(weights)

    def finish_weight_update(self) -> int:
        """Commits the update once every parameter arrived: prefix cache reset, new salt, new version."""
        version, changed = self.weights.finish()
        if changed:
            self.weight_version = version
            self.scheduler.cache_salt = version
            self.kv.reset_prefix_cache()
        return version

    def abort_weight_update(self) -> None:
        """Drops an open update: the old weights still serve unless some tensors were already copied."""
        self.weights.abort()

    def update_weights_from_disk(self, path: str, version: int) -> int:
        """Publishes a safetensors checkpoint directory as ``version``: every shard is read and
        validated before anything is copied, then streamed shard by shard."""
        self.start_weight_update(version)
        try:
            check_checkpoint_files(path)  # every file it names stays inside the directory
            if (Path(path) / CONFIG_FILE).is_file():
                cfg, mine = load_config(path), self.model_config
                differ = [f"{k}={getattr(cfg, k)!r} (serving {getattr(mine, k)!r})" for k in _ARCHITECTURE
                          if getattr(cfg, k) != getattr(mine, k)]
                if differ:
                    raise WeightUpdateError(f"{path}: the checkpoint's architecture differs: {', '.join(differ)}",
                                            param="path")
            seen: set[str] = set()
            for shard in iter_checkpoint(path):  # dry run: names, shapes, dtypes, finite values, duplicates
                seen.update(n for n, _, _ in self.weights.validate(shard, already_seen=seen))
            self.weights.check_complete(seen, path)  # a missing tensor is refused before the first copy
            for shard in iter_checkpoint(path):
                self.update_weights(shard)
        except BaseException:
            self.weights.abort()  # no-op if the failed call already closed the update
            raise
        return self.finish_weight_update()

    def pause_generation(self, mode: str = "abort") -> None:
        """Pauses generation: ``"abort"`` in-flight requests, ``"wait"`` for them to drain (keep
        stepping), or ``"keep"`` them frozen with their KV. New requests are held until resume.
        Outputs of aborted requests come from the next ``step()``."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", param="mode")
        self.control.pause_mode = mode
        if mode == "abort":
            finished = [self.scheduler.finish_request(rid, "abort") for rid in list(self.scheduler.requests)]
            finished += [self.control.drop_held(req.request_id) for req in list(self.control.held)]
            for req in finished:
                self.outputs.on_finished(req)

    def resume_generation(self) -> None:
        """Resumes after a pause: frozen requests continue, held ones are queued in arrival order."""
        if not self.control.is_paused:
            return
        self._check_may_generate()
        self.control.pause_mode = None
        for req in self.control.take_held():
            self.scheduler.add_request(req)

    @property
    def is_paused(self) -> bool:
        return self.control.is_paused

    @property
    def is_drained(self) -> bool:
        """Paused and no request left in flight (held ones have not started)."""
        return self.control.is_paused and not self.scheduler.has_unfinished()

    @property
    def is_sleeping(self) -> bool:
        return self.control.is_sleeping

    def sleep(self, level: int = 1) -> None:
        """Frees device memory for a colocated trainer: level 1 the KV pool, level 2 also the
        weights (moved to CPU memory). Needs no request in flight."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
        if self.scheduler.has_unfinished():
            raise EngineStateError(f"sleep needs no request in flight, but {len(self.scheduler.requests)} are "
                                   "unfinished; abort them (pause_generation('abort')) or let them finish")
        if self.weights.in_progress:
            raise EngineStateError("a weight update is in progress; finish or abort it before sleeping")
        if not self.control.kv_asleep:
            self.kv.reset_prefix_cache()  # cached pages die with the pool
            self.runner.release_kv_cache()
            self.control.kv_asleep = True
        if level == 2 and not self.control.weights_asleep:
            self.model.ops.release(self.model)  # packed weights must not pin device memory
            self.control.offload_weights(self.model)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what ``sleep`` released (``tags``: ``"weights"`` and/or ``"kv_cache"``; default both)."""
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad:
            raise InvalidRequestError(f"tags must be among {list(WAKE_TAGS)}, got {bad}", param="tags")
        if "weights" in tags and self.control.weights_asleep:
            self.control.restore_weights(self.model, self.config.device)
            self.model.ops.prepare(self.model)
        if "kv_cache" in tags and self.control.kv_asleep:
            self.runner.allocate_kv_cache()
            self.control.kv_asleep = False
        if not self.control.is_sleeping:
            self.runner.restore_graphs()  # needs both weights and KV at their (new) addresses

    def _not_ready_reason(self) -> str | None:
        if self.weights.in_progress:
            return f"a weight update to version {self.weights.pending_version} is in progress"
        if self.weights.broken:
            return ("the weights are partially updated (an update failed after copying some tensors); publish a "
                    "complete update (start_weight_update / update_weights / finish_weight_update) first")
        if self.control.is_sleeping:
            return "the engine is asleep; call wake_up() first"
        return None

    def _check_may_generate(self) -> None:
        reason = self._not_ready_reason()
        if reason is not None:
            raise EngineStateError(f"cannot generate: {reason}")

    def _step_blocked(self) -> bool:
        """True when ``step`` must not run the model: frozen, or no usable weights / KV."""
        if self.control.frozen:
            return True
        reason = self._not_ready_reason()
        if reason is None:
            return False
        if self.scheduler.has_unfinished():
            raise EngineStateError(f"cannot step: {reason}")
        return True
