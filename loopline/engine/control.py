"""Engine control for RL trainers: pause / resume, sleep / wake up, versioned full-weight updates.

The state and its rules live in ``loopline.rl`` (``GenerationControl``,
``WeightUpdater``); this module applies them to the engine's parts: it
finishes or holds requests in the scheduler, frees and restores the KV pool
and the weights, and commits weight versions (prefix cache reset, new salt).

:class:`EngineControl` is the engine's control port: it serves every verb of
``engine/verbs.py`` (but the engine loop's own) under the verb's name -- a method,
or a property for a state verb -- and ``LLMEngine.control_call`` dispatches to it.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loopline.core.request import Request
from loopline.core.scheduler import Scheduler
from loopline.engine.output_processor import OutputProcessor
from loopline.errors import EngineStateError, InvalidRequestError, WeightUpdateError
from loopline.kv.manager import KVCacheManager
from loopline.models.loader import CONFIG_FILE, iter_checkpoint_tensors, load_config
from loopline.models.ouro import OuroForCausalLM
from loopline.rl.lifecycle import PAUSE_MODES, WAKE_TAGS, GenerationControl
from loopline.rl.weights import WeightUpdater, check_checkpoint_files
from loopline.worker.model_runner import ModelRunner

# config.json fields a published checkpoint must share with the served model
_ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps")


class EngineControl(GenerationControl):
    """Pause, sleep and weight-update control over one engine's scheduler, KV, runner and model."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, runner: ModelRunner, model: OuroForCausalLM,
                 outputs: OutputProcessor, model_config: Any, device: Any,
                 on_finished: Callable[[Request], Any] | None = None) -> None:
        """``on_finished(req)`` books each request a ``"abort"`` pause ended (default: the output processor's)."""
        super().__init__()
        self.scheduler, self.kv, self.runner, self.model, self.outputs = scheduler, kv, runner, model, outputs
        self.model_config, self.device = model_config, device
        self.on_finished = on_finished or outputs.on_finished
        self.weights = WeightUpdater(model)
        self.weight_version: Any = 0

    # --- readiness --------------------------------------------------------------------
    def not_ready_reason(self) -> str | None:
        """Why the engine cannot generate now (None: it can)."""
        if self.weights.in_progress:
            return f"a weight update to version {self.weights.pending_version} is in progress"
        if self.weights.broken:
            return ("the weights are partially updated (an update failed after copying some tensors); publish a "
                    "complete update (start_weight_update / update_weights / finish_weight_update) first")
        if self.is_sleeping:
            return "the engine is asleep; call wake_up() first"
        return None

    def check_may_generate(self) -> None:
        reason = self.not_ready_reason()
        if reason is not None:
            raise EngineStateError(f"cannot generate: {reason}")

    def step_blocked(self) -> bool:
        """True when a step must not run the model: frozen by a ``"keep"`` pause, or no usable weights
        or KV with nothing in flight. Requests in flight that cannot run (a ``"wait"`` pause after an
        update left the weights partial) raise ``EngineStateError``: the caller fails them; waiting
        would deadlock, since a new update needs them finished or frozen."""
        if self.frozen:
            return True
        reason = self.not_ready_reason()
        if reason is None:
            return False
        if self.scheduler.has_unfinished():
            raise EngineStateError(f"cannot step: {reason}")
        return True

    # --- weight updates ---------------------------------------------------------------
    def get_weight_version(self) -> Any:
        return self.weight_version

    def start_weight_update(self, version: int) -> None:
        if self.scheduler.has_unfinished() and not self.frozen:
            raise EngineStateError(
                f"weight updates need an idle or paused engine, but {len(self.scheduler.requests)} request(s) are "
                "generating; pause_generation('abort' | 'keep'), or 'wait' until is_drained, first")
        if self.weights_asleep:
            raise EngineStateError("the weights are asleep (sleep(level=2)); wake_up(tags=['weights']) first")
        self.weights.start(version, self.weight_version)

    def update_weights(self, weights: Any) -> int:
        return self.weights.update(weights)

    def abort_weight_update(self) -> None:
        self.weights.abort()

    def finish_weight_update(self) -> int:
        version, changed = self.weights.finish()
        if changed:
            self.weight_version = version
            self.scheduler.cache_salt = version
            self.kv.reset_prefix_cache()
        return version

    def update_weights_from_disk(self, path: str, version: int) -> int:
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
            # NOTE: tensor by tensor, twice: the dry run holds one tensor at a time, never a shard or the model
            seen: set[str] = set()
            for entry in iter_checkpoint_tensors(path):  # dry run: names, shapes, dtypes, finite values, duplicates
                seen.update(n for n, _, _ in self.weights.validate([entry], already_seen=seen))
            self.weights.check_complete(seen, path)  # a missing tensor is refused before the first copy
            for entry in iter_checkpoint_tensors(path):
                self.weights.update([entry])
        except BaseException:
            self.weights.abort()  # no-op if the failed call already closed the update
            raise
        return self.finish_weight_update()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    # --- pause ------------------------------------------------------------------------
    def pause_generation(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", param="mode")
        self.pause_mode = mode
        if mode == "abort":
            finished = [self.scheduler.finish_request(rid, "abort") for rid in list(self.scheduler.requests)]
            finished += [self.drop_held(req.request_id) for req in list(self.held)]
            for req in finished:
                self.on_finished(req)

    @property
    def is_drained(self) -> bool:
        return self.is_paused and not self.scheduler.has_unfinished()

    def resume_generation(self) -> None:
        if not self.is_paused:
            return
        self.check_may_generate()
        self.pause_mode = None
        for req in self.take_held():
            self.scheduler.add_request(req)

    # --- sleep ------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
        if self.scheduler.has_unfinished():
            raise EngineStateError(f"sleep needs no request in flight, but {len(self.scheduler.requests)} are "
                                   "unfinished; abort them (pause_generation('abort')) or let them finish")
        if self.weights.in_progress:
            raise EngineStateError("a weight update is in progress; finish or abort it before sleeping")
        if not self.kv_asleep:
            self.kv.reset_prefix_cache()  # cached pages die with the pool
            self.runner.release_kv_cache()
            self.kv_asleep = True
        if level == 2 and not self.weights_asleep:
            self.model.ops.release(self.model)  # packed weights must not pin device memory
            self.offload_weights(self.model)

    def wake_up(self, tags: list[str] | None) -> None:
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad:
            raise InvalidRequestError(f"tags must be among {list(WAKE_TAGS)}, got {bad}", param="tags")
        if "weights" in tags and self.weights_asleep:
            self.restore_weights(self.model, self.device)
            self.model.ops.prepare(self.model)
        if "kv_cache" in tags and self.kv_asleep:
            self.runner.allocate_kv_cache()
            self.kv_asleep = False
        if not self.is_sleeping:
            self.runner.restore_graphs()  # needs both weights and KV at their (new) addresses

    # --- measurements -----------------------------------------------------------------
    def device_memory_stats(self, reset_peak: bool) -> dict[str, int] | None:
        device = self.device
        if device.type != "cuda":
            return None
        stats = {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return stats
