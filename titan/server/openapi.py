"""The OpenAPI document: the POST routes parse their bodies themselves (any Content-Type, OpenAI-shaped
errors), so their request schemas and error responses are declared here for schema-driven clients."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every failure, in OpenAI's shape."""

    error: ErrorDetail


_ERRORS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or route",
           413: "request body too large", 429: "overloaded (see Retry-After)", 503: "loading, draining or stopped"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description,
             "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
    for status, description in _ERRORS.items()}

# /debug/* answers only these errors of its own (a bad query parameter is a 400 like any other).
DEBUG_ERRORS = {status: ERROR_RESPONSES[status] for status in (400, 401)}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, bodies: list[type[BaseModel]]) -> None:
    """Generate the document once, with `bodies` and ErrorResponse (and what they nest) as components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in [*bodies, ErrorResponse]:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
