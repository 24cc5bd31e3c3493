"""Routes: the episode plane (`/begin_episode`, `/end_episode`, `/abort_episode`, and the
OpenAI-compatible `/v1/*`), proxied to the engine by `EpisodeGateway`.

`EPISODE_ROUTES` is the one declaration of each route (`swarm_server.episode_lane`): who
may call it, its body bound, its body type, its handler and its OpenAPI description.
`router` (the documented FastAPI endpoints) and the `EpisodeLane` (which serves the hot
rows without FastAPI's routing) are both built from it; the engine serves each route at
the same path (`ajet.protocol.PlanePath`), where the gateway forwards it.

`/end_episode` and `/abort_episode` also take the original AgentJet client's body
(`client_uuid`, `workflow_output`, ...); `ajet.compat.boundary` turns either shape into
the one model the handler uses, and the reply carries `success` next to this project's
keys. The original's own claim route, `/claim_episode`, is in `routes/original.py`.

begin/end/abort need the worker or the control token. Every `/v1/*` route (chat
completions, completions, responses, models, Anthropic's messages and count_tokens, and a
404 for any other `/v1/` path) needs the episode key that `begin_episode` returned (as the
OpenAI or Anthropic API key: `Authorization: Bearer` or `x-api-key`), and nothing else;
the first gate verifies it once, and the handlers read the episode id it found. Their
errors are OpenAI-shaped (`openai_error_body`), Anthropic-shaped on the Messages routes
(`anthropic_error_body`), and keep `detail` and `hint`.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

# A boundary import: /end_episode and /abort_episode read the original's body too
from ajet.compat import boundary
from ajet.compat.boundary import OriginalEnd
from ajet.protocol import (
    AbortEpisodeRequest,
    BeginEpisodeRequest,
    BeginEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    ErrorBody,
    PlanePath,
)
from ajet.errors import SwarmNotFound, SwarmValidationError, error_response
from swarm_server.auth import EPISODE_SCOPE, EpisodeKeyRequirement, ReaderRequirement
from swarm_server.context import ServerContext
from swarm_server.episode_lane import PlaneRoute, plane_router
from swarm_server.errors import is_anthropic_path
from swarm_server.limits import BodyLimit, request_headers

__all__ = ["EPISODE_ROUTES", "router"]

#: begin/end/abort: the worker or the control token.
WORKER = ReaderRequirement()
#: `/v1/*`: the signed key of a live episode, never a bearer token.
EPISODE_KEY = EpisodeKeyRequirement()
#: begin/end/abort bodies are small; a bound well under max_json_bytes (docs/limits.md).
EPISODE_BODY = BodyLimit.setting("max_episode_body_bytes")
#: chat-shaped bodies: `max_json_bytes` here; the engine bounds them again by the run's
#: own chat bound (`EngineConfig.max_chat_bytes`), once in its process too.
CHAT_BODY = BodyLimit.setting("max_json_bytes")

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "token or episode key missing, wrong or void"},
    404: {"model": ErrorBody, "description": "unknown episode, or one of an earlier run"},
    409: {"model": ErrorBody,
          "description": "engine not ROLLING (retry; see Retry-After), or episode already ended"},
}
_OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    400: {"model": ErrorBody, "description": "a parameter the engine cannot honour (named in "
                                             "error.param), or a prompt over max_prompt_length"},
    413: {"model": ErrorBody, "description": "body over the chat size bound (docs/limits.md)"},
}


# ---------------------------------------------------------------------------- handlers
# (ctx, request, body): the body parsed as the row's model, or the raw bytes without one


async def _begin(ctx: ServerContext, request: Request, body: BeginEpisodeRequest | None
                 ) -> BeginEpisodeResponse:
    return await ctx.episodes.begin(body or BeginEpisodeRequest(),
                                    public_base_url=_base_url(ctx, request))


#: Base URLs `_base_url` keeps at most (the Host header is the caller's)
_MAX_BASE_URLS = 64


def _base_url(ctx: ServerContext, request: Request) -> str:
    """`str(request.base_url)`, kept by what it is made of: Starlette builds a URL object
    per call."""
    scope = request.scope
    server = scope.get("server")  # a tuple from uvicorn, a list from some servers
    key = (scope.get("scheme"), tuple(server) if server else server,
           request_headers(scope).get("host"),
           scope.get("app_root_path", scope.get("root_path", "")))
    urls = ctx.episodes.base_urls
    url = urls.get(key)
    if url is None:
        url = str(request.base_url)
        if len(urls) >= _MAX_BASE_URLS:
            urls.clear()
        urls[key] = url
    return url


async def _end(ctx: ServerContext, _: Request, body: EndEpisodeRequest | OriginalEnd
               ) -> EndEpisodeResponse:
    return await ctx.episodes.end(_converted(boundary.end_request, body))


async def _abort(ctx: ServerContext, _: Request, body: AbortEpisodeRequest | OriginalEnd
                 ) -> dict[str, Any]:
    return {**await ctx.episodes.abort(_converted(boundary.abort_request, body)),
            "success": True}


def _converted(convert: Any, body: Any) -> Any:
    """An original body as this project's request; 422 naming the field it cannot serve."""
    try:
        return convert(body)
    except boundary.OriginalBodyError as exc:
        raise SwarmValidationError(422, [{"loc": ["body", *exc.field.split(".")], "msg": str(exc),
                              "type": "value_error"}],
                                   f"fix the field {exc.field}") from exc
    except ValidationError as exc:  # a value this project's request model bounds tighter
        errors = [{"loc": ["body", *(str(p) for p in e["loc"])], "msg": e["msg"],
                   "type": e["type"]} for e in exc.errors()]
        raise SwarmValidationError(422, errors, "fix the field(s): " + ", ".join(
            ".".join(e["loc"][1:]) for e in errors)) from exc


