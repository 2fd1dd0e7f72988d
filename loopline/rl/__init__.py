"""Rollout and weight-update contract for RL trainers (framework-independent; docs/rl.md).

* :mod:`loopline.rl.replay` -- differentiable replay of rollout logprobs on the dense model.
"""
from loopline.rl.replay import replay_logprobs, replay_logprobs_batch

__all__ = ["replay_logprobs", "replay_logprobs_batch"]
