"""The OpenAI-compatible HTTP server: FastAPI routes over one shared :class:`AsyncLLM`.

``build_app(async_llm, ...)`` makes the app (tests run it under a real uvicorn
in a thread); ``run_server(args)`` is ``loopline serve``. Every error is an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; a bad
request gets a 4xx and never affects other requests.
"""
from __future__ import annotations

import argparse
import asyncio
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
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import loopline
from loopline.config import EngineArgs
from loopline.entrypoints.async_llm import AsyncLLM
from loopline.entrypoints.openai.generation import ClientDisconnected, ServingContext
from loopline.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from loopline.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, ModelCard, ModelList, TokenizeRequest)
from loopline.entrypoints.openai.serving_chat import create_chat_completion
from loopline.entrypoints.openai.serving_completion import create_completion
from loopline.entrypoints.openai.serving_generate import GenerateRequest, create_generate
from loopline.entrypoints.openai.serving_rl import add_rl_routes
from loopline.entrypoints.openai.startup import startup_line
from loopline.errors import CapacityError, EngineStateError, InvalidRequestError

logger = logging.getLogger("loopline.api")

DEFAULT_MAX_CONCURRENT_REQUESTS = 256


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS, shutdown_engine: bool = True,
              return_tokens_as_token_ids: bool = False) -> FastAPI:
    """The FastAPI app serving ``async_llm``.

    ``served_model_name``: the name(s) clients must use in ``model`` (default:
    the model path); ``api_key``: when set, every route but ``/health``,
    ``/version`` and ``/metrics`` needs ``Authorization: Bearer <key>`` (``/v1/*``,
    ``/tokenize``, ``/detokenize``, ``/generate`` and the RL control routes of
    ``serving_rl``); ``max_concurrent_requests``:
    generation requests in flight before new ones get 429; ``shutdown_engine``:
    stop the engine thread when the app shuts down; ``return_tokens_as_token_ids``: logprobs name
    tokens ``token_id:<id>`` instead of by their text (vLLM's flag).
    """
    if isinstance(max_concurrent_requests, bool) or not isinstance(max_concurrent_requests, int) or max_concurrent_requests < 1:
        raise InvalidRequestError(f"max_concurrent_requests must be an integer >= 1, got {max_concurrent_requests!r}",
                                  param="max_concurrent_requests")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [async_llm.engine.config.model_path or "ouro"]  # no path: an in-memory model
    metrics = ServerMetrics(async_llm, names[0])
    ctx = ServingContext(async_llm, names, metrics, max_concurrent_requests, return_tokens_as_token_ids)

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

    app = FastAPI(title="loopline", version=loopline.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(_RequestLog)
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
        if ctx.ready and not ctx.shutting_down and async_llm.is_running:
            return Response(status_code=200)
        why = "shutting down" if ctx.shutting_down else "not ready" if async_llm.is_running or not ctx.ready else "engine stopped"
        err = APIError(503, f"the server is {why}", type="service_unavailable", code="service_unavailable")
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
        root = async_llm.engine.config.model_path or names[0]
        cards = [ModelCard(id=n, root=root, max_model_len=async_llm.max_model_len) for n in names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.post("/generate", dependencies=auth)
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        return await create_generate(ctx, req, raw)

    add_rl_routes(app, async_llm, auth)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(req: TokenizeRequest) -> dict:
        ctx.check_model(req.model)
        tok = _tokenizer(async_llm)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            conv = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = async_llm.encode_chat(conv, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": async_llm.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(req: DetokenizeRequest) -> dict:
        ctx.check_model(req.model)
        tok = _tokenizer(async_llm)
        vocab = async_llm.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"tokens must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    return app


def _tokenizer(async_llm: AsyncLLM) -> Any:
    if async_llm.tokenizer is None:
        raise InvalidRequestError("the server runs without a tokenizer (skip_tokenizer_init)", param="prompt")
    return async_llm.tokenizer


# --- errors -------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(err: APIError) -> JSONResponse:
        if 400 <= err.status < 500 and err.status != 429:
            metrics.requests["error"].inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return reply(exc)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        code = "context_length_exceeded" if isinstance(exc, CapacityError) else "invalid_value"
        return reply(APIError(400, str(exc), param=exc.param, code=code))

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error(s))"
        return reply(APIError(400, message, param=param, code="invalid_type" if param else "invalid_json"))

    @app.exception_handler(EngineStateError)
    async def on_engine_state(request: Request, exc: EngineStateError) -> JSONResponse:
        return reply(APIError(503, str(exc), type="service_unavailable", code="service_unavailable"))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def on_internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)


# --- logging --------------------------------------------------------------------------------
class _RequestLog:
    """Logs one line per HTTP request when its response has been sent (streams included)."""

    QUIET = ("/health", "/metrics")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            gen = scope["state"].get("generation")
            extra = f" {gen.id} {gen.summary()}" if gen is not None else ""
            client = scope.get("client") or ("-", 0)
            logger.log(logging.DEBUG if path in self.QUIET else logging.INFO, "%s:%s %s %s %s %.3fs%s", client[0], client[1],
                       scope.get("method", ""), path, status[0] or "-", time.monotonic() - t0, extra)


# --- running --------------------------------------------------------------------------------
def run_server(ns: argparse.Namespace) -> int:
    """``loopline serve``: load the engine, then serve until SIGINT/SIGTERM."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("loopline").setLevel(logging.INFO)
    args = EngineArgs.from_cli_args(ns)
    async_llm = AsyncLLM(args)
    logger.info(startup_line(async_llm.engine, rl_api=getattr(ns, "enable_rl_api", True)))  # mounted unless the flag says no
    name = ns.served_model_name or ([args.model] if args.model else [_default_name()])
    api_key = ns.api_key or os.environ.get("LOOPLINE_API_KEY")
    app = build_app(async_llm, name, api_key, ns.max_concurrent_requests,
                    return_tokens_as_token_ids=ns.return_tokens_as_token_ids)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, access_log=False,
                            timeout_graceful_shutdown=ns.shutdown_timeout)
    server = _Server(config, app.state.ctx)
    logger.info("listening on http://%s:%d (model %r)", ns.host, ns.port, name[0])
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


def _default_name() -> str:
    from loopline.models.tiny import DEFAULT_CHECKPOINT_NAME
    return DEFAULT_CHECKPOINT_NAME


class _Server(uvicorn.Server):
    """uvicorn's server, with ``/health`` answering 503 from the moment a shutdown signal arrives.

    On SIGINT/SIGTERM uvicorn stops accepting connections and waits up to
    ``timeout_graceful_shutdown`` for in-flight requests; requests still running
    then are cancelled, which aborts their engine requests (KV freed); the app's
    shutdown then stops the engine thread.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServingContext) -> None:
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.ctx.shutting_down = True
        super().handle_exit(sig, frame)
