"""`LimitsMiddleware`: what every request must pass before a route sees it.

A pure ASGI middleware, outermost but for Starlette's error handler, so its refusals
happen before FastAPI parses anything:

1. **Header size** (`max_header_bytes`, 431). uvicorn's h11 parser enforces the same
   bound while reading (`swarm_server.cli`); this check holds whatever HTTP parser runs.
2. **Auth first** (401/403). The bearer token is checked from the headers alone, so a
   request with no token gets 401 whatever its body holds (FastAPI would otherwise
   answer a malformed body with 422 before the route's auth dependency ran). Every
   path needs a token (reader at least, including `/docs`, `/redoc`, `/openapi.json`
   and unknown paths) except `OPEN_PATHS`: `/health`; every path under
   `EPISODE_KEY_PREFIX` (`/v1/`: chat, completions, responses, models), which is
   authenticated by the signed episode key in its route; and the web console
   under `CONSOLE_PREFIX` (`/ui`), whose pages check their cookie session in one
   dependency (`deps.ConsoleAuth`; sign-in and the style sheets need none). A route that depends
   on `ControlAuth`, `ApproverAuth` or `ReviewerAuth` needs that token here too
   (`deps.ROLE_CHECKS`). The route's own dependency still
   runs: this is a second, earlier gate, and a route that forgot its dependency is
   still closed to anyone without a token.
3. **Body size** (`max_json_bytes`, 413). Every route except `STREAMED_PATHS` takes a
   JSON body, read here whole up to the cap (a declared Content-Length over the cap is
   refused before reading). The two upload routes stream to disk and enforce their own
   caps (`max_upload_bytes`, `max_file_bytes`, ...) as bytes arrive.
4. **JSON encoding and depth** (400), on the buffered body, before any parser sees it:
   a body that is not UTF-8 (RFC 8259) or nests deeper than `max_json_depth`.
5. **Body idle timeout** (`request_body_timeout_s`). A client that stops sending in the
   middle of a body gets 408 on JSON routes; on the upload routes the stall reads as a
   disconnect, so the route refuses the upload and removes its temp files.

Refusals are `{"detail", "hint"}` bodies like every other error (`swarm_server.errors`),
with OpenAI's `error` object as well under `/v1/`; `LIMIT_RESPONSES` documents them on
every operation of the OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ajet.protocol import ErrorBody
from swarm_server.auth import bearer_token, require_reader
from swarm_server.deps import ROLE_CHECKS
from swarm_server.errors import ApiError, PayloadTooLarge, openai_error_body
from swarm_server.settings import Settings

__all__ = ["CONSOLE_PREFIX", "EPISODE_KEY_PREFIX", "LIMIT_RESPONSES", "OPEN_PATHS",
           "STREAMED_PATHS", "LimitsMiddleware", "json_too_deep"]

#: Paths that need no bearer token.
OPEN_PATHS = frozenset({"/health"})
#: The OpenAI-compatible routes: they carry a signed episode key instead of a token.
EPISODE_KEY_PREFIX = "/v1/"
#: The web console: cookie sessions, checked by `deps.ConsoleAuth` in its routes.
CONSOLE_PREFIX = "/ui"
#: Upload routes that stream their body to disk under their own caps.
STREAMED_PATHS = frozenset({"/sync_train_code", "/code/blobs"})

#: The refusals of this middleware, for the OpenAPI schema of every operation (a route's
#: own description of the same status wins).
LIMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Malformed request: the body is not UTF-8 JSON, "
                                             "or nests deeper than max_json_depth"},
    408: {"model": ErrorBody, "description": "The body stalled for request_body_timeout_s"},
    413: {"model": ErrorBody, "description": "A size limit was passed (docs/limits.md)"},
    431: {"model": ErrorBody, "description": "Request headers over max_header_bytes"},
}

#: A token check: the settings and the bearer token -> the role, or raises 401/403.
_Check = Callable[[Settings, "str | None"], str]
# One JSON string, escapes included (unrolled loop: linear, no backtracking blow-up).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# A container holding no container: one nesting level, removed per pass.
_INNERMOST = re.compile(rb"[\[{][^\[\]{}]*[\]}]")
_OPENERS = re.compile(rb"[\[{]")


def json_too_deep(body: bytes, limit: int) -> bool:
    """True if the JSON text nests arrays/objects deeper than `limit`.

    Linear passes of compiled regexes, never a recursive parse: strings are blanked
    (brackets inside them do not count), then each pass removes the innermost level.
    Text that is not JSON may be judged either way; the parser refuses it next.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # cannot be deeper than it has openers
    text = _JSON_STRING.sub(b'""', body)
    for _ in range(limit):
        text, removed = _INNERMOST.subn(b"0", text)
        if not removed:
            return False
    return _OPENERS.search(text) is not None


@dataclass(frozen=True)
class _Refusal:
    status: int
    detail: str
    hint: str
    headers: dict[str, str] | None = None

    async def send(self, scope: Scope, receive: Receive, send: Send) -> None:
        body: dict[str, Any] = {"detail": self.detail, "hint": self.hint}
        if scope["path"].startswith(EPISODE_KEY_PREFIX):
            body = openai_error_body(self.status, self.detail, self.hint)
        response = JSONResponse(body, status_code=self.status, headers=self.headers)
        await response(scope, receive, send)


class _BodyTimeout(Exception):
    """No body bytes arrived within `request_body_timeout_s`."""


