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

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from loopline.core.request import Request
from loopline.core.scheduler import Scheduler
from loopline.engine.output_processor import OutputProcessor
from loopline.errors import EngineStateError, InvalidRequestError, WeightUpdateError
from loopline.kv.manager import KVCacheManager
from loopline.models.family import family_of
from loopline.models.loader import (
    CONFIG_FILE,
    iter_checkpoint_tensors,
    load_looped_config,
)
from loopline.models.ouro import OuroForCausalLM
from loopline.rl.lifecycle import PAUSE_MODES, WAKE_TAGS, GenerationControl
from loopline.rl.weights import WeightUpdater, check_checkpoint_files
from loopline.spec.adapter import find_adapter
from loopline.worker.model_runner import ModelRunner


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
        self.disk_load: DiskLoad | None = None  # the update from disk under way (one at a time)

    # --- readiness --------------------------------------------------------------------
    def not_ready_reason(self) -> str | None:
        """Why the engine cannot generate now (None: it can)."""
        if self.weights.in_progress and not self.swap_pending:  # (an update from disk holds new requests instead)
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
        if self.frozen or (self.disk_load is not None and self.disk_load.opened):
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
        self._check_no_disk_load()
        self._open_update(version)

    def _open_update(self, version: int) -> None:
        self._check_not_generating()
        if self.weights_asleep:
            raise EngineStateError("the weights are asleep (sleep(level=2)); wake_up(tags=['weights']) first")
        self.weights.start(version, self.weight_version)

    def _check_not_generating(self) -> None:
        if self.generating:
            raise EngineStateError(
                f"weight updates need an idle or paused engine, but {len(self.scheduler.requests)} request(s) are "
                "generating; pause_generation('abort' | 'keep'), or 'wait' until is_drained, first")

    @property
    def generating(self) -> bool:
        """Some request runs (not frozen by a ``"keep"`` pause): a weight update must wait or be refused."""
        return self.scheduler.has_unfinished() and not self.frozen

    def _check_no_disk_load(self) -> None:
        if self.disk_load is not None:
            raise EngineStateError(f"a weight update from disk ({self.disk_load.path} as version "
                                   f"{self.disk_load.version}) is under way; one update at a time: wait for its reply")

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
            if self.runner.spec is not None:  # the drafts' adapter belonged to the old weights
                self.runner.spec.head.drop()
        return version

    def find_update_adapter(self, path: str):
        """The draft adapter an update from ``path`` brings (trained on exactly its weight files), if the engine
        speculates and ``speculative_config.draft_adapter`` is not ``"none"``; else ``None``."""
        head = None if self.runner.spec is None else self.runner.spec.head
        if head is None or head.setting == "none":
            return None
        found = find_adapter(path, self.model_config.hidden_size, self.model_config.total_ut_steps, head.depth)
        return None if found is None else (*found, str(path))

    def update_weights_from_disk(self, path: str, version: int) -> int:
        """The verb in one call (``LLMEngine``, ``LLM``): the engine must be idle or paused, as for
        ``start_weight_update``. The engine loop runs the same stages of :class:`DiskLoad` on a reader
        thread instead (``runtime.core``), so that generation goes on while the checkpoint is read."""
        self._check_not_generating()  # nobody would step the requests in flight while this call waits
        load = self.stage_update_weights_from_disk(path, version)
        try:
            load.validate()
            load.open()
            for items in load.pieces():
                load.apply(items)
            return load.commit()
        except BaseException:
            load.cancel()
            raise

    def stage_update_weights_from_disk(self, path: str, version: int) -> DiskLoad:
        """Begins an update from disk (engine thread): refuses at once what no checkpoint could fix (a
        version that does not increase, an update under way, weights asleep); the checkpoint is read by
        the returned :class:`DiskLoad`."""
        self._check_no_disk_load()
        self.weights.check_start(version, self.weight_version)
        if self.weights_asleep:
            raise EngineStateError("the weights are asleep (sleep(level=2)); wake_up(tags=['weights']) first")
        self.disk_load = DiskLoad(self, path, version)
        return self.disk_load

    @property
    def swap_pending(self) -> bool:
        """A validated update from disk waits for the requests in flight (or is being copied): requests
        added meanwhile are held, so those in flight finish on one weight version and the swap comes."""
        return self.disk_load is not None and self.disk_load.validated

    def hold(self, request: Request) -> bool:
        if self.swap_pending:
            self.held.append(request)
            return True
        return super().hold(request)

    def _release_held(self) -> None:
        """Hands the held requests to the scheduler unless a pause (or a pending swap) still holds them."""
        if not self.is_paused and not self.swap_pending:
            for req in self.take_held():
                self.scheduler.add_request(req)

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
        self._release_held()

    # --- sleep ------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
        if self.scheduler.has_unfinished():
            raise EngineStateError(f"sleep needs no request in flight, but {len(self.scheduler.requests)} are "
                                   "unfinished; abort them (pause_generation('abort')) or let them finish")
        if self.weights.in_progress:
            raise EngineStateError("a weight update is in progress; finish or abort it before sleeping")
        self._check_no_disk_load()
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


