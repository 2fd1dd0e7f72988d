"""The HTTP guard: Host allow-list, cross-origin refusal, JSON-only POST bodies, a body size limit,
and the last-resort 500 that keeps the connection usable.

It runs before any route (a pure ASGI middleware), so a refused request
never reaches the engine, and every refusal is an OpenAI-style error body:

* a request whose body length is ambiguous (``Content-Length`` and ``Transfer-Encoding`` together,
  conflicting lengths, a coding other than exactly ``chunked``, ``Transfer-Encoding`` on HTTP/1.0)
  -> 400 ``ambiguous_framing`` with ``Connection: close``: a front proxy may have framed it otherwise,
  and the bytes after it (a smuggled request) are dropped with the connection, never run.
* ``Host`` not in ``allowed_hosts`` -> 400 ``invalid_host``: a DNS-rebinding
  page (``http://evil.example:8000`` resolved to 127.0.0.1) sends its own name.
* a cross-origin browser request -> 403 ``cross_origin_forbidden``, unless
  ``allowed_origins`` has its ``Origin``: every ``POST``, and every method on
  the control routes. Browsers send ``Origin`` on cross-origin POSTs (also
  on "simple" form posts that skip the CORS preflight) and
  ``Sec-Fetch-Site`` on all requests, so a web page in the operator's browser
  cannot drive the server; non-browser clients send neither.
* a ``POST`` body that is not ``application/json`` -> 415: HTML forms can only
  send ``text/plain``, ``application/x-www-form-urlencoded`` and
  ``multipart/form-data`` without a preflight.
* a body above ``max_request_body_bytes`` -> 413, from ``Content-Length``
  at once or while a chunked body streams in.
* an exception that escaped the app -> 500 with an error id (the traceback is
  logged). NOTE: answered here, not re-raised: Starlette's outermost error
  middleware re-raises after answering, and the server then drops the
  keep-alive connection, failing the client's next request.

Keep-alive after any answer (an error, or a route that never read the body):
an HTTP/1.1 connection can carry the next request only once this request's
body has been read to its end, so before the response starts the guard reads
and discards what the app left unread, up to ``2 * max_request_body_bytes``
in all. A body announced (``Content-Length``) or found to be larger than
that is not read: the answer carries ``Connection: close`` and the server
closes the connection after it (reading it would cost more than a new
connection). So is the body of an ``Expect: 100-continue`` request the app
did not ask for: that client is still waiting to send it.
"""
from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loopline.entrypoints.openai.errors import internal_error
from loopline.entrypoints.openai.protocol import APIError
from loopline.errors import InvalidRequestError

logger = logging.getLogger("loopline.api")

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# NOTE: the HTTP/1.1 parser, chosen, not "auto" (httptools when installed): h11 refuses conflicting
# Content-Length values, codings other than "chunked", malformed chunk lines and header names with
# spaces before the guard runs; the framing tests pin that behaviour (docs/security.md).
HTTP_PROTOCOL = "h11"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_SAFE_FETCH_SITES = ("same-origin", "none")  # Sec-Fetch-Site of requests no other site caused


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SecurityConfig:
    """What the guard allows. ``allowed_hosts`` None: any ``Host``; ``"*"`` in a list: any entry."""

    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    control_paths: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        size = self.max_request_body_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidRequestError(f"max_request_body_bytes must be an integer >= 1, got {size!r}",
                                      param="max_request_body_bytes")

    @classmethod
    def for_bind(cls, host: str, extra_hosts: Iterable[str] = (), **kwargs: Any) -> "SecurityConfig":
        """The allow-list for a server bound to ``host``: the loopback names when it is loopback,
        plus ``extra_hosts``; any Host on another bind unless ``extra_hosts`` names them."""
        extra = tuple(extra_hosts)
        if is_loopback(host):
            allowed: tuple[str, ...] | None = LOOPBACK_HOSTS + extra
        else:
            allowed = (host, *LOOPBACK_HOSTS, *extra) if extra else None
        return cls(allowed_hosts=allowed, **kwargs)

    def host_allowed(self, host_header: str | None) -> bool:
        if self.allowed_hosts is None or "*" in self.allowed_hosts:
            return True
        if not host_header:
            return False
        name = _host_name(host_header)
        return any(name == h.lower().strip("[]") for h in self.allowed_hosts)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins


