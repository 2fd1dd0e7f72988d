"""Rollout and weight-update contract for RL trainers (framework-independent; docs/rl.md).

* :mod:`loopline.rl.replay` -- differentiable replay of rollout logprobs on the dense model.
* :mod:`loopline.rl.weights` -- validated, in-place full-weight updates.
* :mod:`loopline.rl.lifecycle` -- pause / resume and sleep / wake-up state.

The engine-facing methods are on :class:`~loopline.engine.LLMEngine` and
:class:`~loopline.LLM` (``start_weight_update``, ``pause_generation``, ...).
"""
from loopline.rl.replay import replay_logprobs, replay_logprobs_batch
from loopline.rl.weights import WeightUpdater

__all__ = ["replay_logprobs", "replay_logprobs_batch", "WeightUpdater"]
