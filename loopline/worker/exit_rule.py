"""The exit rule (docs/design.md, 'The model: loops and exits') on the device, vectorized over a batch of rows."""
from __future__ import annotations

import torch
from torch import Tensor


def exit_decision(loop: Tensor | int, survival: Tensor | float, gate_logit: Tensor, min_loops: Tensor | int,
                  max_loops: Tensor | int, threshold: Tensor | float) -> tuple[Tensor, Tensor]:
    """Applies the exit rule after loop ``loop`` (1-based) for B rows.

    survival: ``[B]`` fp32 ``prod_{i<r}(1 - lambda_i)`` before this loop (1 at loop 1).
    Every argument but the gate may also be a Python number shared by all rows.
    Returns ``(exit [B] bool, survival after this loop [B] fp32)``; ``F_r = 1 - survival``.
    """
    lam = torch.sigmoid(gate_logit.float())
    survival = survival * (1.0 - lam)
    cdf = 1.0 - survival
    early = (threshold < 1.0) & (loop >= min_loops) & (cdf >= threshold)
    return (loop >= max_loops) | early, survival