class _Disconnected(Exception):
    """The client went away before its body was complete: nobody to answer."""


_PATH_CACHE_SIZE = 4096


class LimitsMiddleware:
    """See the module docstring. `routes` are the app's routes (to find control routes)."""

    def __init__(self, app: ASGIApp, *, settings: Settings, routes: Sequence[BaseRoute]
                 ) -> None:
        self.app = app
        self.settings = settings
        self._routes = routes
        # (method, path) -> the token check its route needs; the route table never
        # changes, and a linear scan of every route's regex costs more than the rest of
        # this gate. Bounded, because paths with ids (`/runs/{id}`) are unbounded in number.
        self._check_by_path: dict[tuple[str, str], _Check] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._header_refusal(scope) or self._auth_refusal(scope)
        if refusal is not None:
            await refusal.send(scope, receive, send)
            return
        if scope["path"] in STREAMED_PATHS:
            await self.app(scope, self._idle_limited(receive), send)
            return
        try:
            body = await self._read_json_body(scope, receive)
        except ApiError as exc:
            await _Refusal(exc.status, str(exc.detail), exc.hint).send(scope, receive, send)
            return
        except _Disconnected:
            return
        except _BodyTimeout:
            wait = self.settings.request_body_timeout_s
            await _Refusal(408, f"no request body bytes for {wait:g} s; the request was dropped",
                           "send the whole body without pausing",
                           {"Connection": "close"}).send(scope, receive, send)
            return
        if body and not _is_utf8(body):
            await _Refusal(400, "request body is not UTF-8 text",
                           "send JSON encoded as UTF-8 with Content-Type: application/json"
                           ).send(scope, receive, send)
            return
        if body and json_too_deep(body, self.settings.max_json_depth):
            await _Refusal(400, f"JSON nested deeper than {self.settings.max_json_depth} levels",
                           "flatten the body, or raise AJET_SWARM_MAX_JSON_DEPTH on the server"
                           ).send(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    # ------------------------------------------------------------------ checks

    def _header_refusal(self, scope: Scope) -> _Refusal | None:
        limit = self.settings.max_header_bytes
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])  # ": " and CRLF
        if size <= limit:
            return None
        return _Refusal(431, f"request headers of {size} bytes are over the server's "
                             f"{limit}-byte limit",
                        "send fewer or shorter headers, or raise AJET_SWARM_MAX_HEADER_BYTES",
                        {"Connection": "close"})

    def _auth_refusal(self, scope: Scope) -> _Refusal | None:
        path = scope["path"]
        if path in OPEN_PATHS or path.startswith(EPISODE_KEY_PREFIX) or path == CONSOLE_PREFIX \
                or path.startswith(CONSOLE_PREFIX + "/"):
            return None
        token = bearer_token(_header(scope, b"authorization"))
        try:
            self._authorize(scope, token)
        except ApiError as exc:
            return _Refusal(exc.status, str(exc.detail), exc.hint, exc.headers)
        return None

    def _authorize(self, scope: Scope, token: str | None) -> str:
        return self._check(scope)(self.settings, token)

    def _check(self, scope: Scope) -> _Check:
        key = (scope.get("method", ""), scope["path"])
        known = self._check_by_path.get(key)
        if known is None:
            known = self._route_check(scope)
            if len(self._check_by_path) >= _PATH_CACHE_SIZE:
                self._check_by_path.clear()
            self._check_by_path[key] = known
        return known

    def _route_check(self, scope: Scope) -> _Check:
        # iter_route_contexts flattens included routers (FastAPI keeps them nested), so
        # each route is matched with its full path and read for its own dependencies. A
        # FULL match wins; else the first PARTIAL one (wrong method: the route answers 405
        # to an authorised caller), like the router itself.
        partial: _Check | None = None
        for context in iter_route_contexts(self._routes):
            match, _ = context.matches(scope)
            if match is Match.FULL:
                return _check_of(context.original_route)
            if match is Match.PARTIAL and partial is None:
                partial = _check_of(context.original_route)
        return partial or require_reader

    async def _read_json_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_json_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._next(receive)
            if message["type"] != "http.request":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _next(self, receive: Receive) -> Message:
        try:
            return await asyncio.wait_for(receive(), self.settings.request_body_timeout_s)
        except asyncio.TimeoutError as exc:
            raise _BodyTimeout from exc

    def _idle_limited(self, receive: Receive) -> Receive:
        """`receive` for a streamed upload: a stalled body reads as a disconnect."""
        done = False

        async def wrapped() -> Message:
            nonlocal done
            if done:  # body complete: waiting for a disconnect has no time limit
                return await receive()
            try:
                message = await self._next(receive)
            except _BodyTimeout:
                done = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        return wrapped


def _check_of(route: BaseRoute) -> _Check:
    """The token check of a route's auth dependency (`deps.ROLE_CHECKS`); reader if none."""
    if isinstance(route, APIRoute):
        for dep in route.dependant.dependencies:
            check = ROLE_CHECKS.get(dep.call)  # type: ignore[arg-type]
            if check is not None:
                return check
    return require_reader


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then defers to the real one."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _too_large(size: int, limit: int) -> ApiError:
    return PayloadTooLarge(f"request body of {size} bytes is over the server's {limit}-byte "
                           "limit for JSON routes",
                           "send less (page through it), or raise AJET_SWARM_MAX_JSON_BYTES")
