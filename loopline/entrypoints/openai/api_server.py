"""The OpenAI-compatible HTTP server: FastAPI routes over one shared :class:`AsyncLLM`.

``build_app(async_llm, ...)`` makes the app (tests run it under a real uvicorn
in a thread); ``run_server(args)`` is ``loopline serve`` (also ``python -m
loopline.entrypoints.openai.api_server FLAGS``, vLLM's entry point). Every error is an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; a bad
request gets a 4xx and never affects other requests. The RL control routes
are mounted only with ``enable_rl_api``; ``security.SecurityGuard`` checks
Host, Origin, Content-Type and body size before any route runs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import loopline
from loopline.config import EngineArgs
from loopline.entrypoints.async_llm import AsyncLLM
from loopline.entrypoints.openai.body import parse_body, validation_error
from loopline.entrypoints.openai.errors import internal_error, to_api_error
from loopline.entrypoints.openai.generation import ClientDisconnected, ServingContext
from loopline.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from loopline.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, ModelCard, ModelList, TokenizeRequest)
from loopline.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from loopline.entrypoints.openai.serving_completion import create_completion
from loopline.entrypoints.openai.serving_generate import GenerateRequest, create_generate
from loopline.entrypoints.openai.security import HTTP_PROTOCOL, SecurityConfig, SecurityGuard, is_loopback
from loopline.entrypoints.openai.serving_rl import add_rl_routes, add_sleep_routes
from loopline.entrypoints.openai.startup import startup_line
from loopline.entrypoints.tokenizer_pool import TokenizerPool
from loopline.errors import InvalidRequestError, LooplineError
from loopline.vllm_flags import log_engine_option_notes

logger = logging.getLogger("loopline.api")

DEFAULT_MAX_CONCURRENT_REQUESTS = 256
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS, shutdown_engine: bool = True, *,
              enable_rl_api: bool = False, security: SecurityConfig | None = None,
              allowed_methods: list[str] | None = None, allowed_headers: list[str] | None = None,
              allow_credentials: bool = False,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              return_tokens_as_token_ids: bool = False, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              response_role: str = "assistant", enable_sleep_mode: bool = False, log_requests: bool = True,
              max_log_len: int | None = None) -> FastAPI:
    """The FastAPI app serving ``async_llm``.

    ``served_model_name``: the name(s) clients must use in ``model`` (default:
    the model path); ``api_key``: when set, every route but ``/health``,
    ``/version`` and ``/metrics`` needs ``Authorization: Bearer <key>``;
    ``max_concurrent_requests``: generation requests in flight before new ones
    get 429; ``shutdown_engine``: stop the engine (its process or thread) when the app shuts down.

    ``enable_rl_api``: mount ``/generate`` and the RL control routes of
    ``serving_rl`` (off by default: they let a client pause the engine and
    load weights). ``security``: the guard's Host allow-list, CORS origins and
    body size limit (default: any Host, no cross-origin requests, 32 MiB);
    ``allowed_methods`` / ``allowed_headers`` / ``allow_credentials``: the CORS
    answer for ``security.allowed_origins`` (vLLM's flags). ``max_prompts_per_request``:
    the most prompts one completions or ``/generate`` request may carry.
    ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>`` instead of by
    their text (vLLM's flag). ``trust_request_chat_template``: accept a request's own ``chat_template``
    (vLLM's ``--trust-request-chat-template``; off: a 400, since templates run code-like loops).
    ``enable_auto_tool_choice`` / ``tool_call_parser``: ``tool_choice: "auto"`` (and tools without a
    tool_choice) parse tool calls out of the text with that parser (vLLM's flags; ``tool_parsers.TOOL_PARSERS``).
    ``response_role``: a chat response's role after a generation prompt (vLLM's ``--response-role``).
    ``enable_sleep_mode``: mount ``/sleep``, ``/wake_up`` and ``/is_sleeping`` without the other RL routes.
    ``log_requests`` / ``max_log_len``: one log line per request, its details cut to ``max_log_len`` characters.
    """
    for name, value in (("max_concurrent_requests", max_concurrent_requests),
                        ("max_prompts_per_request", max_prompts_per_request)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}", param=name)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [async_llm.config.model_path or "ouro"]  # no path: an in-memory model
    metrics = ServerMetrics(async_llm, names[0])
    ctx = ServingContext(async_llm, names, metrics, max_concurrent_requests, max_prompts_per_request,
                         return_tokens_as_token_ids)
    ctx.trust_request_chat_template = trust_request_chat_template
    if enable_auto_tool_choice and not tool_call_parser:
        raise InvalidRequestError("enable_auto_tool_choice needs tool_call_parser", param="tool_call_parser")
    if tool_call_parser is not None:
        from loopline.entrypoints.openai.tool_parsers import TOOL_PARSERS
        if tool_call_parser not in TOOL_PARSERS:
            raise InvalidRequestError(f"unknown tool_call_parser {tool_call_parser!r} (known: {sorted(TOOL_PARSERS)})",
                                      param="tool_call_parser")
    ctx.enable_auto_tool_choice, ctx.tool_call_parser = enable_auto_tool_choice, tool_call_parser
    if not isinstance(response_role, str) or not response_role.strip():
        raise InvalidRequestError(f"response_role must be a non-empty role name, got {response_role!r}",
                                  param="response_role")
    ctx.response_role = response_role

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.ready = True
        logger.info("serving %s (max_model_len %d)", names[0], async_llm.max_model_len)
        try:
            yield
        finally:
            ctx.ready, ctx.shutting_down = False, True
            if ctx.in_flight:
                logger.info("shutting down: aborting %d request(s) still in flight", ctx.in_flight)
            if shutdown_engine:
                await asyncio.to_thread(async_llm.shutdown)

    # NOTE: no /docs, /redoc or /openapi.json: what the server exposes is exactly the routes below.
    app = FastAPI(title="loopline", version=loopline.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    _add_error_handlers(app, metrics)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        """200 when the server can generate; else 503 with a body saying why (a clear state, never silent).
        With data-parallel replicas of which some stopped (the others serve): 200 with a body that names them."""
        problem = ("the server is shutting down" if ctx.shutting_down else
                   "the server is starting" if not ctx.ready else async_llm.health_problem())
        if problem is None:
            down = {r.name: r.problem for r in async_llm.replicas() if r.problem is not None}
            if down:
                return JSONResponse({"status": "degraded", "unhealthy_replicas": down}, status_code=200)
            return Response(status_code=200)
        err = APIError(503, problem, type="service_unavailable", code="service_unavailable")
        return JSONResponse(err.body(), status_code=503)

    # vLLM's (and SageMaker's) liveness route: the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> dict:
        return {"version": loopline.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        root = async_llm.config.model_path or names[0]
        cards = [ModelCard(id=n, root=root, max_model_len=async_llm.max_model_len) for n in names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        if model_id not in names:
            raise APIError(404, f"The model `{model_id:.200}` does not exist (this server serves {names[0]!r}).",
                           param="model", code="model_not_found")
        return ModelCard(id=model_id, root=async_llm.config.model_path or names[0],
                         max_model_len=async_llm.max_model_len).model_dump()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, await parse_body(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, await parse_body(raw, ChatCompletionRequest), raw)

    control_paths: set[str] = set()
    if enable_rl_api:
        @app.post("/generate", dependencies=auth)
        async def generate(raw: Request) -> Response:
            return await create_generate(ctx, await parse_body(raw, GenerateRequest), raw)

        control_paths |= {"/generate", *add_rl_routes(app, async_llm, auth)}
    elif enable_sleep_mode:
        control_paths |= set(add_sleep_routes(app, async_llm, auth))

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(raw: Request) -> dict:
        req = await parse_body(raw, TokenizeRequest)
        ctx.check_model(req.model)
        pool = _tokenizers(async_llm)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            conv = [m.as_dict() for m in req.messages]
            _, ids = await render_chat(ctx, req, conv, bool(req.add_special_tokens))
        else:
            for name in ("continue_final_message", "chat_template", "chat_template_kwargs", "add_generation_prompt"):
                if name in req.model_fields_set and getattr(req, name) not in (None, name == "add_generation_prompt"):
                    raise InvalidRequestError(f"{name} is a chat template input: it needs messages", param=name)
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await pool.encode(req.prompt, add_special_tokens=add_special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": async_llm.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = await pool.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(raw: Request) -> dict:
        req = await parse_body(raw, DetokenizeRequest)
        ctx.check_model(req.model)
        pool = _tokenizers(async_llm)
        vocab = async_llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"tokens must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": await pool.decode(req.tokens)}

    # Outermost last: the request log sees every answer, CORS headers go on the guard's refusals too.
    security = security or SecurityConfig()
    app.add_middleware(SecurityGuard, config=dataclasses.replace(security, control_paths=frozenset(control_paths)),
                       on_refusal=lambda status: metrics.requests["error"].inc())
    if security.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(security.allowed_origins),
                           allow_methods=allowed_methods or ["*"], allow_headers=allowed_headers or ["*"],
                           allow_credentials=allow_credentials)
    if log_requests:
        app.add_middleware(_RequestLog, max_len=max_log_len)
    return app


def _tokenizers(async_llm: AsyncLLM) -> TokenizerPool:
    if async_llm.tokenizers is None:
        raise InvalidRequestError("the server runs without a tokenizer (skip_tokenizer_init)", param="prompt")
    return async_llm.tokenizers


# --- errors -------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(err: APIError) -> JSONResponse:
        if 400 <= err.status < 500 and err.status != 429:
            metrics.requests["error"].inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(exc)

    @app.exception_handler(LooplineError)
    async def on_loopline_error(request: Request, exc: LooplineError) -> JSONResponse:
        return reply(to_api_error(exc, request.url.path))

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own 404 / 405 / body-parse 400, as OpenAI-style bodies."""
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            err = APIError(404, f"no route {method} {path}", code="not_found")
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            err = APIError(405, f"method {method} is not allowed on {path}" + (f" (allowed: {allow})" if allow else ""),
                           code="method_not_allowed", headers=exc.headers)
        elif exc.status_code == 400:
            err = APIError(400, "the request body could not be parsed as JSON", code="invalid_json")
        else:
            err = APIError(exc.status_code, str(exc.detail), code=None, headers=exc.headers)
        return reply(err)

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def on_internal(request: Request, exc: Exception) -> JSONResponse:
        err = internal_error(exc, request.url.path)  # logged with an id; the body names only the id
        return JSONResponse(err.body(), status_code=500)


# --- logging --------------------------------------------------------------------------------
class _RequestLog:
    """Logs one line per HTTP request when its response has been sent (streams included); ``max_len``
    (``--max-log-len``) cuts the line's details (request id, token counts, user) to that many characters."""

    QUIET = ("/health", "/metrics")

    def __init__(self, app: ASGIApp, max_len: int | None = None) -> None:
        self.app = app
        self.max_len = max_len

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})
        t0 = time.monotonic()
        status = [0]

        async def send_and_note(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            status[0] = status[0] or 500  # the outermost middleware answers 500
            raise
        finally:
            path = scope.get("path", "")
            if not path.isprintable():  # a decoded %0A in the path must not forge a log line
                path = repr(path)
            gen = scope["state"].get("generation")
            extra = f" {gen.id} {gen.summary()}" if gen is not None else ""
            if self.max_len is not None and len(extra) > self.max_len + 1:
                extra = extra[:self.max_len + 1] + "..."
            client = scope.get("client") or ("-", 0)
            logger.log(logging.DEBUG if path in self.QUIET else logging.INFO, "%s:%s %s %s %s %.3fs%s", client[0], client[1],
                       scope.get("method", ""), path, status[0] or "-", time.monotonic() - t0, extra)


# --- running --------------------------------------------------------------------------------
def run_server(ns: argparse.Namespace) -> int:
    """``loopline serve``: load the engine, then serve until SIGINT/SIGTERM."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("loopline").setLevel(logging.INFO)
    api_key = ns.api_key or os.environ.get("LOOPLINE_API_KEY")
    check_exposure(ns.host, ns.enable_rl_api, api_key, sleep_routes=ns.enable_sleep_mode)  # before the engine load
    check_listen_flags(ns)
    for flag in ("max_request_body_bytes", "max_prompts_per_request", "max_concurrent_requests"):
        if getattr(ns, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.shutdown_timeout < 0:
        raise SystemExit(f"error: --shutdown-timeout must be >= 0, got {ns.shutdown_timeout}")
    # NOTE: on a unix socket any Host is answered (unless --allowed-hosts): no browser reaches a socket file, so
    # DNS rebinding, which the loopback allow-list stops, cannot happen; file permissions decide who connects.
    security = SecurityConfig.for_bind(ns.host if ns.uds is None else "unix-socket", ns.allowed_hosts, allowed_origins=tuple(ns.allowed_origins),
                                       max_request_body_bytes=ns.max_request_body_bytes)
    args = EngineArgs.from_cli_args(ns)
    args.validate()  # a bad vLLM option is named before the engine loads
    log_engine_option_notes(args, logger)
    async_llm = AsyncLLM(args)
    logger.info(startup_line(async_llm.info, rl_api=ns.enable_rl_api))
    if args.data_parallel_size > 1:
        logger.info("data parallel: %d engine replicas (%s backend), each with the KV pool above; requests routed by "
                    "load with prefix affinity", len(async_llm.replicas()), args.distributed_executor_backend)
    name = ns.served_model_name or ([args.model] if args.model else [_default_name()])
    app = build_app(async_llm, name, api_key, ns.max_concurrent_requests, enable_rl_api=ns.enable_rl_api,
                    security=security, allowed_methods=ns.allowed_methods, allowed_headers=ns.allowed_headers,
                    allow_credentials=ns.allow_credentials, max_prompts_per_request=ns.max_prompts_per_request,
                    return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
                    trust_request_chat_template=getattr(ns, "trust_request_chat_template", False),
                    enable_auto_tool_choice=getattr(ns, "enable_auto_tool_choice", False),
                    tool_call_parser=getattr(ns, "tool_call_parser", None), response_role=ns.response_role,
                    enable_sleep_mode=args.enable_sleep_mode, log_requests=not ns.disable_log_requests,
                    max_log_len=ns.max_log_len)
    server = _Server(uvicorn_config(app, ns), app.state.ctx, ns.shutdown_timeout)
    logger.info("listening on %s (model %r%s)", listen_url(ns), name[0],
                ", RL API enabled" if ns.enable_rl_api else ", sleep routes enabled" if args.enable_sleep_mode else "")
    # NOTE: uvicorn re-raises the signal that stopped it once it has shut down; these
    # no-op handlers absorb it, so a graceful SIGINT/SIGTERM exits with status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        async_llm.shutdown()
    logger.info("server stopped")
    return 0


def check_exposure(host: str, enable_rl_api: bool, api_key: str | None, sleep_routes: bool = False) -> None:
    """Refuses to expose the RL control routes (or the sleep routes) beyond this machine without an API key."""
    if enable_rl_api and not api_key and not is_loopback(host):
        raise SystemExit(f"error: --enable-rl-api with --host {host} (not a loopback address) needs --api-key "
                         "(or LOOPLINE_API_KEY): anyone who can reach the port could pause the engine and load weights")
    if sleep_routes and not api_key and not is_loopback(host):
        raise SystemExit(f"error: --enable-sleep-mode with --host {host} (not a loopback address) needs --api-key "
                         "(or LOOPLINE_API_KEY): anyone who can reach the port could put the engine to sleep")


def check_listen_flags(ns: argparse.Namespace) -> None:
    """The TLS, unix socket and request-log flags, checked before the engine loads (each error names its flag)."""
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise SystemExit("error: --ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    if ns.ssl_ca_certs is not None and ns.ssl_keyfile is None:
        raise SystemExit("error: --ssl-ca-certs needs --ssl-keyfile and --ssl-certfile (it verifies HTTPS clients)")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(ns, flag)
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"error: --{flag.replace('_', '-')} {path}: no such file")
    if ns.uds is not None and not os.path.isdir(os.path.dirname(os.path.abspath(ns.uds))):
        raise SystemExit(f"error: --uds {ns.uds}: its directory does not exist")
    if ns.disable_log_requests and ns.enable_log_requests:
        raise SystemExit("error: --disable-log-requests and --enable-log-requests contradict each other: give one")
    if ns.max_log_len is not None and ns.max_log_len < 0:
        raise SystemExit(f"error: --max-log-len must be >= 0, got {ns.max_log_len}")
    if not ns.response_role.strip():
        raise SystemExit("error: --response-role must be a non-empty role name")


def uvicorn_config(app: FastAPI, ns: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings from ``loopline serve``'s flags: where to listen (host/port or --uds), TLS, root path."""
    # NOTE: uvicorn cuts connections still open after its own timeout; ours aborts the requests first
    # (so every stream ends with a final chunk and [DONE]) and uvicorn's is only the last resort.
    # uvicorn's access log stays off (--disable-uvicorn-access-log is accepted): _RequestLog logs each request.
    return uvicorn.Config(app, host=ns.host, port=ns.port, uds=ns.uds, root_path=ns.root_path or "",
                          log_level=ns.uvicorn_log_level, access_log=False, http=HTTP_PROTOCOL,
                          timeout_graceful_shutdown=ns.shutdown_timeout + _ABORT_GRACE_S, **_tls(ns))


def _tls(ns: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings; with --ssl-ca-certs clients must present a certificate those CAs signed."""
    if ns.ssl_keyfile is None:
        return {}
    import ssl

    tls: dict[str, Any] = {"ssl_keyfile": ns.ssl_keyfile, "ssl_certfile": ns.ssl_certfile}
    if ns.ssl_ca_certs is not None:
        tls |= {"ssl_ca_certs": ns.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return tls


def listen_url(ns: argparse.Namespace) -> str:
    """Where the server answers: ``unix:PATH`` with --uds, else ``http(s)://host:port`` (with --root-path)."""
    if ns.uds is not None:
        return f"unix:{ns.uds}"
    scheme = "https" if ns.ssl_keyfile is not None else "http"
    return f"{scheme}://{ns.host}:{ns.port}{ns.root_path or ''}"


def _default_name() -> str:
    from loopline.models.tiny import DEFAULT_CHECKPOINT_NAME
    return DEFAULT_CHECKPOINT_NAME


_ABORT_GRACE_S = 5.0  # after aborting at --shutdown-timeout: time for the final chunks to reach clients


class _Server(uvicorn.Server):
    """uvicorn's server with a graceful drain on SIGINT/SIGTERM.

    From the first signal ``/health`` answers 503 and new requests get 503;
    uvicorn stops accepting connections and waits for the ones in flight.
    After ``shutdown_timeout`` seconds every request still running is aborted
    (its KV freed): streams end with a final chunk (``finish_reason: "abort"``)
    and ``data: [DONE]``, whole responses carry what was generated. The app's
    shutdown then stops the engine process.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.ctx.shutting_down and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain)
        self.ctx.shutting_down = True
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._abort_after_timeout())

    async def _abort_after_timeout(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        if self.ctx.in_flight:
            logger.info("shutdown timeout (%.1fs): aborting %d request(s) still in flight", self.shutdown_timeout,
                        self.ctx.in_flight)
        try:
            await self.ctx.llm.abort_all()
        except Exception:  # the engine already stopped: nothing left to abort
            logger.debug("abort at shutdown failed", exc_info=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m loopline.entrypoints.openai.api_server FLAGS`` (vLLM's module entry point): the same as
    ``loopline serve FLAGS``, with the same flags, checks and messages."""
    import importlib
    import sys

    # NOTE: by name, not an import statement: the CLI imports this module (serve_cli -> run_server); the
    # script entry sits above both, so this module must not depend on the CLI (tests/test_layering.py).
    cli = importlib.import_module("loopline.entrypoints.cli")
    return cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
