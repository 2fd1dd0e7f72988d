"""Drop-in modules that let training frameworks drive loopline through another engine's API.

* :mod:`loopline.compat.vllm_rlt` -- the ``vllm_rlt`` module vime's native rollout backend
  (``--rollout-backend vllm-rlt``) imports (docs/rl.md, "vime (vllm-rlt backend)").

Nothing here imports a training framework; inference code never imports this package.
"""
