"""The episode plane's route table (`PlaneRoute`), and `EpisodeLane`, which serves its hot
rows without FastAPI's routing and dependency solving.

Each episode-plane route is declared once, as one `PlaneRoute` row (`routes/episodes.py`
holds the table): method, path, who may call it (`requirement`), its body bound
(`body_limit`), its body type, its handler and its OpenAPI description. Two things are
built from the same rows:

- `plane_router(rows)`: the documented FastAPI endpoints (`/docs`, `/openapi.json`), one
  per row, each declaring the row's requirement and body bound as dependencies and
  calling the row's handler;
- `EpisodeLane(rows=..., router=..., gate=...)`: serves the rows with no path parameter
  straight from a `(method, path)` dict.

Every rollout worker calls begin, chat and end once per episode, and many laptops send
rollouts to one server, so the server's CPU per call bounds the cluster. FastAPI's share
of one such call was about 0.6 ms on a shared 2-core machine: its router matched the
path against every route of the app in turn (some 90), then solved the route's
dependencies, parsed and validated the body, and validated and serialised the answer;
the middleware stack around it (FastAPI's telemetry check, Starlette's error, telemetry
and body-limit layers) cost a tenth of the call again. The lane does the same work
directly:

- it puts the row's `APIRoute` (from `plane_router`) in `scope["route"]` as FastAPI's
  router would, so `swarm_server.limits` checks the row's requirement and body bound
  when the body is first read, exactly as for every other route: that gate is the one
  place a body is bounded in this process, and the handler gets the bytes it buffered;
- it parses the body as FastAPI does (JSON only under a JSON content type, the row's
  pydantic type, the same 422 body), calls the row's handler and renders the result, an
  error or a refusal of the gate as the app's error handlers do (`ajet.errors.error_response`,
  OpenAI-shaped under `/v1/`, Anthropic-shaped on the Messages routes).

Everything else (other methods or paths, a `root_path` deployment) goes on to FastAPI,
which serves the same rows through the endpoints `plane_router` made. The lane sits in
front of the whole app (`main.SwarmApp.put_lane_in_front`) with `gate`, the limits gate:
it passes each of its requests through that gate's first gate (header size, a
credential, the episode key of `/v1/*`) and its second (the body), and answers an
unexpected error with the app's 500 handler as Starlette's outermost layer would.

To add a route: one more row in the table, and the engine's route at the same path
(`ajet.protocol.PlanePath`).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Body, Depends
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import to_json
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from swarm_server.auth import Requirement
from ajet.errors import SwarmHTTPError, error_response
from swarm_server.errors import EarlyRefusal, is_anthropic_path, validation_error_response
from swarm_server.limits import EPISODE_PREFIX, BodyLimit, LimitsMiddleware, request_headers

if TYPE_CHECKING:
    from swarm_server.context import ServerContext

__all__ = ["EpisodeLane", "Handler", "PlaneRoute", "plane_router"]

#: A row's handler: the context, the request, and the body: the row's `model` parsed and
#: validated (None when it is optional and absent), or, without a `model`, the raw bytes
#: the limits gate buffered (None for a route without a body, such as a GET).
Handler = Callable[["ServerContext", Request, Any], Awaitable[Any]]
_MISSING = object()
_PATH_PARAM = re.compile(r"{(\w+)(?::\w+)?}")


@dataclass(frozen=True)
class PlaneRoute:
    """One episode-plane route: everything about it, in one place."""

    method: str
    path: str
    handler: Handler
    #: who may call it (`auth.Requirement`): the worker token, or the episode key
    requirement: Requirement
    #: its body bound (`limits.BodyLimit`), enforced once, by the limits gate
    body_limit: BodyLimit
    #: the body's pydantic type; None: the handler gets the raw bytes (forwarded unread)
    model: Any = None
    #: with `model`: an empty body is a 422 (else the handler gets None)
    required: bool = True
    #: OpenAPI: the answer's type, what the route does (the endpoint's docstring), the
    #: error statuses, and anything more (a raw body's schema)
    response_model: Any = None
    description: str = ""
    responses: dict[int | str, dict[str, Any]] = field(default_factory=dict)
    openapi_extra: dict[str, Any] | None = None
    #: the endpoint's own name in the schema (its operation id)
    name: str = ""

    @property
    def openai(self) -> bool:
        """Errors in OpenAI's shape as well (the `/v1/*` routes)."""
        return self.path.startswith(EPISODE_PREFIX)

    @property
    def anthropic(self) -> bool:
        """Errors in Anthropic's shape instead (the Messages routes)."""
        return is_anthropic_path(self.path)

    @property
    def on_lane(self) -> bool:
        """Served by `EpisodeLane`: a fixed path (a path parameter needs FastAPI's router)."""
        return "{" not in self.path


