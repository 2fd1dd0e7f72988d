"""Adapters that make loopline the rollout engine of training frameworks (optional extras).

* :mod:`loopline.integrations.verl` -- verl 0.9.1 (``pip install "loopline[verl]"``;
  ``actor_rollout_ref.rollout.name=loopline``; docs/rl.md, "verl"); its trainer hook
  :mod:`loopline.integrations.verl_trainer` and CPU platform :mod:`loopline.integrations.verl_cpu`.
* :mod:`loopline.integrations.rollout_seed` -- per-sample rollout seeds stable across resumes (no framework).
* :mod:`loopline.integrations.verl_checkpoint` -- verl's actor checkpoint as a directory loopline serves
  (torch only).

Nothing here is imported by inference code or by ``import loopline``.
"""
