"""Adapters that make loopline the rollout engine of training frameworks (optional extras).

* :mod:`loopline.integrations.verl` -- verl 0.9.1 (``pip install "loopline[verl]"``;
  ``actor_rollout_ref.rollout.name=loopline``; docs/rl.md, "verl").

Nothing here is imported by inference code or by ``import loopline``.
"""
