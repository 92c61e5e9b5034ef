"""Every failure leaves the server as an OpenAI error body: `{"error": {message, type, param, code}}`.

Handlers here turn FastAPI's validation errors (normally 422), Starlette's HTTP errors (404 route,
405 method, 413 body) and engine rejections into that shape, so clients see one format everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("titan.server")


class APIError(Exception):
    """An error with an HTTP status that reaches the client in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # OpenAI calls every client mistake an invalid_request_error and its own faults server_error.
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


# Starlette's own statuses (unknown route, wrong method, oversized body) mapped to OpenAI codes.
_HTTP_CODES = {
    HTTPStatus.NOT_FOUND: "not_found",
    HTTPStatus.METHOD_NOT_ALLOWED: "method_not_allowed",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: "unsupported_media_type",
}


def _location(loc: tuple[Any, ...]) -> str | None:
    # ("body", "prompt", "list[int]", 2) -> "prompt.2": drop FastAPI's "body" and pydantic's union-member
    # tags (type names like "str", "list[int]", "TextPart"), which name no field the client sent.
    parts = [str(part) for part in loc if part != "body" and not _is_union_tag(part)]
    return ".".join(parts) or None


def _is_union_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "none")


# Pydantic error types that mean the type was right but the value is not allowed.
_VALUE_ERRORS = ("finite_number", "greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "too_short", "too_long", "literal_error")


def validation_error(errors: Sequence[Any]) -> APIError:
    """Pydantic's error list → one 400 naming the first offending field."""
    if any(error.get("type") == "json_invalid" for error in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = detail.get("ctx", {}).get("error", "malformed JSON")
        return bad_request(f"The request body is not valid JSON: {reason}", code="invalid_json")
    messages: list[str] = []
    for error in errors:
        where = _location(tuple(error.get("loc", ())))
        text = f"{where}: {error.get('msg')}" if where else str(error.get("msg"))
        if text not in messages:  # a union reports one error per member, often alike
            messages.append(text)
    messages = messages[:5]
    first = errors[0] if errors else {}
    param = _location(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "missing":
        code = "missing_required_parameter"
    elif kind in _VALUE_ERRORS:
        code = "invalid_value"
    else:
        code = "invalid_type"
    return bad_request("Invalid request: " + "; ".join(messages), param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc.errors()))

    async def on_http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = HTTPStatus(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) and exc.detail != status.phrase else status.phrase
        code = _HTTP_CODES.get(status, status.phrase.lower().replace(" ", "_"))
        return error_response(APIError(status, message, code=code, headers=exc.headers))

    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {exc}",
                                       code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
