"""When does a token stop looping? (docs/design.md, 'The model: loops and exits')

Host side (no torch): an :class:`ExitPolicy` strategy turns a request and a
token index into the row's :class:`ExitParams`. The device applies the rule to
a batch of rows in ``loopline.worker.exit_rule``.

Policies read a request's *effective* parameters: ``max_loops`` and
``exit_threshold`` were resolved from the checkpoint when the request was added
(``InputProcessor.process``, the one place request defaults are decided), so no
policy decides a default of its own.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from loopline.core.contracts import ExitParams
from loopline.errors import InvalidRequestError
from loopline.sampling_params import SamplingParams


class ExitPolicy(ABC):
    name: str
    per_token = False  # True: the rule changes with the token index, which only the device knows

    def validate(self, params: SamplingParams) -> None:
        """Rejects requests this policy cannot serve."""

    @abstractmethod
    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        """Exit rule of the position that produces completion token ``token_index``."""


class ThresholdExit(ExitPolicy):
    """The checkpoint's exit gate with per-request bounds and threshold."""

    name = "threshold"

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        assert params.max_loops is not None and params.exit_threshold is not None, "not effective params"
        return ExitParams(params.min_loops, params.max_loops, params.exit_threshold)


class FixedExit(ExitPolicy):
    """Full-depth baseline: every token runs ``max_loops`` loops, the gate is ignored."""

    name = "fixed"

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        assert params.max_loops is not None, "not effective params"
        return ExitParams(params.max_loops, params.max_loops, 1.0)


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


def make_exit_policy(mode: str) -> ExitPolicy:
    policies = {cls.name: cls for cls in (ThresholdExit, FixedExit, TraceExit)}
    return policies[mode]()
