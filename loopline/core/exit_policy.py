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


class LookaheadExit(ExitPolicy):
    """A head beside the weights fixes each token's exit two loops ahead (docs/lookahead.md): after loop
    ``n`` the device evaluates it and a prediction at or above ``lookahead_threshold`` fixes the exit at
    ``n + 2``; the gate's threshold is not used (tokens without a fixed exit run ``max_loops``)."""

    name = "lookahead"

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        assert params.max_loops is not None and params.lookahead_threshold is not None, "not effective params"
        return ExitParams(params.min_loops, params.max_loops, 1.0, lookahead=params.lookahead_threshold)


class RequestExit(ExitPolicy):
    """The engine's policy: each request's ``SamplingParams.exit_mode``, else the engine's ``exit_mode``.

    ``head_threshold``: the calibrated threshold of the lookahead head the engine loaded (None: it has
    none, and ``exit_mode="lookahead"`` is refused). Under the engine's ``"trace"`` mode every row's
    depth comes from its recorded depths, so a request may not pick another mode."""

    def __init__(self, default: str, head_threshold: float | None = None) -> None:
        self._policies: dict[str, ExitPolicy] = {cls.name: cls() for cls in (ThresholdExit, FixedExit, TraceExit,
                                                                              LookaheadExit)}
        self.default = self._policies[default]
        self.name, self.per_token = default, self.default.per_token
        self.head_threshold = head_threshold
        if default == "lookahead" and head_threshold is None:
            raise _no_head()

    def policy_for(self, params: SamplingParams) -> ExitPolicy:
        return self._policies[params.exit_mode] if params.exit_mode is not None else self.default

    def validate(self, params: SamplingParams) -> None:
        mode = params.exit_mode
        if mode is not None and self.per_token and mode != self.name:
            raise InvalidRequestError(f"exit_mode={mode!r} per request is not available while the engine's "
                                      f"exit_mode is {self.name!r}", param="exit_mode")
        if self.policy_for(params).name == "lookahead" and self.head_threshold is None:
            raise _no_head()
        self.policy_for(params).validate(params)

    def lookahead_threshold(self, params: SamplingParams) -> float | None:
        """The request's effective head threshold (its own, else the head's calibrated one); None when its
        policy is not the lookahead one (so the effective field says whether the request uses the head)."""
        if self.policy_for(params).name != "lookahead":
            return None
        return params.lookahead_threshold if params.lookahead_threshold is not None else self.head_threshold

    def params_for(self, params: SamplingParams, token_index: int) -> ExitParams:
        return self.policy_for(params).params_for(params, token_index)


def _no_head() -> InvalidRequestError:
    return InvalidRequestError("exit_mode='lookahead' needs a lookahead head beside the model's weights "
                               "(lookahead.json and lookahead.safetensors: loopline train lookahead); this model "
                               "has none", param="exit_mode")


def make_exit_policy(mode: str, head_threshold: float | None = None) -> RequestExit:
    """The engine's exit policy (:class:`RequestExit`) with ``mode`` as its default."""
    return RequestExit(mode, head_threshold)
