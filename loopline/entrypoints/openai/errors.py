"""Exceptions -> OpenAI-style error responses: one mapping for JSON replies and in-band stream errors.

User errors keep their message (it names the field and the allowed range);
an internal error never shows its exception text: it is logged with a fresh
error id and the client gets only that id.
"""
from __future__ import annotations

import logging

from loopline.entrypoints.openai.protocol import APIError
from loopline.errors import CapacityError, EngineInternalError, EngineStateError, InvalidRequestError, new_error_id

logger = logging.getLogger("loopline.api")


def internal_error(error: BaseException | None, where: str) -> APIError:
    """A 500 that names only an error id; the traceback goes to the log under that id."""
    error_id = new_error_id()
    logger.error("internal error on %s (error id %s)", where, error_id, exc_info=error)
    return APIError(500, f"internal server error (error id {error_id}); the server log has the details",
                    type="server_error", code="internal_error")


def to_api_error(error: BaseException, where: str) -> APIError:
    """The response for ``error`` raised while serving ``where`` (a route path)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, CapacityError):
        return APIError(400, str(error), param=error.param, code="context_length_exceeded")
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), param=error.param, code="invalid_value")
    if isinstance(error, EngineInternalError):  # already logged with its id by the engine loop
        return APIError(500, str(error), type="server_error", code="internal_error")
    if isinstance(error, EngineStateError):
        return APIError(503, str(error), type="service_unavailable", code="service_unavailable")
    return internal_error(error, where)
