"""When does a token stop looping? (DESIGN.md §1 exit rule)

Host side: an :class:`ExitPolicy` strategy turns a request and a token index
into the row's :class:`ExitParams`. Device side: :func:`exit_decision` applies
the rule to a batch of rows, vectorized.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from loopline.core.contracts import ExitParams
from loopline.errors import InvalidRequestError
from loopline.sampling_params import SamplingParams


class ExitPolicy(ABC):
    name: str
    per_token = False  # True: the rule changes with the token index (the device needs it under async scheduling)

    def __init__(self, num_loops: int, default_threshold: float) -> None:
        self.num_loops = num_loops
        self.default_threshold = default_threshold

    def validate(self, params: SamplingParams) -> None:
        """Rejects requests this policy cannot serve."""

    @abstractmethod
    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        """Exit rule of the position that produces completion token ``token_index``."""


class ThresholdExit(ExitPolicy):
    """The checkpoint's exit gate with per-request bounds and threshold."""

    name = "threshold"

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        thr = self.default_threshold if params.exit_threshold is None else params.exit_threshold
        return ExitParams(params.min_loops, params.max_loops or self.num_loops, thr)


class FixedExit(ExitPolicy):
    """Full-depth baseline: every token runs ``max_loops`` loops, the gate is ignored."""

    name = "fixed"

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        depth = params.max_loops or self.num_loops
        return ExitParams(depth, depth, 1.0)


class TraceExit(ExitPolicy):
    """Replays recorded per-token depths (``SamplingParams.exit_depths``).

    Token ``k`` exits at ``exit_depths[k]``; past the end of the trace the
    last depth repeats, so a trace can be shorter than the generation.
    """

    name = "trace"
    per_token = True

    def validate(self, params: SamplingParams) -> None:
        if not params.exit_depths:
            raise InvalidRequestError("exit_mode='trace' needs SamplingParams.exit_depths", param="exit_depths")

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        depths = params.exit_depths
        assert depths
        depth = depths[min(token_index, len(depths) - 1)]
        return ExitParams(depth, depth, 1.0)


def make_exit_policy(mode: str, num_loops: int, default_threshold: float) -> ExitPolicy:
    policies = {cls.name: cls for cls in (ThresholdExit, FixedExit, TraceExit)}
    return policies[mode](num_loops, default_threshold)


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
