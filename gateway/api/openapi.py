"""The gateway's OpenAPI description (`GET /openapi.json`) made exact for this deployment.

FastAPI derives it from the request models of `gateway.schemas`; `install(app, model_names)` then narrows `model`
(and the id of `GET /v1/models/{id}`) to the ids this gateway serves (any other is a 404), sets the request models'
examples to the served model, and documents what the gateway answers for an invalid body: a 400 with OpenAI's error
object, not FastAPI's 422. Clients and property-based tests (tests/gateway/test_api_property.py, schemathesis) generate
requests from it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    }},
}
# request model -> whether `model` is required there
MODEL_FIELDS = {"ChatCompletionRequest": True, "CompletionRequest": True, "ResponsesRequest": True,
                "TokenizeRequest": False, "DetokenizeRequest": False}


def _narrow(schema: Dict[str, Any], names: Sequence[str]) -> None:
    components = schema.get("components", {}).get("schemas", {})
    for model, required in MODEL_FIELDS.items():
        properties = components.get(model, {}).get("properties", {})
        if "model" in properties:
            served = {"type": "string", "enum": list(dict.fromkeys(names))}
            properties["model"] = served if required else {"anyOf": [served, {"type": "null"}]}
        for example in components.get(model, {}).get("examples", []):
            example["model"] = names[0]
    components["ErrorResponse"] = ERROR_SCHEMA
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter.get("name") == "model_id":  # GET /v1/models/{model_id}
                    parameter["schema"] = {"type": "string", "enum": list(dict.fromkeys(names))}
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request: the error names the parameter",
                                    "content": {"application/json": {
                                        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def install(app: FastAPI, model_names: Callable[[], Sequence[str]]) -> None:
    """`model_names()`: the ids served now (the base model first; served LoRA adapters may come and go, so the
    description is built on each request of it, a few ms)."""
    def openapi() -> Dict[str, Any]:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _narrow(schema, model_names())
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
