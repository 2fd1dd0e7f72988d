"""Server-sent events: ``data: {json}`` frames and a response that always releases its request."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from loopline.entrypoints.openai.errors import to_api_error
from starlette.types import Receive, Scope, Send


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_model(model: BaseModel) -> str:
    """A response model as one frame, serialized by pydantic-core directly (no intermediate dict):
    at 128 streams a server formats thousands of chunks a second on the event loop (12.5 vs 21 us a
    chunk, measured on the CPU); the engine loop runs in its own process and no longer waits for it."""
    return f"data: {model.model_dump_json()}\n\n"


def error_event(error: BaseException, where: str) -> str:
    """The in-band error of a stream whose headers were sent (OpenAI's ``{"error": {...}}``), with
    the same message and status mapping as a JSON reply (no internal exception text)."""
    return sse_event(to_api_error(error, where).body())


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that calls ``on_close`` however it ends.

    NOTE: a client that disconnects cancels the body iterator (or makes ``send``
    fail) and the iterator may never be resumed or closed; ``on_close``
    (synchronous, idempotent) aborts the engine requests so their KV is freed.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