async def serve_row(row: PlaneRoute, ctx: ServerContext, request: Request, body: Any) -> Any:
    """Call the row's handler; on `/v1/*`, an error becomes its OpenAI-shaped response
    (Anthropic-shaped on the Messages routes)."""
    if not row.openai:
        return await row.handler(ctx, request, body)
    try:
        return await row.handler(ctx, request, body)
    except SwarmHTTPError as exc:
        return error_response(exc, openai=True, anthropic=row.anthropic)


def plane_router(rows: Sequence[PlaneRoute], **router_options: Any) -> APIRouter:
    """The documented FastAPI endpoints of `rows`, one per row."""
    router = APIRouter(**router_options)
    for row in rows:
        router.add_api_route(
            row.path, _endpoint(row), methods=[row.method], name=row.name or None,
            response_model=row.response_model, description=row.description or None,
            responses=row.responses, openapi_extra=row.openapi_extra,
            dependencies=[Depends(row.requirement), Depends(row.body_limit)])
    return router


def _endpoint(row: PlaneRoute) -> Callable[..., Awaitable[Any]]:
    """A FastAPI endpoint for the row: its signature tells FastAPI the body type."""
    reads_raw = row.model is None and row.method not in ("GET", "HEAD")

    async def endpoint(request: Request, body: Any = None, **_: Any) -> Any:
        # path parameters arrive as keywords too; handlers read `request.path_params`
        if reads_raw:
            body = await request.body()  # what the limits gate buffered and bounded
        return await serve_row(row, request.app.state.ctx, request, body)

    params = [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=Request)]
    if row.model is not None:
        kind = row.model if row.required else row.model | None
        params.append(inspect.Parameter(
            "body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[kind, Body()],
            default=inspect.Parameter.empty if row.required else None))
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=str)
               for name in _PATH_PARAM.findall(row.path)]
    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__name__ = row.name or row.handler.__name__.strip("_")
    endpoint.__doc__ = row.description
    return endpoint


@dataclass(frozen=True)
class _Lane:
    """A row as the lane serves it: its FastAPI route (for the limits gate), its body's
    validator, and the shape of its errors (the row's properties, computed once)."""

    row: PlaneRoute
    api_route: APIRoute
    model: TypeAdapter[Any] | None
    openai: bool
    anthropic: bool


