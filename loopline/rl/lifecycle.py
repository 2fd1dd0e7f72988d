"""Pause and sleep state for RL rollouts (vLLM names), consulted by the engine.

Pause modes (``pause_generation(mode)``):

* ``"abort"``: every unfinished request ends with ``finish_reason="abort"``.
* ``"wait"``: requests submitted from now on are held (not admitted); the
  ones already submitted keep running until they finish (the caller keeps
  stepping; ``is_drained`` says when they are done).
* ``"keep"``: every request is frozen with its KV and per-slot state intact:
  ``step()`` runs nothing until ``resume_generation()``, after which each one
  produces exactly the tokens it would have produced (same weights assumed).

In every mode, requests added while paused are held and handed to the
scheduler, in order, at resume.

Sleep (``sleep(level)``) frees device memory for a colocated trainer: level 1
releases the KV pool; level 2 also moves the weights to CPU memory. ``wake_up``
restores them (``tags``: ``"weights"``, ``"kv_cache"``).
"""
from __future__ import annotations

from torch import Tensor, nn

from loopline.core.request import Request, RequestStatus

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


class GenerationControl:
    """Who may run: pause mode, requests held while paused, and what is asleep."""

    def __init__(self) -> None:
        self.pause_mode: str | None = None
        self.held: list[Request] = []  # submitted while paused, not yet given to the scheduler
        self.kv_asleep = False
        self._offloaded: dict[str, Tensor] | None = None  # weights moved to CPU by sleep(level=2)

    # --- pause ------------------------------------------------------------------------
    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def frozen(self) -> bool:
        """``pause_generation("keep")``: nothing runs, in-flight requests keep their state."""
        return self.pause_mode == "keep"

    def hold(self, request: Request) -> bool:
        """Keeps a request submitted while paused; False when not paused (schedule it now)."""
        if self.pause_mode is None:
            return False
        self.held.append(request)
        return True

    def take_held(self) -> list[Request]:
        held, self.held = self.held, []
        return held

    def drop_held(self, request_id: str, reason: str = "abort") -> Request | None:
        """Finishes a held request (it never reached the scheduler, so it holds no KV)."""
        for i, req in enumerate(self.held):
            if req.request_id == request_id:
                del self.held[i]
                req.status = RequestStatus.FINISHED
                req.finish_reason, req.stop_reason = reason, None
                return req
        return None

    # --- sleep ------------------------------------------------------------------------
    @property
    def weights_asleep(self) -> bool:
        return self._offloaded is not None

    @property
    def is_sleeping(self) -> bool:
        return self.kv_asleep or self.weights_asleep

    def offload_weights(self, model: nn.Module) -> None:
        """Moves every parameter and buffer to CPU memory and frees its device storage.

        NOTE: the device storage is re-allocated by :meth:`restore_weights`, so parameter
        addresses change: captured CUDA graphs must be recaptured after waking up.
        """
        saved: dict[str, Tensor] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            if name in saved or t.numel() == 0:
                continue
            saved[name] = t.data.to("cpu", copy=True)
            t.data = t.data.new_empty(0)
        self._offloaded = saved

    def restore_weights(self, model: nn.Module, device) -> None:
        saved, self._offloaded = self._offloaded, None
        assert saved is not None
        for name, t in model.state_dict(keep_vars=True).items():
            if name in saved:
                t.data = saved[name].to(device)
