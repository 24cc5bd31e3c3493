"""`LimitsMiddleware`: what every request must pass before a route sees its body.

A pure ASGI middleware, outermost but for Starlette's error handler; the episode lane,
which serves the episode plane's hot rows in front of the whole stack, passes its
requests through the same two gates (`first_gate`, `gated`). Two gates:

**At the headers, before routing:**

1. **Header size** (`max_header_bytes`, 431). uvicorn's h11 parser enforces the same
   bound while reading, and `swarm_server.http_protocol` closes a connection whose
   headers do not arrive within `header_timeout_s`; this check holds whatever parser runs.
2. **A credential** (401). Every path needs one except `OPEN_PATHS` (`/health`) and
   the web console under `CONSOLE_PREFIX` (`/ui`, whose pages check their cookie
   session with `deps.ConsoleAuth`; sign-in and the style sheets need none): under
   `EPISODE_PREFIX` (`/v1/`) the signed episode key of a live episode
   (`EpisodeGateway.check_key`; as `Authorization: Bearer` or `x-api-key`; the episode id
   it finds is left in the scope, `auth.EPISODE_SCOPE`, for the route), at
   `INDEX_PATH` (`/`) that or a reader token, everywhere else a token `auth.authenticate` accepts
   (including `/docs`, `/openapi.json` and unknown paths: 401, not 404). An anonymous
   caller gets nothing parsed, buffered or routed.

**At the body, after routing, before its first byte is read** (the first `receive`):

3. **The route's requirement** (401/403): the `auth.Requirement` instances the matched
   route declares as dependencies (`deps.ControlAuth`, ...) are read off the route
   (`scope["route"]`, set by FastAPI's router) and checked from the headers. FastAPI
   reads a body before it solves dependencies, so without this a worker's malformed
   body to a control route was a 422 and its 15 MiB manifest was parsed before the
   403. A route outside `/v1/` and `/ui` that declares none needs the control token
   (fail closed).
4. **The route's body bound** (413): `BodyLimit` declared on the route, else
   `max_json_bytes`; a declared Content-Length over it is refused unread, a chunked body
   as soon as it passes. `STREAMED_BODY` routes (the two uploads) stream to disk under
   their own caps instead.
5. **JSON encoding and depth** (400), on the buffered body, before any parser: a body
   that is not UTF-8 (RFC 8259) or nests deeper than `max_json_depth`, or one that holds
   what cannot be stored or sent back (`unencodable_field`): a lone surrogate escape
   (`"\\ud800"`, no text in any encoding) or `NaN` / `Infinity` (no JSON at all, though
   Python's parser takes them): a 422 naming the field, as validation would.
6. **Body idle timeout** (`request_body_timeout_s`). A client that stops sending in the
   middle of a body gets 408; on a streamed route the stall reads as a disconnect, so
   the route refuses the upload and removes its temp files.

**Anonymous bodies** (a route that declares no requirement: the console's sign-in, the
only one; any other body sent to an open path): each `AnonymousGate` the route declares
decides from the headers first (the sign-in's origin check and throttle), so a refused
caller never gets `100 Continue`, which the server sends only when the body is first
read; then the body is bounded to `ANONYMOUS_BODY_BYTES` and must arrive whole within
`header_timeout_s` of its first read, so a trickle cannot hold a connection open.

The first gate answers itself. The second raises `errors.EarlyRefusal` out of
`receive`, which FastAPI passes through from its body reading (anything else would
become a generic 400), and the app's error handler renders it. Refusals are
`{"detail", "hint"}` bodies like every other error, OpenAI-shaped under `/v1/` and
Anthropic-shaped on the Messages routes (`/v1/messages...`);
`LIMIT_RESPONSES` documents them on every operation of the OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import json
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ajet.protocol import ErrorBody
from ajet.errors import PayloadTooLarge, SwarmHTTPError, SwarmValidationError, error_response
from swarm_server.auth import (
    CREDENTIAL_SCOPE,
    EPISODE_SCOPE,
    ControlRequirement,
    IndexRequirement,
    Requirement,
    authenticate,
    episode_key,
)
from swarm_server.errors import EarlyRefusal, is_anthropic_path

if TYPE_CHECKING:
    from swarm_server.context import ServerContext

__all__ = ["ANONYMOUS_BODY_BYTES", "CONSOLE_PREFIX", "EPISODE_PREFIX", "LIMIT_RESPONSES",
           "OPEN_PATHS", "STREAMED_BODY", "AnonymousGate", "BodyLimit", "LimitsMiddleware",
           "json_too_deep", "request_headers", "unencodable_field"]

#: Paths that need no credential at all.
OPEN_PATHS = frozenset({"/health"})
#: The OpenAI-compatible episode plane: a signed episode key, never a bearer token.
EPISODE_PREFIX = "/v1/"
#: The server's index: a reader token or an episode key (`auth.IndexRequirement`).
INDEX_PATH = "/"
#: The web console: cookie sessions, checked by `deps.ConsoleAuth` in its routes.
CONSOLE_PREFIX = "/ui"
#: The most of a body read from a caller no credential admitted yet (the sign-in form).
ANONYMOUS_BODY_BYTES = 4096

#: The refusals of this middleware, for the OpenAPI schema of every operation (a route's
#: own description of the same status wins).
LIMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Malformed request: the body is not UTF-8 JSON, "
                                             "or nests deeper than max_json_depth"},
    408: {"model": ErrorBody, "description": "The body stalled for request_body_timeout_s"},
    413: {"model": ErrorBody, "description": "A size limit was passed (docs/limits.md)"},
    431: {"model": ErrorBody, "description": "Request headers over max_header_bytes"},
}

# One JSON string, escapes included (unrolled loop: linear, no backtracking blow-up).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# A container holding no container: one nesting level, removed per pass.
_INNERMOST = re.compile(rb"[\[{][^\[\]{}]*[\]}]")
_OPENERS = re.compile(rb"[\[{]")
_FAIL_CLOSED = ControlRequirement()
#: Where `request_headers` keeps the request's `Headers` in the scope.
_HEADERS_SCOPE = "ajet.headers"
#: `asyncio.timeout` (Python 3.11+)
_HAS_TIMEOUT = sys.version_info >= (3, 11)


#: A `\\u` escape of a surrogate (D800-DFFF): only these can make a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _Constant:
    """What the parser met in place of a number JSON forbids."""

    def __init__(self, text: str) -> None:
        self.text = text


def unencodable_field(body: bytes) -> tuple[list[str], str] | None:
    """(field path, what is wrong) for the first value that no JSON encoder or UTF-8 store
    takes back: a string or key with a lone surrogate, or `NaN` / `Infinity`. None when
    there is none, or when the body is no JSON at all (the route's parser says so).

    The full parse runs only when the bytes could hold one (a surrogate escape, the
    words NaN or Infinity), so ordinary bodies cost one scan.
    """
    if not _SURROGATE_ESCAPE.search(body) and b"NaN" not in body and b"Infinity" not in body:
        return None
    try:
        value = json.loads(body, parse_constant=_Constant)
    except ValueError:
        return None
    return _find_unencodable(value, [])


def _find_unencodable(value: Any, path: list[str]) -> tuple[list[str], str] | None:
    stack: list[tuple[Any, list[str]]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, _Constant):
            return where, f"{item.text} is not a JSON number"
        if isinstance(item, str):
            if _has_surrogate(item):
                return where, "a lone surrogate (\\ud800-\\udfff) is no text"
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                if _has_surrogate(key):
                    return [*where, key.encode("utf-8", "backslashreplace").decode()], \
                        "a key with a lone surrogate is no text"
                stack.append((child, [*where, key]))
        elif isinstance(item, list):
            stack.extend((child, [*where, str(i)]) for i, child in reversed(list(
                enumerate(item))))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(parts: list[str]) -> str:
    return ".".join(parts) or "(body)"


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
class BodyLimit:
    """A route's body rule, declared as a dependency and read by the middleware.

        @router.post("/end_episode", dependencies=[Depends(BodyLimit.setting(
            "max_episode_body_bytes"))])

    `bound(ctx)` is the route's byte bound (default `max_json_bytes`); it may depend on
    the server's state (a bound derived from the running job). `streamed` routes read
    their body themselves under their own caps (uploads): nothing is buffered for them.
    """

    bound: Callable[[ServerContext], int] | None = None
    streamed: bool = False
    #: Named in the 413's hint: where the bound is raised.
    knob: str = "AJET_SWARM_MAX_JSON_BYTES"

    @classmethod
    def setting(cls, name: str) -> BodyLimit:
        """The bound is the `Settings` field `name`."""
        return cls(bound=operator.attrgetter(f"settings.{name}"),
                   knob=f"AJET_SWARM_{name.upper()}")

    async def __call__(self) -> None:  # a declaration: FastAPI has nothing to do
        return None


class AnonymousGate:
    """A route's check of an anonymous request from its headers (and client address),
    declared as a dependency like `BodyLimit`; the middleware calls `admit` before the
    body is read. Raise an `SwarmHTTPError` to refuse."""

    def admit(self, scope: Scope) -> None:
        raise NotImplementedError

    async def __call__(self) -> None:  # a declaration: FastAPI has nothing to do
        return None


#: The upload routes: they stream their body to disk and enforce their own caps.
STREAMED_BODY = BodyLimit(streamed=True)
_DEFAULT_BODY = BodyLimit()


@dataclass(frozen=True)
class _RouteRules:
    requirements: tuple[Requirement, ...]
    body: BodyLimit
    gates: tuple[AnonymousGate, ...] = ()


@dataclass(frozen=True)
class _Refusal:
    error: SwarmHTTPError
    openai: bool = False
    anthropic: bool = False

    async def send(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(self.error, openai=self.openai, anthropic=self.anthropic)
        await response(scope, receive, send)


def _shapes(path: str) -> dict[str, bool]:
    """How a refusal on `path` is shaped: OpenAI's under `/v1/`, Anthropic's on Messages."""
    return {"openai": path.startswith(EPISODE_PREFIX), "anthropic": is_anthropic_path(path)}


class LimitsMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, *, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        self.settings = ctx.settings
        # route object id -> its rules; routes never change after start-up, and there are
        # few of them (ids, not paths: `/runs/{id}` matches unboundedly many paths)
        self._rules: dict[int, _RouteRules] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.first_gate(scope)
        if refusal is not None:
            await refusal.send(scope, receive, send)
            return
        await self.app(scope, self.gated(scope, receive), send)

    # ------------------------------------------------------------------ first gate

    def first_gate(self, scope: Scope) -> _Refusal | None:
        """The refusal of an HTTP request at its headers (size, credential), else None."""
        return self._header_refusal(scope) or self._credential_refusal(scope)

    def _header_refusal(self, scope: Scope) -> _Refusal | None:
        limit = self.settings.max_header_bytes
        headers = scope["headers"]
        if not isinstance(headers, list):  # any iterable, says ASGI (as `Headers` does)
            headers = scope["headers"] = list(headers)
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        # every name and value, plus ": " and CRLF each (one C-level join, no generator)
        size += len(b"".join(chain.from_iterable(headers))) + 4 * len(headers)
        if size <= limit:
            return None
        return _Refusal(SwarmHTTPError(431,
            f"request headers of {size} bytes are over the server's {limit}-byte limit",
            "send fewer or shorter headers, or raise AJET_SWARM_MAX_HEADER_BYTES",
            headers={"Connection": "close"}))

    def _credential_refusal(self, scope: Scope) -> _Refusal | None:
        path: str = scope["path"]
        if path in OPEN_PATHS or _is_console(path):
            return None
        headers = request_headers(scope)
        try:
            if path.startswith(EPISODE_PREFIX):
                # verified once: the route's EpisodeKeyRequirement reads it from the scope
                scope[EPISODE_SCOPE] = self.ctx.episodes.check_key(episode_key(headers))
            elif path == INDEX_PATH:
                IndexRequirement().check(scope["app"].state, headers)
            else:
                scope[CREDENTIAL_SCOPE] = authenticate(self.settings, headers)
        except SwarmHTTPError as exc:
            return _Refusal(exc, **_shapes(path))
        return None

    # ------------------------------------------------------------------ second gate

    def gated(self, scope: Scope, receive: Receive) -> Receive:
        """`receive` whose first call checks the route's rules and buffers the body."""
        state: dict[str, Any] = {"first": True, "replay": None, "stream": None}

        async def wrapped() -> Message:
            if state["first"]:
                state["first"] = False
                rules = self._rules_for(scope)
                try:
                    anonymous = self._check_requirements(scope, rules)
                    if anonymous:
                        for gate in rules.gates:
                            gate.admit(scope)
                        body = await asyncio.wait_for(
                            self._read_body(scope, receive, rules.body, anonymous=True),
                            self.settings.header_timeout_s)
                        if body is None:
                            return {"type": "http.disconnect"}
                        self._check_json(body)
                        return {"type": "http.request", "body": body, "more_body": False}
                    if rules.body.streamed:
                        state["stream"] = self._idle_limited(receive)
                    else:
                        body = await self._read_body(scope, receive, rules.body)
                        if body is None:
                            return {"type": "http.disconnect"}
                        self._check_json(body)
                        return {"type": "http.request", "body": body, "more_body": False}
                except SwarmHTTPError as exc:
                    raise EarlyRefusal(exc, **_shapes(scope["path"])) from None
                except asyncio.TimeoutError:
                    wait = self.settings.header_timeout_s
                    raise EarlyRefusal(SwarmHTTPError(408,
                        f"the body did not arrive within {wait:g} s",
                        "send the whole form at once", headers={"Connection": "close"}),
                        **_shapes(scope["path"])) from None
            if state["stream"] is not None:
                message: Message = await state["stream"]()
                return message
            return await receive()

        return wrapped

    def _rules_for(self, scope: Scope) -> _RouteRules:
        route = scope.get("route")
        if route is None:
            return _RouteRules((), _DEFAULT_BODY)
        rules = self._rules.get(id(route))
        if rules is None:
            requirements: list[Requirement] = []
            bodies: list[BodyLimit] = []
            gates: list[AnonymousGate] = []
            _collect(getattr(route, "dependant", None), requirements, bodies, gates)
            rules = _RouteRules(tuple(dict.fromkeys(requirements)),
                                bodies[0] if bodies else _DEFAULT_BODY, tuple(gates))
            self._rules[id(route)] = rules
        return rules

    def _check_requirements(self, scope: Scope, rules: _RouteRules) -> bool:
        """Check the route's requirements; True when the caller is anonymous (no
        requirement applies: the console's sign-in, an open path)."""
        requirements = rules.requirements
        if not requirements:
            path = scope["path"]
            if path.startswith(EPISODE_PREFIX):
                return False  # the episode key was checked at the first gate
            if _is_console(path) or path in OPEN_PATHS:
                return True  # sign-in is open: its body is read as an anonymous one
            requirements = (_FAIL_CLOSED,)
        headers = request_headers(scope)
        for requirement in requirements:
            requirement.check_request(scope, scope["app"].state, headers)
        return False

    async def _read_body(self, scope: Scope, receive: Receive, rule: BodyLimit, *,
                         anonymous: bool = False) -> bytes | None:
        """The whole body under the route's bound; None if the client went away."""
        limit = rule.bound(self.ctx) if rule.bound is not None else self.settings.max_json_bytes
        if anonymous:
            limit = min(limit, ANONYMOUS_BODY_BYTES)
        declared = _raw_header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit, rule.knob)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._next(receive)
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, rule.knob)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check_json(self, body: bytes) -> None:
        if not body:
            return
        if not _is_utf8(body):
            raise SwarmValidationError(
                400, "request body is not UTF-8 text",
                "send JSON encoded as UTF-8 with Content-Type: application/json")
        if json_too_deep(body, self.settings.max_json_depth):
            raise SwarmValidationError(
                400, f"JSON nested deeper than {self.settings.max_json_depth} levels",
                "flatten the body, or raise AJET_SWARM_MAX_JSON_DEPTH on the server")
        bad = unencodable_field(body)
        if bad is not None:
            parts, why = bad
            field = _path(parts)
            raise SwarmValidationError(422,
                [{"loc": ["body", *parts], "msg": f"field {field}: {why}", "type": "value_error"}],
                "send text as valid Unicode and numbers as finite JSON numbers (null where "
                "there is none)", param=field)

    async def _next(self, receive: Receive) -> Message:
        wait = self.settings.request_body_timeout_s
        try:
            if _HAS_TIMEOUT:  # a deadline on this task: no task per message, as wait_for makes
                async with asyncio.timeout(wait):  # type: ignore[attr-defined,unused-ignore]
                    return await receive()
            return await asyncio.wait_for(receive(), wait)
        except asyncio.TimeoutError as exc:
            raise SwarmHTTPError(408, f"no request body bytes for {wait:g} s; the request was "
                                 "dropped", "send the whole body without pausing",
                                 headers={"Connection": "close"}) from exc

    def _idle_limited(self, receive: Receive) -> Receive:
        """`receive` for a streamed upload: a stalled body reads as a disconnect."""
        done = False

        async def wrapped() -> Message:
            nonlocal done
            if done:  # body complete: waiting for a disconnect has no time limit
                return await receive()
            try:
                message = await self._next(receive)
            except SwarmHTTPError:
                done = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        return wrapped


