"""When does a token stop looping? (DESIGN.md §1 exit rule)

Host side (no torch): an :class:`ExitPolicy` strategy turns a request and a
token index into the row's :class:`ExitParams`. The device applies the rule to
a batch of rows in ``loopline.worker.exit_rule``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from loopline.core.contracts import ExitParams
from loopline.errors import InvalidRequestError
from loopline.sampling_params import SamplingParams


class ExitPolicy(ABC):
    name: str
    per_token = False  # True: the rule changes with the token index, which only the device knows

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
