"""Rollout and weight-update contract for RL trainers (framework-independent; docs/rl.md).

* :mod:`loopline.rl.replay` -- differentiable replay of rollout logprobs on the dense model.
* :mod:`loopline.rl.weights` -- validated, in-place full-weight updates.
* :mod:`loopline.rl.lifecycle` -- pause / resume and sleep / wake-up state.
* :mod:`loopline.rl.buckets` -- a trainer's ``(name, tensor)`` stream published in size-bounded buckets.
* :mod:`loopline.entrypoints.rollout_server` -- a token-in / token-out server over ``AsyncLLM`` with a
  trainer's control flow (the core of the verl plug-in, ``loopline.integrations.verl``).

The engine-facing methods are on :class:`~loopline.engine.LLMEngine` and
:class:`~loopline.LLM` (``start_weight_update``, ``pause_generation``, ...).
"""
from loopline.rl.buckets import PublishStats, iter_buckets, publish, publish_async
from loopline.rl.replay import replay_logprobs, replay_logprobs_batch
from loopline.rl.weights import WeightUpdater

__all__ = ["replay_logprobs", "replay_logprobs_batch", "WeightUpdater", "iter_buckets", "publish", "publish_async",
           "PublishStats"]
