"""HTTP routes for RL trainers: pause / resume, abort, weight updates from disk, prefix cache, sleep.

Each route runs a control verb of ``engine/verbs.py`` by name, its body's fields
bound to the verb's parameters (``AsyncLLM.control_call``, on the engine loop), and
answers a small JSON object. Fields come from the JSON
body or, for vLLM-style clients, the query string (``POST /pause?mode=keep``).
Bad input gets 400, a call the engine cannot honour in its current state
(an update while requests generate, a resume while asleep, ...) gets 409;
both with an OpenAI-style error body, and the engine keeps serving.
Route names follow SGLang (``/pause_generation``, ``/continue_generation``,
``/flush_cache``, ``/abort_request``, ``/update_weights_from_disk``,
``/get_weight_version``) and vLLM (``/pause``, ``/resume``, ``/sleep``,
``/wake_up``, ``/reset_prefix_cache``, ``/is_paused``, ``/is_sleeping``).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI
from pydantic import BeforeValidator, StrictStr
from starlette.requests import Request

from loopline.entrypoints.async_llm import AsyncLLM
from loopline.errors import EngineDeadError
from loopline.entrypoints.openai.body import decode_json, parse_model
from loopline.entrypoints.openai.protocol import APIError, OpenAIBaseModel
from loopline.errors import EngineStateError, InvalidRequestError, WeightUpdateError, new_error_id
from loopline.models.loader import CheckpointError
from loopline.rl.weights import MAX_VERSION

logger = logging.getLogger("loopline.api")

T = TypeVar("T", bound=OpenAIBaseModel)


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be an integer, not a boolean")
    return v


Int = Annotated[int, BeforeValidator(_not_bool)]  # also from query strings ("2"), never from true / false


class PauseRequest(OpenAIBaseModel):
    mode: str = "abort"  # "abort" | "wait" | "keep"
    clear_cache: bool = False  # also reset the prefix cache once paused (vLLM's flag)


class AbortRequest(OpenAIBaseModel):
    rid: str | list[str] | None = None
    abort_all: bool = False


class UpdateFromDiskRequest(OpenAIBaseModel):
    model_path: str
    version: Int | StrictStr | None = None
    weight_version: Int | StrictStr | None = None  # SGLang's name for version


class SleepRequest(OpenAIBaseModel):
    level: Int = 1


class WakeUpRequest(OpenAIBaseModel):
    tags: list[str] | None = None


def add_rl_routes(app: FastAPI, llm: AsyncLLM, auth: list) -> list[str]:
    """Registers the RL control routes on ``app`` (``auth``: the API-key dependencies); returns their paths."""
    before = {getattr(r, "path", None) for r in app.routes}

    async def run(verb: str, **fields: Any) -> Any:
        """Runs ``verb`` with ``fields`` as its arguments; a state the engine refuses becomes 409."""
        return await _control(llm.control_call(verb, **fields))

    async def pause(raw: Request) -> dict:
        req = await _parse(raw, PauseRequest)
        await run("pause_generation", mode=req.mode)
        if req.clear_cache:
            await run("reset_prefix_cache")
        return {"success": True, "mode": req.mode}

    async def resume() -> dict:
        await run("resume_generation")
        return {"success": True}

    async def flush() -> dict:
        await run("reset_prefix_cache")
        return {"success": True}

    for path in ("/pause_generation", "/pause"):
        app.add_api_route(path, pause, methods=["POST"], dependencies=auth)
    for path in ("/resume_generation", "/resume", "/continue_generation"):
        app.add_api_route(path, resume, methods=["POST"], dependencies=auth)
    app.add_api_route("/reset_prefix_cache", flush, methods=["POST"], dependencies=auth)
    app.add_api_route("/flush_cache", flush, methods=["GET", "POST"], dependencies=auth)

    @app.get("/is_paused", dependencies=auth)
    async def is_paused() -> dict:
        return {"is_paused": await run("is_paused")}

    @app.post("/abort_request", dependencies=auth)
    async def abort_request(raw: Request) -> dict:
        req = await _parse(raw, AbortRequest)
        if req.abort_all == (req.rid is not None):
            raise InvalidRequestError("give either rid or abort_all: true", param="rid")
        if req.abort_all:
            return {"success": True, "aborted": await run("abort_all")}
        rids = [req.rid] if isinstance(req.rid, str) else req.rid
        if not rids or not all(rids):
            raise InvalidRequestError("rid must be a non-empty id or list of ids", param="rid")
        await llm.abort(rids)  # unknown or finished ids are ignored
        return {"success": True}

    @app.post("/update_weights_from_disk", dependencies=auth)
    async def update_weights_from_disk(raw: Request) -> dict:
        req = await _parse(raw, UpdateFromDiskRequest)
        version = _version(req)
        if not req.model_path:
            raise InvalidRequestError("model_path must be a checkpoint directory", param="model_path")
        update = llm.control_call("update_weights_from_disk", path=req.model_path, version=version)
        committed = await _load_from_disk(update, req.model_path)
        return {"success": True, "message": f"weights from {req.model_path} serve as version {committed}",
                "weight_version": committed}

    @app.get("/get_weight_version", dependencies=auth)
    async def get_weight_version() -> dict:
        version = await run("get_weight_version")
        return {"weight_version": version, "weights": llm.weights_state()}  # "weights": a clear state, never silent

    add_sleep_routes(app, llm, auth)
    return sorted({getattr(r, "path", None) for r in app.routes} - before - {None})


def add_sleep_routes(app: FastAPI, llm: AsyncLLM, auth: list) -> list[str]:
    """vLLM's sleep routes (``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``): part of the RL routes,
    and mounted alone by ``loopline serve --enable-sleep-mode``; returns their paths."""
    async def run(verb: str, **fields: Any) -> Any:
        return await _control(llm.control_call(verb, **fields))

    @app.post("/sleep", dependencies=auth)
    async def sleep(raw: Request) -> dict:
        req = await _parse(raw, SleepRequest)
        await run("sleep", level=req.level)
        return {"success": True, "is_sleeping": True}

    @app.post("/wake_up", dependencies=auth)
    async def wake_up(raw: Request) -> dict:
        req = await _parse(raw, WakeUpRequest, list_fields=("tags",))
        await run("wake_up", tags=req.tags)
        return {"success": True, "is_sleeping": await run("is_sleeping")}

    @app.get("/is_sleeping", dependencies=auth)
    async def is_sleeping() -> dict:
        return {"is_sleeping": await run("is_sleeping")}

    return ["/is_sleeping", "/sleep", "/wake_up"]


def _version(req: UpdateFromDiskRequest) -> int:
    """The version to publish: an integer (SGLang clients may send it as a string of digits)."""
    given = [v for v in (req.version, req.weight_version) if v is not None]
    if not given:
        raise InvalidRequestError("version is required (a non-negative integer, above the committed one)",
                                  param="version")
    if len(given) == 2 and str(given[0]) != str(given[1]):
        raise InvalidRequestError(f"version ({given[0]!r}) and weight_version ({given[1]!r}) differ", param="version")
    v = given[0]
    if isinstance(v, str):
        # NOTE: str.isdigit() and int() also accept non-ASCII digits ("١٢", "１２"): only 0-9 here.
        if not (v.isascii() and v.isdigit()) or len(v) > 19:
            raise InvalidRequestError(f"version must be a non-negative integer written with ASCII digits, got {v!r:.40}",
                                      param="version")
        v = int(v)
    if not 0 <= v <= MAX_VERSION:
        raise InvalidRequestError(f"version must be in [0, 2**63 - 1], got {v}", param="version")
    return v


async def _control(call: Awaitable[Any]) -> Any:
    """Awaits an engine call; a state the engine refuses becomes 409."""
    try:
        return await call
    except EngineDeadError:
        raise  # 503, as for generation
    except EngineStateError as e:
        raise APIError(409, str(e), type="invalid_request_error", code="conflict") from e


async def _load_from_disk(call: Awaitable[Any], model_path: str) -> Any:
    """Awaits an update from disk. A checkpoint it cannot load is a 400 that says only that: the
    details (file names, tensor names, config values, the loader's messages) go to the log under
    an error id, so a client cannot probe the server's files through the error."""
    try:
        return await _control(call)
    except (CheckpointError, WeightUpdateError) as e:
        if isinstance(e, WeightUpdateError) and e.param == "version":
            raise  # about the request, not the files
        error_id = new_error_id()
        logger.warning("update_weights_from_disk(%r) refused (error id %s): %s", model_path, error_id, e)
        raise APIError(400, f"model_path is not a loadable checkpoint for this model (error id {error_id}; the "
                            "server log has the details); nothing was changed", param="model_path",
                       code="invalid_value") from None


async def _parse(raw: Request, model: type[T], list_fields: tuple[str, ...] = ()) -> T:
    """The request's fields from its query string and (overriding it) its JSON body."""
    data: dict[str, Any] = {k: raw.query_params.getlist(k) if k in list_fields else raw.query_params[k]
                            for k in raw.query_params}
    body = await raw.body()
    if body.strip():
        parsed = decode_json(body)
        if not isinstance(parsed, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        data.update(parsed)
    return parse_model(data, model)
