"""Request bodies: bytes -> JSON -> a pydantic model, every failure an OpenAI-style 400 naming the field.

One place parses every JSON body the server accepts, so each failure class
has one answer: invalid UTF-8, malformed JSON (message with line and column,
never a byte offset in ``param``), ``NaN`` / ``Infinity`` (not JSON; ``param`` names the field that
held it), nesting
too deep, a non-object body, strings with lone surrogates (they cannot be
encoded back to UTF-8: the tokenizer and the JSON response would fail later)
and pydantic validation errors (``param`` is the field path, e.g.
``messages[0].role``).
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from loopline.entrypoints.openai.protocol import APIError

T = TypeVar("T", bound=BaseModel)

_OFF_LOOP_BYTES = 256 * 1024
_SURROGATE = re.compile("[\ud800-\udfff]")
# Parts of a pydantic error location that name a type tried in a union (``str``, ``list[int]``,
# a model class such as ``GenerateSamplingParams``), not a field: field names are snake_case.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|tuple|set|bytes|literal|is-instance|json-or-python|"
                       r"lax-or-strict|function-.*|.*\[.*|[A-Z].*)$")


class _NonFinite:
    """Where ``NaN`` / ``Infinity`` / ``-Infinity`` stood: found afterwards, so the 400 names its field."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _find_non_finite(value: Any) -> tuple[str, str] | None:
    """(field path, literal) of the first ``NaN`` / ``Infinity`` in decoded ``value`` (iterative: the
    body may be nested as deep as ``json.loads`` allows)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _NonFinite):
            return path or "body", v.name
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        children = [(f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k), c) for k, c in items]
        stack.extend(reversed(children))  # the first field is looked at first
    return None


def decode_json(body: bytes) -> Any:
    """The JSON value of ``body``; raises a 400 ``APIError`` (``code: invalid_json``) otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_NonFinite)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    found = _find_non_finite(value) if "N" in text or "I" in text else None  # both literals hold one
    if found is not None:
        param, literal = found
        raise APIError(400, f"{param}: {literal} is not valid JSON (numbers must be finite)", param=param,
                       code="invalid_json")
    return value


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` holding a lone surrogate."""
    if isinstance(value, str):
        return path or "body" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            key = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _SURROGATE.search(k):
                return path or "body"
            found = find_surrogate(v, key)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = find_surrogate(v, f"{path}[{i}]")
            if found:
                return found
    return None


def field_path(loc: tuple | list) -> str | None:
    """A pydantic location as a field path: ``('body', 'messages', 0, 'role')`` -> ``messages[0].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "body" and not out:
            continue
        elif isinstance(part, str) and not _TYPE_TAG.match(part):
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 of a list of pydantic errors: the most specific one named, the count of the others.

    NOTE: a union field reports one error per member (``content``: not a string, and not a list
    of text parts because ``content[0].type`` is wrong); the deepest location says what to fix.
    """
    depth = [sum(1 for p in e.get("loc", ()) if isinstance(p, int) or not _TYPE_TAG.match(str(p))) for e in errors]
    first = errors[depth.index(max(depth))] if errors else {}
    if first.get("type") == "json_invalid":  # FastAPI's own body parsing: its loc is a byte offset, not a field
        ctx = first.get("ctx") or {}
        return APIError(400, f"the request body is not valid JSON: {ctx.get('error', 'parse error')}",
                        code="invalid_json")
    param = field_path(first.get("loc", ()))
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param, code="invalid_type" if param else "invalid_json")


def parse_model(data: Any, model: type[T]) -> T:
    """``model`` from decoded JSON, with the checks of the module docstring."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    bad = find_surrogate(data)
    if bad is not None:
        raise APIError(400, f"{bad}: strings must not contain lone UTF-16 surrogates", param=bad, code="invalid_value")
    check = getattr(model, "check_fields", None)
    if check is not None:  # a route's field table: refused and unknown fields are a 400 naming them
        data = check(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def parse_body(raw: Request, model: type[T]) -> T:
    """The request's JSON body as ``model`` (an empty body is an empty object).

    A large body is decoded and validated on a worker thread: tens of megabytes of JSON take
    long enough to stall every other request on the event loop.
    """
    body = await raw.body()
    if not body.strip():
        return parse_model({}, model)
    if len(body) < _OFF_LOOP_BYTES:
        return parse_model(decode_json(body), model)
    return await asyncio.to_thread(lambda: parse_model(decode_json(body), model))
