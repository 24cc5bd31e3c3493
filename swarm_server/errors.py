"""Errors the swarm server answers with, and the one handler that renders them.

    ApiError(status, detail, hint)      base; rendered as {"detail": ..., "hint": ...}
    ├── BadRequest          400
    ├── Unauthorized        401
    ├── Forbidden           403
    ├── NotFound            404
    ├── EngineStateError    409  (wrong engine state: the hint says what to call)
    │   └── ApprovalRequired 409 (the snapshot is not approved: `detail` says where)
    ├── PayloadTooLarge     413
    └── Unprocessable       422  (validation: `detail` names the fields)

Anything else raised in a handler becomes a 500 with a generic body and a logged
traceback; tests treat any 5xx as a bug.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = [
    "ApiError",
    "ApprovalRequired",
    "BadRequest",
    "EngineStateError",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "Unauthorized",
    "Unprocessable",
    "install_error_handlers",
]

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 500

    def __init__(self, detail: Any, hint: str = "", *, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(str(detail))
        self.detail = detail
        self.hint = hint
        self.headers = headers


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "hint": exc.hint}, status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""),
             "type": e.get("type", "")}
            for e in exc.errors()
        ]
        fields = ", ".join(".".join(e["loc"][1:] or e["loc"]) for e in errors)
        return JSONResponse(
            {"detail": errors, "hint": f"fix the field(s): {fields}; see /docs for the schema"},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
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
