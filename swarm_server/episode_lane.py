"""`EpisodeLane`: the episode plane's hot routes, served without FastAPI's routing and
dependency solving.

Every rollout worker calls begin, chat and end once per episode, and many laptops send
rollouts to one server, so the server's CPU per call bounds the cluster. The
profile put FastAPI's share of one such call at about 0.6 ms on the shared 2-core
machine: the router matched the path against every route of the app in turn (some 90),
then FastAPI solved the route's dependencies, parsed and validated the body, and
validated and serialised the answer. The lane does the same work for the routes
`routes/episodes.py` lists in `LANE_ROUTES`, directly:

- it finds the route by `(method, path)` in a dict, and puts the route's declared
  `APIRoute` in `scope["route"]` as FastAPI's router would; so `swarm_server.limits`
  checks the route's own `Requirement` and `BodyLimit` when the body is first read,
  exactly as for every other route (the declaration in `routes/episodes.py` stays the one
  source of who may call it and how large its body may be);
- it reads the body through that gate and parses it as FastAPI does (JSON only under a
  JSON content type, the route's pydantic type, the same 422 body), calls the route's
  handler function, and renders the result, an `ApiError` or a refusal of the gate as
  the app's error handlers do (`errors.error_response`, OpenAI-shaped under `/v1/`,
  Anthropic-shaped on the Messages routes).

Everything else (other methods or paths, a `root_path` deployment) goes on to FastAPI,
which serves these same routes through the same handler functions. The lane sits
directly inside `LimitsMiddleware`, so the first gate (a credential before routing) has
run for every request it sees.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import to_json
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from swarm_server.errors import (
    ApiError,
    EarlyRefusal,
    error_response,
    validation_error_response,
)

if TYPE_CHECKING:
    from swarm_server.context import ServerContext

__all__ = ["EpisodeLane", "LaneRoute"]

#: A lane handler: the context, the request, and the parsed body (None without one).
Handler = Callable[["ServerContext", Request, Any], Awaitable[Any]]
_MISSING = object()


@dataclass(frozen=True)
class LaneRoute:
    """One route the lane serves.

    `endpoint` is the FastAPI endpoint function the route is declared with (the lane
    finds the declared `APIRoute` by it); `handler` does the route's work and is what that
    endpoint calls too. With `body` the lane parses and validates the body as this type
    (`required`: an empty body is a 422) and passes it; without, `handler` reads the
    body itself. `openai`: errors in OpenAI's shape as well.
    """

    method: str
    path: str
    endpoint: Callable[..., Any]
    handler: Handler
    body: TypeAdapter[Any] | None = None
    required: bool = True
    openai: bool = False
    anthropic: bool = False


class EpisodeLane:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, *, routes: Sequence[LaneRoute], router: APIRouter) -> None:
        self.app = app
        declared = {(route.endpoint, route.path): route for route in router.routes
                    if isinstance(route, APIRoute)}
        self._table: dict[tuple[str, str], tuple[LaneRoute, APIRoute]] = {}
        for lane in routes:
            api_route = declared.get((lane.endpoint, lane.path))
            if api_route is None or lane.method not in api_route.methods:
                raise RuntimeError(f"{lane.method} {lane.path} is not declared by "
                                   f"{lane.endpoint.__name__} on the router")
            self._table[(lane.method, lane.path)] = (lane, api_route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            hit = self._table.get((scope["method"], scope["path"]))
            if hit is not None:
                await self._serve(*hit, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, lane: LaneRoute, api_route: APIRoute, scope: Scope,
                     receive: Receive, send: Send) -> None:
        # what FastAPI's router sets for a matched route (the limits gate reads "route")
        scope["route"], scope["endpoint"], scope["path_params"] = api_route, lane.endpoint, {}
        request = Request(scope, receive)
        try:
            # read first, whatever the handler does: the first `receive` is where the
            # limits gate checks the route's requirement and body bound (a chat handler
            # reads it again from Starlette's cache)
            raw = await request.body()
            body = _parsed_body(lane, request, raw) if lane.body is not None else None
            response = _as_response(await lane.handler(scope["app"].state.ctx, request, body))
        except _Invalid as exc:
            response = validation_error_response(exc.errors)
        except EarlyRefusal as exc:  # the limits gate refused the body
            response = error_response(exc.error, openai=exc.openai, anthropic=exc.anthropic)
        except ApiError as exc:
            response = error_response(exc, openai=lane.openai, anthropic=lane.anthropic)
        await response(scope, receive, send)


class _Invalid(Exception):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("request validation failed")
        self.errors = errors


def _parsed_body(lane: LaneRoute, request: Request, raw: bytes) -> Any:
    """The body as FastAPI parses a single body parameter (strict content type)."""
    assert lane.body is not None
    value: Any = _MISSING
    if raw:
        if _is_json(request.headers.get("content-type")):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _Invalid([{"type": "json_invalid", "loc": ("body", exc.pos),
                                 "msg": "JSON decode error"}]) from exc
        else:
            value = raw  # not JSON: the type's own validation refuses it
    if value is _MISSING:
        if lane.required:
            raise _Invalid([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
        return None
    try:
        return lane.body.validate_python(value)
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
