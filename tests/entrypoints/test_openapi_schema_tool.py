"""tools/openapi_schema.py: the OpenAPI document API fuzzers get (docs/security.md, "Fuzzing the HTTP API")
carries each JSON route's request body from its protocol model."""
from __future__ import annotations

import sys
from pathlib import Path

from fastapi import FastAPI, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from openapi_schema import BODIES, openapi_document  # noqa: E402


def test_every_json_route_gets_its_models_body():
    app = FastAPI()
    for path in [p for p in BODIES if p != "/sleep"]:  # (a route the app lacks gets no body)
        async def route(request: Request) -> dict:  # (the server's routes parse their bodies themselves)
            return {}
        app.post(path)(route)
    doc = openapi_document(app)
    schemas = doc["components"]["schemas"]
    assert "/sleep" not in doc["paths"]
    for path, model in [(p, m) for p, m in BODIES.items() if p != "/sleep"]:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}"
        assert set(model.model_fields) <= set(schemas[model.__name__]["properties"])
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    # every reference the bodies make resolves inside the document
    text = str(doc)
    for name in {part.split("'")[0] for part in text.split("#/components/schemas/")[1:]}:
        assert name in schemas, name
