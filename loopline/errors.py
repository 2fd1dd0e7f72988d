"""Typed exceptions for user errors (messages name the field, value and allowed range)."""
from __future__ import annotations


class LooplineError(Exception):
    """Base class of loopline's user-facing errors."""


class InvalidRequestError(LooplineError, ValueError):
    """A request (prompt or sampling field) is invalid; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CapacityError(InvalidRequestError):
    """A request can never fit the configured KV cache or context length."""


class EngineStateError(LooplineError, RuntimeError):
    """The engine cannot do this now (e.g. a half-applied weight update)."""


class WeightUpdateError(InvalidRequestError):
    """A weight update was rejected (bad version, unknown / missing / duplicate names, wrong
    shape or dtype, non-finite values); ``param`` names the tensor or field."""


class EngineDeadError(LooplineError, RuntimeError):
    """The engine stopped after a device fault and serves nothing until restarted."""
