"""verl's custom reward function for the GRPO recipe on the demo model (docs/rl.md, section 10).

verl loads this file by path (``reward.custom_reward_function.path``) and calls
``compute_score(data_source, solution_str, ground_truth, extra_info)`` per sample: here the
``python_closes`` reward of ``loopline.train.rewards`` (the prompt is the ground truth: 1.0 when
prompt + the completion's first line parses as Python, 0.5 when that line closes the prompt's
brackets, else 0).
"""
from __future__ import annotations

from typing import Any

from loopline.train.rewards import python_closes


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any) -> float:
    """The ``python_closes`` reward of one completion (``ground_truth`` is its prompt text)."""
    return python_closes(ground_truth, solution_str)