def _host_name(host_header: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``localhost:8000`` -> ``localhost``."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class _BodyTooLarge(Exception):
    pass


class _RequestBody:
    """One request's body as the app reads it (``receive``); ``drain`` reads and discards the rest."""

    def __init__(self, receive: Receive, headers: Headers, limit: int) -> None:
        self._receive = receive
        self.drain_cap = 2 * limit
        length = headers.get("content-length")
        self.announced = int(length) if length is not None and length.strip().isdigit() else None
        self.received = 0
        self.done = not _has_body(headers)  # every byte of it was received (or the client left)
        # NOTE: the server sends "100 Continue" at the first receive; before it such a client has
        # sent no body and waits: reading now would only make it upload what is refused.
        self.expect_continue = headers.get("expect", "").strip().lower() == "100-continue"
        self.asked = False  # receive was called

    async def receive(self) -> Message:
        self.asked = True
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.done = not message.get("more_body", False)
        else:  # http.disconnect
            self.done = True
        return message

    async def drain(self) -> bool:
        """Reads what is left of the body, up to ``drain_cap`` bytes in all; returns whether the
        connection may carry another request (False: answer with ``Connection: close``)."""
        if not self.done and ((self.announced or 0) > self.drain_cap or (self.expect_continue and not self.asked)):
            return False
        while not self.done:
            if self.received > self.drain_cap:
                return False
            await self.receive()
        return True


class SecurityGuard:
    """ASGI middleware enforcing a :class:`SecurityConfig` (see the module docstring)."""

    def __init__(self, app: ASGIApp, config: SecurityConfig, on_refusal: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.config = config
        self.on_refusal = on_refusal  # called with the status of each refusal (metrics)

    def _refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        cfg = self.config
        if not cfg.host_allowed(headers.get("host")):
            return APIError(400, "the Host header is not one this server answers to (see --allowed-hosts)",
                            code="invalid_host")
        method, path = scope.get("method", ""), scope.get("path", "")
        control = path in cfg.control_paths
        origin = headers.get("origin")
        cross = (origin is not None and not _same_origin(origin, scope, headers)) or \
            headers.get("sec-fetch-site", "none") not in _SAFE_FETCH_SITES
        if cross and (method == "POST" or control) and not (origin is not None and cfg.origin_allowed(origin)):
            return APIError(403, "cross-origin requests to this route are refused (see --allowed-origins)",
                            type="permission_error", code="cross_origin_forbidden")
        if method == "POST" and _has_body(headers) and not _is_json(headers.get("content-type")):
            return APIError(415, "POST bodies must be JSON: send 'Content-Type: application/json'",
                            param="Content-Type", code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_request_body_bytes:
            return _too_large(cfg.max_request_body_bytes)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        framing = framing_refusal(scope, headers)
        if framing is not None:  # NOTE: no drain: where this body ends is the very thing in doubt
            if self.on_refusal is not None:
                self.on_refusal(framing.status)
            await _send_error(send, framing, keep_alive=False)
            return
        limit = self.config.max_request_body_bytes
        body = _RequestBody(receive, headers, limit)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            if self.on_refusal is not None:
                self.on_refusal(refusal.status)
            await _send_error(send, refusal, keep_alive=await body.drain())
            return
        state = {"too_large": False, "started": False}

        async def limited_receive() -> Message:
            message = await body.receive()
            if message["type"] == "http.request" and body.received > limit:
                state["too_large"] = True
                raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            if state["too_large"]:
                return  # the app's answer to a body it could not read; the 413 below replaces it
            if message["type"] == "http.response.start":
                state["started"] = True
                if not await body.drain():  # e.g. a 404 for a POST whose body no route read
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception as e:
            if state["too_large"] and not state["started"]:
                await _send_error(send, _too_large(limit), keep_alive=await body.drain())
            elif not state["started"]:
                error = internal_error(e, scope.get("path", ""))
                await _send_error(send, error, keep_alive=await body.drain())
            else:  # the response had started: nothing valid can follow; the server closes the connection
                logger.exception("error after the response to %s started", scope.get("path", ""))
            return
        if state["too_large"] and not state["started"]:
            await _send_error(send, _too_large(limit), keep_alive=await body.drain())


def framing_refusal(scope: Scope, headers: Headers) -> APIError | None:
    """A 400 for a request whose body length two HTTP parsers could read differently (RFC 9112
    section 6.1 and 6.3), else None. Answered with ``Connection: close``: the bytes after such a
    request may be a second request smuggled past a front proxy, and must never run."""
    te = headers.getlist("transfer-encoding")
    lengths = {v.strip() for cl in headers.getlist("content-length") for v in cl.split(",")}
    if te and lengths:
        return _ambiguous("a request may not carry both Content-Length and Transfer-Encoding", "Transfer-Encoding")
    if te and (len(te) > 1 or te[0].strip().lower() != "chunked"):
        return _ambiguous(f"Transfer-Encoding must be exactly 'chunked', got {', '.join(te)!r}", "Transfer-Encoding")
    if te and scope.get("http_version") == "1.0":
        return _ambiguous("an HTTP/1.0 request may not carry Transfer-Encoding", "Transfer-Encoding")
    if len(lengths) > 1 or any(not v.isdigit() for v in lengths):
        return _ambiguous("Content-Length must be one decimal number", "Content-Length")
    return None


def _ambiguous(message: str, param: str) -> APIError:
    return APIError(400, f"{message} (RFC 9112 section 6): the request's framing is ambiguous, "
                         "so the connection is closed", param=param, code="ambiguous_framing")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                         "(--max-request-body-bytes)", code="request_too_large")


def _has_body(headers: Headers) -> bool:
    length = headers.get("content-length")
    return (length is not None and length.strip() not in ("", "0")) or "transfer-encoding" in headers


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _same_origin(origin: str, scope: Scope, headers: Headers) -> bool:
    """``Origin`` names this server (scheme and Host as the request reached it)."""
    scheme = scope.get("scheme", "http")
    return origin.lower() == f"{scheme}://{headers.get('host', '')}".lower()


async def _send_error(send: Send, err: APIError, keep_alive: bool = True) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    if not keep_alive:  # the rest of the request body was not read: the connection cannot carry another
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