def _forwarded(path: str) -> Any:
    """A handler forwarding the request to the engine at `path`, the body unread."""
    async def forward(ctx: ServerContext, request: Request, body: bytes | None) -> Response:
        return await ctx.episodes.openai(request.scope[EPISODE_SCOPE], method=request.method,
                                         path=path, body=body)

    forward.__name__ = "_" + path.strip("/").replace("/", "_")
    return forward


async def _retrieve_model(ctx: ServerContext, request: Request, _: None) -> Response:
    path = f"{PlanePath.MODELS}/{quote(request.path_params['model'], safe='/')}"
    return await ctx.episodes.openai(request.scope[EPISODE_SCOPE], method="GET", path=path,
                                     body=None)


_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    **_OPENAI_ERRORS,
    400: {"model": ErrorBody, "description": "a field the engine cannot honour (images, "
                                             "documents, server tools, a prefill: named in "
                                             "param), or a prompt over max_prompt_length"},
}


#: documented on the Messages route: accepted, any value
_ANTHROPIC_VERSION: dict[str, Any] = {"parameters": [
    {"name": "anthropic-version", "in": "header", "required": False,
     "schema": {"type": "string"}}]}


def _openai_body(description: str, required: list[str],
                 properties: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "description": description, "required": required,
                   "properties": properties}}}}}


# ---------------------------------------------------------------------------- the table