class DiskLoad:
    """One ``update_weights_from_disk`` in stages, so that only the copy needs the engine thread.

    Any thread (they read files and validate, touching no engine state): :meth:`validate` reads every
    tensor once, one at a time (names, shapes, dtypes, finite values, the checkpoint's architecture,
    every file inside the directory), and refuses an incomplete set; :meth:`pieces` reads them again,
    one validated tensor at a time, for the copy. Engine thread: :meth:`open` once no request
    generates (``ready``), :meth:`apply` each piece, :meth:`commit`; :meth:`cancel` on any failure
    (nothing copied: the old weights serve; else the weights are partially updated, as for any update
    that fails mid-copy). From :meth:`validate`'s end to :meth:`commit` new requests are held.
    """

    def __init__(self, control: EngineControl, path: str, version: int) -> None:
        self.control, self.path, self.version = control, path, version
        self.validated = False  # set by the reader: the swap is pending
        self.opened = False  # the weight update is open (the copy is under way)
        self.cancelled = False  # the reader stops at its next tensor
        self.adapter = None  # the draft adapter the checkpoint brings (found by validate)

    # --- any thread ---------------------------------------------------------------------
    def validate(self) -> None:
        path, weights = self.path, self.control.weights
        check_checkpoint_files(path)  # every file it names stays inside the directory
        if (Path(path) / CONFIG_FILE).is_file():
            cfg, mine = load_looped_config(path), self.control.model_config
            # config.json fields a published checkpoint must share with the served model (its family's)
            fields = ("model_type",) + (family_of(mine).architecture_fields if cfg.model_type == mine.model_type else ())
            differ = [f"{k}={getattr(cfg, k)!r} (serving {getattr(mine, k)!r})" for k in fields
                      if getattr(cfg, k) != getattr(mine, k)]
            if differ:
                raise WeightUpdateError(f"{path}: the checkpoint's architecture differs: {', '.join(differ)}",
                                        param="path")
        # NOTE: tensor by tensor, twice: the dry run holds one tensor at a time, never a shard or the model
        seen: set[str] = set()
        tied = weights.tied
        digests: dict[str, bytes] = {}  # of the tied parameters and their sources, to compare them without both
        for entry in self._tensors():  # names, shapes, dtypes, finite values, duplicates
            items = weights.validate([entry], already_seen=seen)
            seen.update(n for n, _, _ in items)
            for name, _, src in items:
                if name in tied or name in tied.values():
                    digests[name] = _digest(src)
        weights.check_complete(seen, path)  # a missing tensor is refused before the first copy
        for name, source in tied.items():  # a tied pair stored apart is refused before the first copy too
            if name in digests and source in digests and digests[name] != digests[source]:
                raise WeightUpdateError(f"{path}: {name} differs from {source}, which the model's config ties it "
                                        f"to; allowed: equal tensors, or {name} left out", param=name)
        self.adapter = self.control.find_update_adapter(path)  # (a malformed one refuses the update here)
        self.validated = True

    def pieces(self) -> Iterator[list[tuple[str, Any, Any]]]:
        """The validated ``(name, parameter, source)`` entries of each tensor, read again one at a time."""
        check_checkpoint_files(self.path)  # again: the directory may have changed while the swap waited
        seen: set[str] = set()
        for entry in self._tensors():
            items = self.control.weights.validate([entry], already_seen=seen)
            seen.update(n for n, _, _ in items)
            yield items

    def _tensors(self) -> Iterator[tuple[str, Any]]:
        for entry in iter_checkpoint_tensors(self.path):
            if self.cancelled:
                raise EngineStateError(f"the weight update from {self.path} was cancelled")
            yield entry

    # --- engine thread ------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Validated, and no request generates (idle, drained, or frozen by a ``"keep"`` pause)."""
        return self.validated and not self.control.generating

    def open(self) -> None:
        self.control._open_update(self.version)
        self.opened = True

    def apply(self, items: list[tuple[str, Any, Any]]) -> None:
        self.control.weights.apply(items)

    def commit(self) -> int:
        try:
            version = self.control.finish_weight_update()
            if self.adapter is not None:  # the update brings its own draft adapter
                self.control.runner.spec.head.install(*self.adapter)
            return version
        finally:
            self._end()

    def cancel(self) -> None:
        self.cancelled = True
        if self.opened:
            self.control.weights.abort()  # broken only if something was copied
        self._end()

    def _end(self) -> None:
        if self.control.disk_load is self:
            self.control.disk_load = None
            self.control._release_held()


def _digest(t: torch.Tensor) -> bytes:
    """A digest of a tensor's bytes (its dtype and shape are checked elsewhere)."""
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).digest()
