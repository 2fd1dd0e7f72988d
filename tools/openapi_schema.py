"""Writes an OpenAPI document of `loopline serve`'s routes, with the request bodies of the JSON routes, for
API fuzzers (docs/security.md, "Fuzzing the HTTP API").

The server itself serves no /openapi.json (what it exposes is exactly its routes), and its JSON routes parse
their bodies with the protocol's pydantic models, so FastAPI's generated document has no bodies: this tool
builds the app on the bundled demo model, takes FastAPI's document and adds each JSON route's body schema
from its model.

    python tools/openapi_schema.py --out /tmp/openapi.json [--enable-rl-api]

With ``--enable-rl-api`` the document has the routes `loopline serve --enable-rl-api` mounts too (/generate and
the RL control routes, sleep and wake-up among them).
"""
from __future__ import annotations

import argparse
import json

from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from loopline.config import EngineArgs
from loopline.entrypoints.async_llm import AsyncLLM
from loopline.entrypoints.openai import protocol
from loopline.entrypoints.openai.api_server import build_app
from loopline.entrypoints.openai.serving_generate import GenerateRequest
from loopline.entrypoints.openai.serving_rl import (
    AbortRequest,
    PauseRequest,
    SleepRequest,
    UpdateFromDiskRequest,
    WakeUpRequest,
)

BODIES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
          "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest,
          # --enable-rl-api (or --enable-sleep-mode: sleep and wake-up)
          "/generate": GenerateRequest, "/pause": PauseRequest, "/pause_generation": PauseRequest,
          "/abort_request": AbortRequest, "/update_weights_from_disk": UpdateFromDiskRequest, "/sleep": SleepRequest,
          "/wake_up": WakeUpRequest}


def openapi_document(app) -> dict:
    """FastAPI's document of ``app``'s routes plus the request bodies of the JSON routes it has (:data:`BODIES`)."""
    doc = get_openapi(title="loopline", version="0", routes=app.routes)
    mounted = {path: model for path, model in BODIES.items() if "post" in doc["paths"].get(path, {})}
    _, top = models_json_schema([(m, "validation") for m in set(mounted.values())],
                                ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
    for path, model in mounted.items():
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the JSON document")
    ap.add_argument("--enable-rl-api", action="store_true", help="the routes `loopline serve --enable-rl-api` adds")
    args = ap.parse_args()
    llm = AsyncLLM(EngineArgs(device="cpu"))
    try:
        doc = openapi_document(build_app(llm, enable_rl_api=args.enable_rl_api))
    finally:
        llm.shutdown()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{args.out}: {len(doc['paths'])} routes")


if __name__ == "__main__":
    main()