#: Every episode-plane route, once. Rows with a fixed path are served by `EpisodeLane`.
EPISODE_ROUTES: tuple[PlaneRoute, ...] = (
    PlaneRoute(
        "POST", PlanePath.BEGIN_EPISODE, _begin, WORKER, EPISODE_BODY,
        model=BeginEpisodeRequest, required=False, response_model=BeginEpisodeResponse,
        name="begin_episode", responses=_ERRORS,
        description="Claim an episode; returns its id and an OpenAI base URL and API key bound "
                "to it."),
    PlaneRoute(
        "POST", PlanePath.END_EPISODE, _end, WORKER, EPISODE_BODY,
        model=EndEpisodeRequest | OriginalEnd, response_model=EndEpisodeResponse,
        name="end_episode", responses=_ERRORS,
        description="Report an episode's reward; the engine trains on its group (not on an eval "
                "episode)."),
    PlaneRoute(
        "POST", PlanePath.ABORT_EPISODE, _abort, WORKER, EPISODE_BODY,
        model=AbortEpisodeRequest | OriginalEnd, response_model=dict[str, Any],
        name="abort_episode", responses=_ERRORS,
        description="Give an episode up; `requeued` is true when another claim can start right "
                "away."),
    PlaneRoute(
        "POST", PlanePath.CHAT_COMPLETIONS, _forwarded(PlanePath.CHAT_COMPLETIONS), EPISODE_KEY,
        CHAT_BODY, name="chat_completions", responses=_OPENAI_ERRORS,
        description="OpenAI-compatible chat for one episode; `Authorization: Bearer <episode "
                "key>`.",
        openapi_extra=_openai_body("OpenAI chat.completions body (docs/api.md)", ["messages"], {
            "messages": {"type": "array", "items": {"type": "object"}},
            "tools": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"}, "max_tokens": {"type": "integer"}})),
    PlaneRoute(
        "POST", PlanePath.COMPLETIONS, _forwarded(PlanePath.COMPLETIONS), EPISODE_KEY,
        CHAT_BODY, name="completions", responses=_OPENAI_ERRORS,
        description="OpenAI-compatible text completion for one episode, recorded like a chat.",
        openapi_extra=_openai_body("OpenAI completions body: one prompt in, text out",
                                   ["prompt"], {
            "prompt": {"type": "string"}, "stream": {"type": "boolean"},
            "max_tokens": {"type": "integer"}, "logprobs": {"type": "integer"}})),
    PlaneRoute(
        "POST", PlanePath.RESPONSES, _forwarded(PlanePath.RESPONSES), EPISODE_KEY, CHAT_BODY,
        name="responses", responses=_OPENAI_ERRORS,
        description="OpenAI Responses API for one episode: stateless, recorded exactly like chat.",
        openapi_extra=_openai_body("OpenAI Responses body, stateless (docs/api.md)", ["input"], {
            "input": {"oneOf": [{"type": "string"},
                                {"type": "array", "items": {"type": "object"}}]},
            "instructions": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"}, "max_output_tokens": {"type": "integer"}})),
    PlaneRoute(
        "POST", PlanePath.MESSAGES, _forwarded(PlanePath.MESSAGES), EPISODE_KEY, CHAT_BODY,
        name="messages", responses=_ANTHROPIC_ERRORS,
        description="Anthropic's Messages API for one episode, recorded exactly like chat; "
                    "the episode key as `x-api-key` or `Bearer`; `?beta=true`, "
                    "`anthropic-version` and `anthropic-beta` accepted; Anthropic-shaped "
                    "errors.",
        openapi_extra=_ANTHROPIC_VERSION | _openai_body(
            "Anthropic Messages body, stateless (docs/api.md)", ["max_tokens", "messages"], {
            "messages": {"type": "array", "items": {"type": "object"}},
            "system": {"oneOf": [{"type": "string"},
                                 {"type": "array", "items": {"type": "object"}}]},
            "tools": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"}, "max_tokens": {"type": "integer"}})),
    PlaneRoute(
        "POST", PlanePath.COUNT_TOKENS, _forwarded(PlanePath.COUNT_TOKENS), EPISODE_KEY,
        CHAT_BODY, name="count_tokens", responses=_ANTHROPIC_ERRORS,
        description="The prompt tokens a Messages body renders to (nothing generated or "
                    "recorded).",
        openapi_extra=_openai_body("Anthropic count_tokens body (a Messages body without "
                                   "max_tokens)", ["messages"], {
            "messages": {"type": "array", "items": {"type": "object"}},
            "tools": {"type": "array", "items": {"type": "object"}}})),
    PlaneRoute(
        "GET", PlanePath.MODELS, _forwarded(PlanePath.MODELS), EPISODE_KEY, CHAT_BODY,
        name="list_models", responses=_ERRORS,
        description="The run's model, as OpenAI's model list; `Authorization: Bearer <episode "
                "key>`."),
    PlaneRoute(
        "GET", PlanePath.MODELS + "/{model:path}", _retrieve_model, EPISODE_KEY, CHAT_BODY,
        name="retrieve_model", responses=_ERRORS,
        description="The run's model by name (404 for another name)."),
)

router = plane_router(EPISODE_ROUTES, tags=["episodes"])


@router.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
async def unknown_openai_route(rest: str, _: Annotated[str, Depends(EPISODE_KEY)]
                               ) -> Response:
    """Any other `/v1/` path: an OpenAI-shaped 404 (Anthropic-shaped under
    `/v1/messages/`), once the episode key is checked."""
    path = f"/v1/{rest}"
    served = ", ".join(row.path for row in EPISODE_ROUTES if row.openai and row.on_lane)
    return error_response(SwarmNotFound(404, f"{path} is not served on the episode plane",
                                        f"the episode plane serves {served}"),
                          openai=True, anthropic=is_anthropic_path(path))
