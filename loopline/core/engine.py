"""The engine: add_request / step / abort_request, one step on one screen.

``step()``: ``scheduler.schedule() -> runner.execute() -> scheduler.update()``,
then the output processor turns new tokens into ``RequestOutput``s and
decides stop strings.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loopline.attention import get_attention_backend
from loopline.config import EngineArgs, EngineConfig, resolve_device, resolve_dtype
from loopline.core.exit_policy import make_exit_policy
from loopline.core.output_processor import OutputProcessor
from loopline.core.queue import make_queue
from loopline.core.request import Request
from loopline.core.scheduler import Preemption, Scheduler, make_allocation, make_scheduling_mode
from loopline.errors import CapacityError, EngineStateError, InvalidRequestError
from loopline.kv.layout import make_layout
from loopline.kv.manager import KVCacheManager
from loopline.models.loader import load_config, load_model, load_tokenizer
from loopline.models.ouro import OuroForCausalLM
from loopline.outputs import RequestOutput
from loopline.sampling_params import SamplingParams
from loopline.worker.model_runner import ModelRunner
from loopline.worker.sampler import Sampler

logger = logging.getLogger("loopline")

PromptType = str | list[int] | dict[str, Any]
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
        if model_path is None:
            from loopline.models.tiny import default_checkpoint
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
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer or model_path)
        layout = make_layout(args.kv_layout, model_cfg.total_ut_steps)
        num_blocks = self._num_kv_blocks(args, device, dtype)
        self.kv = KVCacheManager(num_blocks, args.block_size, layout, args.enable_prefix_caching)
        self.exit_policy = make_exit_policy(args.exit_mode, model_cfg.total_ut_steps, model_cfg.early_exit_threshold)
        block_bytes = ModelRunner.kv_bytes_per_block(model_cfg, args.block_size, dtype)
        preemption = Preemption(int(args.swap_space * 2**30 // block_bytes)) if args.enable_preemption else None
        self.scheduler = Scheduler(self.kv, self.exit_policy, make_scheduling_mode(args.scheduling_mode),
                                   make_queue(args.scheduling_policy), args.max_num_seqs, args.max_num_batched_tokens,
                                   model_cfg.total_ut_steps, allocation=make_allocation(args.kv_allocation),
                                   preemption=preemption, watermark_blocks=int(args.kv_watermark * num_blocks))
        self.runner = ModelRunner(self.model, layout, get_attention_backend(args.attention_backend, device), num_blocks,
                                  args.block_size, args.max_num_seqs, Sampler(args.logprobs_mode), device, dtype)
        if device.type == "cuda" and not args.enforce_eager and self.runner.backend.name == "triton":
            self.runner.capture_graphs(min(max_len, args.max_seq_len_to_capture))
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.weight_version: Any = 0
        self._seed_rng = random.Random(args.seed)
        self._arrivals = itertools.count()
        self._eos = frozenset(model_cfg.eos_token_ids)

    def _num_kv_blocks(self, args: EngineArgs, device: torch.device, dtype: torch.dtype) -> int:
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, args.block_size, dtype)
        if args.kv_cache_memory_gb is not None:
            budget = args.kv_cache_memory_gb * 2**30
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1.0 - args.gpu_memory_utilization) * total
        else:
            budget = _CPU_KV_GB * 2**30
        blocks = int(budget // per_block)
        if blocks <= 0:
            raise CapacityError(f"no memory left for the KV cache (one block needs {per_block} bytes)", param="kv_cache_memory_gb")
        return blocks

    # --- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    *, chat_stop: bool = False) -> None:
        """Validates and queues a request; raises ``InvalidRequestError`` and changes nothing on bad input."""
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
                                 max_loops=params.max_loops or cfg.total_ut_steps,
                                 exit_threshold=cfg.early_exit_threshold if params.exit_threshold is None else params.exit_threshold)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, ids, effective, seed + i, max_tokens, eos, next(self._arrivals)))
        self.outputs.add(request_id, prompt_text, ids, effective, [c.request_id for c in children], self.weight_version)
        for child in children:
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
                req = self.scheduler.finish_request(child, "abort")
                if req is not None:
                    self.outputs.on_finished(req)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt page (pages in use stay with their requests)."""
        self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one loop for every scheduled row; returns outputs of requests that progressed."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.num_running and not sched.preempted_request_ids:
            victim = self.scheduler.blocked_victim()  # nothing can progress: fail one request, clearly
            logger.error("KV cache and swap space exhausted: aborting request %s", victim.request_id)
            self.scheduler.finish_request(victim.request_id, "abort", "kv cache and swap space exhausted")
            self.outputs.on_finished(victim)
            sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
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
        self.stats.steps += 1 if sched.rows else 0
        self.stats.rows += len(sched.rows)
        self.stats.scheduled_tokens += sched.num_tokens
        self.stats.step_time_s += time.perf_counter() - t0
        return self.outputs.collect()