class EpisodeLane:
    """The lane in front of the app (`main.SwarmApp`); see the module docstring.

    It passes each of its requests through `gate` itself, and answers an unexpected error
    as the stack's outermost error handler does (the app's 500 handler, then the error
    raised on to the server).
    """

    def __init__(self, *, rows: Sequence[PlaneRoute], router: APIRouter,
                 gate: LimitsMiddleware) -> None:
        self.gate = gate
        declared = {(route.path, method): route for route in router.routes
                    if isinstance(route, APIRoute) for method in route.methods}
        self._table: dict[tuple[str, str], _Lane] = {}
        for row in rows:
            if not row.on_lane:
                continue
            api_route = declared.get((row.path, row.method))
            if api_route is None:
                raise RuntimeError(f"{row.method} {row.path} is not on the router: build the "
                                   "router from the same rows (plane_router)")
            model = TypeAdapter(row.model if row.required else row.model | None) \
                if row.model is not None else None
            self._table[(row.method, row.path)] = _Lane(row, api_route, model, row.openai,
                                                        row.anthropic)

    @property
    def paths(self) -> frozenset[str]:
        """The paths the lane serves (for any method)."""
        return frozenset(path for _, path in self._table)

    def lookup(self, scope: Scope) -> _Lane | None:
        """The lane's row for this request, or None: the app serves it."""
        if scope["type"] == "http" and not scope.get("root_path"):
            return self._table.get((scope["method"], scope["path"]))
        return None

    async def serve(self, hit: _Lane, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a request `lookup` found a row for."""
        gate = self.gate
        try:
            refusal = gate.first_gate(scope)
            if refusal is None:
                response = await _respond(hit, gate.ctx, scope, gate.gated(scope, receive))
        except Exception as exc:
            await _server_error(scope, receive, send, exc)
            raise
        # a failure while answering is raised on as it is: part of an answer may be out
        if refusal is not None:
            await refusal.send(scope, receive, send)
        else:
            await response(scope, receive, send)


async def _respond(lane: _Lane, ctx: ServerContext, scope: Scope, receive: Receive) -> Response:
    """The answer to a request for the lane's row (an error rendered, never raised)."""
    api_route = lane.api_route
    # what FastAPI's router sets for a matched route (the limits gate reads "route")
    scope["route"], scope["endpoint"], scope["path_params"] = api_route, api_route.endpoint, {}
    request = Request(scope, receive)
    try:
        # read first, whatever the handler does: the first `receive` is where the limits
        # gate checks the row's requirement and body bound (handlers get the body as an
        # argument, never from `request`)
        raw = await _body(receive)
        model = lane.model
        body = _parsed_body(model, lane.row.required, scope, raw) if model is not None else raw
        # `serve_row`, with the shapes of the row's errors computed once
        return _as_response(await lane.row.handler(ctx, request, body))
    except _Invalid as exc:
        return validation_error_response(exc.errors)
    except EarlyRefusal as exc:  # the limits gate refused the body
        return error_response(exc.error, openai=exc.openai, anthropic=exc.anthropic)
    except SwarmHTTPError as exc:
        return error_response(exc, openai=lane.openai, anthropic=lane.anthropic)


async def _server_error(scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
    """The 500 of the app's handler for unexpected errors, as Starlette's
    `ServerErrorMiddleware` renders it (the caller raises the error on)."""
    handlers = scope["app"].exception_handlers
    handler = handlers.get(Exception) or handlers.get(500)
    if handler is None:
        response: Any = PlainTextResponse("Internal Server Error", status_code=500)
    else:
        response = handler(Request(scope), exc)
        if inspect.isawaitable(response):
            response = await response
    await response(scope, receive, send)


async def _body(receive: Receive) -> bytes:
    """The whole body (the limits gate hands it over as one message)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Invalid(Exception):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("request validation failed")
        self.errors = errors


def _parsed_body(model: TypeAdapter[Any], required: bool, scope: Scope, raw: bytes) -> Any:
    """The body as FastAPI parses a single body parameter (strict content type)."""
    value: Any = _MISSING
    if raw:
        if _is_json(request_headers(scope).get("content-type")):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _Invalid([{"type": "json_invalid", "loc": ("body", exc.pos),
                                 "msg": "JSON decode error"}]) from exc
        else:
            value = raw  # not JSON: the type's own validation refuses it
    if value is _MISSING:
        if required:
            raise _Invalid([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
        return None
    try:
        return model.validate_python(value)
    except ValidationError as exc:
        raise _Invalid([{**e, "loc": ("body", *e["loc"])}
                        for e in exc.errors(include_url=False)]) from exc


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def _as_response(result: Any) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return Response(to_json(result), media_type="application/json")
    return JSONResponse(result)
