"""Errors the swarm server answers with, and the one handler that renders them.

    ApiError(status, detail, hint)      base; rendered as {"detail": ..., "hint": ...}
    ├── BadRequest          400
    ├── Unauthorized        401
    ├── Forbidden           403
    ├── NotFound            404
    ├── RequestTimeout      408  (a request body stalled)
    ├── EngineStateError    409  (wrong engine state: the hint says what to call)
    │   └── ApprovalRequired 409 (the snapshot is not approved: `detail` says where)
    ├── PayloadTooLarge     413
    ├── Unprocessable       422  (validation: `detail` names the fields)
    └── HeadersTooLarge     431

`StartupRefused` is no HTTP error: the server refuses to start (an unreadable ledger, an
engine user that cannot run the engine); `ajet-swarm start` prints it and exits 2.

`EarlyRefusal` carries an `ApiError` out of an ASGI `receive` (`swarm_server.limits`):
FastAPI passes an HTTPException met while reading a body through unchanged and turns
anything else into a generic 400, so the refusal travels as one and is rendered here
like the error it wraps (OpenAI-shaped under `/v1/`).

Anything else raised in a handler becomes a 500 with a generic body and a logged
traceback; tests treat any 5xx as a bug.

The OpenAI-compatible routes (`/v1/*`) answer the same errors in OpenAI's shape as well
(`openai_error_body`): `{"error": {"message", "type", "param", "code"}}`, the hint kept in
the message, next to `detail` and `hint`. Anthropic's Messages routes (`/v1/messages`,
`/v1/messages/...`) answer in Anthropic's (`anthropic_error_body`): `{"type": "error",
"error": {"type", "message"}}`, likewise next to `detail`, `hint` and `param`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = [
    "ApiError",
    "ApprovalRequired",
    "BadRequest",
    "EarlyRefusal",
    "EngineStateError",
    "Forbidden",
    "HeadersTooLarge",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "StartupRefused",
    "Unauthorized",
    "Unprocessable",
    "anthropic_error_body",
    "error_body",
    "error_response",
    "install_error_handlers",
    "is_anthropic_path",
    "openai_error_body",
    "validation_error_response",
]

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 500

    def __init__(self, detail: Any, hint: str = "", *, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(str(detail))
        self.detail = detail
        self.hint = hint
        self.headers = headers
        #: the request field at fault, where one is named (OpenAI's `error.param`)
        self.param = param


#: OpenAI's `error.type` per status.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                 409: "conflict_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 431: "invalid_request_error"}


def openai_error_body(status: int, detail: Any, hint: str = "", *, param: str | None = None
                      ) -> dict[str, Any]:
    """`{"detail", "hint"}` plus OpenAI's `error` object, for the `/v1/*` routes."""
    text = detail if isinstance(detail, str) else _detail_text(detail)
    message = f"{text} (hint: {hint})" if hint else text
    return {"detail": detail, "hint": hint,
            "error": {"message": message,
                      "type": _OPENAI_TYPES.get(status, "api_error" if status >= 500
                                                else "invalid_request_error"),
                      "param": param, "code": status}}


#: Anthropic's `error.type` per status (its SDK raises by status; the type is for logs).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, detail: Any, hint: str = "", *,
                         param: str | None = None) -> dict[str, Any]:
    """`{"detail", "hint", "param"}` plus Anthropic's error, for the Messages routes."""
    text = detail if isinstance(detail, str) else _detail_text(detail)
    return {"type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                   else "invalid_request_error"),
                      "message": f"{text} (hint: {hint})" if hint else text},
            "detail": detail, "hint": hint, "param": param}


def is_anthropic_path(path: str) -> bool:
    """The Messages routes, whose errors are Anthropic-shaped."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _detail_text(detail: Any) -> str:
    # a validation detail is a list of {"loc", "msg"}: name each field
    if isinstance(detail, list):
        parts = [f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg', '')}"
                 for e in detail if isinstance(e, dict)]
        if parts:
            return "; ".join(parts)
    return str(detail)


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class RequestTimeout(ApiError):
    status = 408


class EngineStateError(ApiError):
    status = 409


class ApprovalRequired(EngineStateError):
    """The code is not approved by an approver (pending, denied or revoked): it cannot be
    activated and the engine cannot start on it. `detail` carries `snapshot_id`,
    `approval_state` and where to approve."""


class PayloadTooLarge(ApiError):
    status = 413


class Unprocessable(ApiError):
    status = 422


class HeadersTooLarge(ApiError):
    status = 431


class StartupRefused(Exception):
    """The server cannot start safely; the message says why and what to do."""


class EarlyRefusal(StarletteHTTPException):
    """An `ApiError` raised from inside `receive`; see the module docstring."""

    def __init__(self, error: ApiError, *, openai: bool = False, anthropic: bool = False
                 ) -> None:
        super().__init__(error.status, detail=str(error.detail), headers=error.headers)
        self.error = error
        self.openai = openai
        self.anthropic = anthropic


def error_body(exc: ApiError, *, openai: bool = False, anthropic: bool = False
               ) -> dict[str, Any]:
    """`{"detail", "hint"}`, OpenAI-shaped as well with `openai`, Anthropic's with
    `anthropic`."""
    if anthropic:
        return anthropic_error_body(exc.status, exc.detail, exc.hint, param=exc.param)
    if openai:
        return openai_error_body(exc.status, exc.detail, exc.hint, param=exc.param)
    return {"detail": exc.detail, "hint": exc.hint}


def error_response(exc: ApiError, *, openai: bool = False, anthropic: bool = False
                   ) -> JSONResponse:
    """The response for `exc`, its body shaped as `error_body` says."""
    return JSONResponse(error_body(exc, openai=openai, anthropic=anthropic),
                        status_code=exc.status, headers=exc.headers)


def validation_error_response(errors: Sequence[Mapping[str, Any]]) -> JSONResponse:
    """422 for request validation errors (pydantic's, `loc` starting with `body` ...)."""
    detail = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""),
               "type": e.get("type", "")} for e in errors]
    fields = ", ".join(".".join(e["loc"][1:] or e["loc"]) for e in detail)
    return JSONResponse(
        {"detail": detail, "hint": f"fix the field(s): {fields}; see /docs for the schema"},
        status_code=422,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, EarlyRefusal):
            return error_response(exc.error, openai=exc.openai, anthropic=exc.anthropic)
        hint = "see /docs for the routes" if exc.status_code in (404, 405) else ""
        return JSONResponse({"detail": exc.detail, "hint": hint}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"detail": "internal server error", "hint": "see the swarm server log"},
            status_code=500,
        )
