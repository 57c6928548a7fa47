"""OpenAI's error envelope for every failure: `{"error": {"message", "type", "param", "code"}}`.

`APIError` (and its helpers `bad_request`, `not_found`, ...) is raised anywhere in the gateway; the handlers
installed by `install_error_handlers` turn it, FastAPI's validation errors (400, never 422), Starlette's
HTTP errors (unknown route, wrong method), a failing state store (503 `store_unavailable`, `gateway.store`) and any
unexpected exception (500, logged, no traceback sent)
into that envelope (an unknown field of a body that forbids them: "Unknown parameter: 'x'", as OpenAI says).
`error_body` gives the same object for errors sent inside an SSE stream.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.store.base import StoreUnavailable

logger = logging.getLogger("swarmgate.gateway")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; the message is safe to show to the client."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Mapping[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
                 ) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(404, message, "invalid_request_error", param, code)


def rate_limited(message: str, retry_after: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after)})


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, "service_unavailable", None, code)


def internal(message: str = "The gateway failed to process the request.") -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # drop pydantic's union-member tags (e.g. "str", "list[str]", gateway.responses' "kind:...") so that the param
    # names the field
    tags = ("list[", "dict[", "function-", "kind:")
    loc = [p for p in loc if not (p.startswith(tags) or p in ("str", "int", "float"))]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    if first.get("type") == "extra_forbidden":  # a body that rejects unknown fields (the Responses API's)
        return f"Unknown parameter: '{param}'.", param
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return (f"Invalid value for '{param}': {message}{more}." if param else f"Invalid request: {message}{more}."), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _STATUS_TYPES.get(exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error")
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404:
            message = f"Unknown endpoint: {request.method} {request.url.path}"
        return APIError(exc.status_code, message, kind, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        logger.warning(f"{request.method} {request.url.path}: {exc}")
        return unavailable(f"{exc}; this request needs it, retry later.", code="store_unavailable").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception(f"unhandled error on {request.method} {request.url.path}")
        return internal().response()
