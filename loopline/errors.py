"""Typed exceptions for user errors (messages name the field, value and allowed range)."""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import fields
from typing import Any


class LooplineError(Exception):
    """Base class of loopline's user-facing errors."""

    def __reduce__(self):  # NOTE: subclasses take more than the message: rebuild without calling __init__
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> BaseException:
    """Unpickles a :class:`LooplineError` (it crosses the engine process boundary) with its fields."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


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


class EngineDeadError(EngineStateError):
    """The engine stopped (a device fault, or the server's engine loop or engine process ended) and serves nothing
    until restarted."""


def new_error_id() -> str:
    """A fresh id that ties an error a client sees to its traceback in the server log."""
    return uuid.uuid4().hex[:12]


class EngineInternalError(LooplineError, RuntimeError):
    """An internal failure (not the request's input) ended a request; the engine keeps serving.

    The message carries no internal exception text: ``error_id`` finds the traceback in the
    server log (``loopline.async`` logs it with this id).
    """

    def __init__(self, message: str, error_id: str) -> None:
        super().__init__(message)
        self.error_id = error_id

    @classmethod
    def request_failed(cls, error_id: str) -> "EngineInternalError":
        """What a caller gets for a request an internal error ended (``RequestOutput.error_id``)."""
        return cls(f"internal error while generating (error id {error_id}); the request was aborted", error_id)


class RequestFailedError(LooplineError, RuntimeError):
    """What ``LLMEngine.step()`` raises when it can attribute a failure to some requests.

    ``request_ids`` (the ids given to ``add_request``) failed; every other request is
    untouched and keeps running. The front end (``AsyncLLM``) aborts the named requests, which
    frees their KV and slots, and fails only their callers. Any other exception from ``step()``
    cannot be attributed, so every request in flight fails instead.
    """

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)


def check_object(value: Any, cls: type, name: str) -> None:
    """``value`` must be a JSON object whose keys are fields of the dataclass ``cls``: else an
    :class:`InvalidRequestError` naming ``name`` (and the first unknown field) and the allowed fields."""
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{name} must be a JSON object, got {type(value).__name__}", param=name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"{name} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: "
                                  f"{', '.join(sorted(known))}", param=f"{name}.{unknown[0]}")
