"""The swarm server's error handlers: every error rendered by `ajet.errors.error_response`.

Routes raise `ajet.errors.SwarmHTTPError` (or the subclass of its status: the tree is in
`ajet.errors`), rendered as `{"detail", "hint"}` (plus `param` where a field is named)
with its status; the OpenAI-compatible routes (`/v1/*`) answer the same errors in
OpenAI's shape as well (`openai_error_body`), the hint kept in the message.

Anthropic's Messages routes (`/v1/messages`, `/v1/messages/...`, `is_anthropic_path`)
answer in Anthropic's shape (`anthropic_error_body`), likewise next to `detail`, `hint`
and `param`.

`StartupRefused` is no HTTP error: the server refuses to start (an unreadable ledger, an
engine user that cannot run the engine); `ajet-swarm start` prints it and exits 2.

`EarlyRefusal` carries a `SwarmHTTPError` out of an ASGI `receive` (`swarm_server.limits`):
FastAPI passes an HTTPException met while reading a body through unchanged and turns
anything else into a generic 400, so the refusal travels as one and is rendered here
like the error it wraps (OpenAI-shaped under `/v1/`).

Anything else raised in a handler becomes a 500 with a generic body and a logged
traceback; tests treat any 5xx as a bug.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ajet.errors import SwarmHTTPError, error_response, validation_error

__all__ = ["EarlyRefusal", "StartupRefused", "install_error_handlers", "is_anthropic_path",
           "validation_error_response"]

log = logging.getLogger(__name__)


def is_anthropic_path(path: str) -> bool:
    """The Messages routes, whose errors are Anthropic-shaped."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class StartupRefused(Exception):
    """The server cannot start safely; the message says why and what to do."""


class EarlyRefusal(StarletteHTTPException):
    """A `SwarmHTTPError` raised from inside `receive`; see the module docstring."""

    def __init__(self, error: SwarmHTTPError, *, openai: bool = False, anthropic: bool = False
                 ) -> None:
        super().__init__(error.status, detail=str(error.detail), headers=error.headers)
        self.error = error
        self.openai = openai
        self.anthropic = anthropic


def validation_error_response(errors: Sequence[Mapping[str, Any]]) -> JSONResponse:
    """422 for request validation errors (pydantic's, `loc` starting with `body` ...)."""
    return error_response(validation_error(errors))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SwarmHTTPError)
    async def _swarm_error(_: Request, exc: SwarmHTTPError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, EarlyRefusal):
            return error_response(exc.error, openai=exc.openai, anthropic=exc.anthropic)
        hint = "see /docs for the routes" if exc.status_code in (404, 405) else ""
        return error_response(SwarmHTTPError(exc.status_code, exc.detail, hint,
                                             headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(SwarmHTTPError(500, "internal server error",
                                             "see the swarm server log"))