def _raw_header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), as `Headers.get` finds it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")  # type: ignore[no-any-return]
    return None


def request_headers(scope: Scope) -> Headers:
    """The request's headers, built once per request: the gates and the lane read several
    (each `Headers(scope=...)` copies the header list into the scope again)."""
    headers: Headers | None = scope.get(_HEADERS_SCOPE)
    if headers is None:
        headers = scope[_HEADERS_SCOPE] = Headers(scope=scope)
    return headers


def _collect(dependant: Any, requirements: list[Requirement], bodies: list[BodyLimit],
             gates: list[AnonymousGate]) -> None:
    """The `Requirement`s, `BodyLimit`s and `AnonymousGate`s among a route's dependencies,
    nested ones too."""
    if dependant is None:
        return
    for dep in dependant.dependencies:
        if isinstance(dep.call, Requirement):
            requirements.append(dep.call)
        elif isinstance(dep.call, BodyLimit):
            bodies.append(dep.call)
        elif isinstance(dep.call, AnonymousGate):
            gates.append(dep.call)
        _collect(dep, requirements, bodies, gates)


def _is_console(path: str) -> bool:
    return path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/")


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _too_large(size: int, limit: int, knob: str) -> SwarmHTTPError:
    return PayloadTooLarge(413, f"request body of {size} bytes is over the server's {limit}-byte "
                           "limit for this route", f"send less (page through it), or raise "
                           f"{knob}", headers={"Connection": "close"})
