"""Per-sample sampling seeds for a trainer's rollouts, stable across runs and resumes (framework-free).

A trainer that saves at iteration k and resumes must see the same rollouts at iteration k+1 as the
run that went on. Unseeded requests draw fresh randomness, so they cannot; a seed derived from what
identifies a sample in the trainer's schedule can. :func:`rollout_seed` hashes

* ``base_seed`` (verl: ``actor_rollout_ref.rollout.seed``),
* ``phase`` (``"train"`` or ``"val"``: validation at step t never shares a train sample's seed),
* ``global_steps`` (the trainer's iteration; a resumed run restores it from the checkpoint),
* ``index`` (the dataset row's index, verl's ``extra_info.index``),
* ``prompt`` (a canonical text of the sample's prompt: rows with equal indices still differ),
* ``session_id`` (which of the ``n`` samples of one prompt),

into a 63-bit non-negative integer with BLAKE2b, so it depends on nothing process-local (Python's
``hash`` is salted per process; arrival order and request ids vary per run). The engine's sampling
is counter-based per request (seed and token index), so the same seed gives the same tokens
whatever else is batched with the request.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["prompt_key", "rollout_seed"]


def prompt_key(prompt: Any) -> str:
    """A canonical text of a prompt (token ids, a string, or chat messages) for :func:`rollout_seed`."""
    if hasattr(prompt, "tolist"):  # numpy arrays, tensors
        prompt = prompt.tolist()
    return json.dumps(prompt, sort_keys=True, default=str, separators=(",", ":"))


def rollout_seed(base_seed: int, global_steps: int, index: int, session_id: int, prompt: str = "",
                 phase: str = "train") -> int:
    """The sampling seed of one sample (see the module docstring): a non-negative int below ``2**63``."""
    if phase not in ("train", "val"):
        raise ValueError(f"phase must be 'train' or 'val', got {phase!r}")
    key = json.dumps([int(base_seed), phase, int(global_steps), int(index), int(session_id), str(prompt)])
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1
