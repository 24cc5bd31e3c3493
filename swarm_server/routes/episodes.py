"""Routes: the episode plane (`/begin_episode`, `/end_episode`, `/abort_episode`, and the
OpenAI-compatible `/v1/*`), proxied to the engine by `EpisodeGateway`.

`/end_episode` and `/abort_episode` also take the original AgentJet client's body
(`client_uuid`, `workflow_output`, ...); `ajet.compat.boundary` turns either shape into
the one model the handler uses, and the reply carries `success` next to this project's
keys. The original's own claim route, `/claim_episode`, is in `routes/original.py`.

begin/end/abort need the worker or the control token. Every `/v1/*` route (chat
completions, completions, responses, models, Anthropic's messages and count_tokens, and a
404 for any other `/v1/` path) needs the episode key that `begin_episode` returned (as the
OpenAI or Anthropic API key: `Authorization: Bearer` or `x-api-key`), and nothing else;
its errors are OpenAI-shaped (`openai_error_body`), Anthropic-shaped on the Messages
routes (`anthropic_error_body`), and keep `detail` and `hint`.

The hot routes (`LANE_ROUTES`) are served by `swarm_server.episode_lane` without
FastAPI's routing; their declarations here stay the source of their requirement and
body bound, and their endpoints call the same handlers (`_begin`, `_end`, ...).
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Body, Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

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
)
from swarm_server.auth import episode_key
from swarm_server.context import ServerContext
from swarm_server.deps import Ctx, WorkerAuth
from swarm_server.episode_lane import LaneRoute
from swarm_server.errors import (
    ApiError,
    NotFound,
    PayloadTooLarge,
    Unprocessable,
    error_response,
    is_anthropic_path,
)
from swarm_server.limits import BodyLimit

router = APIRouter(tags=["episodes"])

#: begin/end/abort bodies are small; a bound well under max_json_bytes (docs/limits.md).
_EPISODE_BODY = [Depends(BodyLimit.setting("max_episode_body_bytes"))]

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "token or episode key missing, wrong or void"},
    404: {"model": ErrorBody, "description": "unknown episode, or one of an earlier run"},
    409: {"model": ErrorBody,
          "description": "engine not ROLLING (retry; see Retry-After), or episode already ended"},
}


@router.post("/begin_episode", responses=_ERRORS, dependencies=_EPISODE_BODY)
async def begin_episode(
    ctx: Ctx, _: WorkerAuth, request: Request,
    body: Annotated[BeginEpisodeRequest | None, Body()] = None,
) -> BeginEpisodeResponse:
    """Claim an episode; returns its id and an OpenAI base URL and API key bound to it."""
    return await _begin(ctx, request, body)


@router.post("/end_episode", responses=_ERRORS, dependencies=_EPISODE_BODY)
async def end_episode(ctx: Ctx, _: WorkerAuth,
                      body: Annotated[EndEpisodeRequest | OriginalEnd, Body()]
                      ) -> EndEpisodeResponse:
    """Report an episode's reward; the engine trains on its group (not on an eval episode)."""
    return await _end(ctx, None, body)


@router.post("/abort_episode", responses=_ERRORS, dependencies=_EPISODE_BODY)
async def abort_episode(ctx: Ctx, _: WorkerAuth,
                        body: Annotated[AbortEpisodeRequest | OriginalEnd, Body()]
                        ) -> dict[str, Any]:
    """Give an episode up; `requeued` is true when another claim can start right away."""
    return await _abort(ctx, None, body)


# The work of the routes above (and of the chat routes below), shared by their FastAPI
# endpoints and `EpisodeLane` (`LANE_ROUTES`): (ctx, request, parsed body).

async def _begin(ctx: ServerContext, request: Request, body: BeginEpisodeRequest | None
                 ) -> BeginEpisodeResponse:
    return await ctx.episodes.begin(body or BeginEpisodeRequest(),
                                    public_base_url=str(request.base_url))


async def _end(ctx: ServerContext, _: Request | None, body: EndEpisodeRequest | OriginalEnd
               ) -> EndEpisodeResponse:
    return await ctx.episodes.end(_converted(boundary.end_request, body))


async def _abort(ctx: ServerContext, _: Request | None,
                 body: AbortEpisodeRequest | OriginalEnd) -> dict[str, Any]:
    return {**await ctx.episodes.abort(_converted(boundary.abort_request, body)),
            "success": True}


def _converted(convert: Any, body: Any) -> Any:
    """An original body as this project's request; 422 naming the field it cannot serve."""
    try:
        return convert(body)
    except boundary.OriginalBodyError as exc:
        raise Unprocessable([{"loc": ["body", *exc.field.split(".")], "msg": str(exc),
                              "type": "value_error"}],
                            f"fix the field {exc.field}") from exc
    except ValidationError as exc:  # a value this project's request model bounds tighter
        errors = [{"loc": ["body", *(str(p) for p in e["loc"])], "msg": e["msg"],
                   "type": e["type"]} for e in exc.errors()]
        raise Unprocessable(errors, "fix the field(s): " + ", ".join(
            ".".join(e["loc"][1:]) for e in errors)) from exc


_OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    400: {"model": ErrorBody, "description": "a parameter the engine cannot honour (named in "
                                             "error.param), or a prompt over max_prompt_length"},
    413: {"model": ErrorBody, "description": "body over the chat size bound (docs/limits.md)"},
}


def _openai_body(description: str, required: list[str],
                 properties: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "description": description, "required": required,
                   "properties": properties}}}}}


@router.post(
    "/v1/chat/completions", responses=_OPENAI_ERRORS, response_model=None,
    openapi_extra=_openai_body("OpenAI chat.completions body (docs/api.md)", ["messages"], {
        "messages": {"type": "array", "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "stream": {"type": "boolean"}, "max_tokens": {"type": "integer"}}),
)
async def chat_completions(
    ctx: Ctx, request: Request, authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """OpenAI-compatible chat for one episode; `Authorization: Bearer <episode key>`."""
    return await _forward(ctx, request, "/v1/chat/completions")


@router.post(
    "/v1/completions", responses=_OPENAI_ERRORS, response_model=None,
    openapi_extra=_openai_body("OpenAI completions body: one prompt in, text out", ["prompt"], {
        "prompt": {"type": "string"}, "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer"}, "logprobs": {"type": "integer"}}),
)
async def completions(
    ctx: Ctx, request: Request, authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """OpenAI-compatible text completion for one episode, recorded like a chat."""
    return await _forward(ctx, request, "/v1/completions")


@router.post(
    "/v1/responses", responses=_OPENAI_ERRORS, response_model=None,
    openapi_extra=_openai_body("OpenAI Responses body, stateless (docs/api.md)", ["input"], {
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string"}, "tools": {"type": "array",
                                                      "items": {"type": "object"}},
        "stream": {"type": "boolean"}, "max_output_tokens": {"type": "integer"}}),
)
async def responses(
    ctx: Ctx, request: Request, authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """OpenAI Responses API for one episode: stateless, recorded exactly like chat."""
    return await _forward(ctx, request, "/v1/responses")


_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    **_OPENAI_ERRORS,
    400: {"model": ErrorBody, "description": "a field the engine cannot honour (images, "
                                             "documents, server tools, a prefill: named in "
                                             "param), or a prompt over max_prompt_length"},
}


@router.post(
    "/v1/messages", responses=_ANTHROPIC_ERRORS, response_model=None,
    openapi_extra=_openai_body("Anthropic Messages body, stateless (docs/api.md)",
                               ["max_tokens", "messages"], {
        "messages": {"type": "array", "items": {"type": "object"}},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "tools": {"type": "array", "items": {"type": "object"}},
        "stream": {"type": "boolean"}, "max_tokens": {"type": "integer"}}),
)
async def messages(
    ctx: Ctx, request: Request, x_api_key: Annotated[str | None, Header()] = None,
    anthropic_version: Annotated[str | None, Header()] = None,
) -> Response:
    """Anthropic's Messages API for one episode, recorded exactly like chat; the episode
    key as `x-api-key` or `Bearer`; `?beta=true`, `anthropic-version` and `anthropic-beta`
    accepted; Anthropic-shaped errors."""
    return await _forward(ctx, request, "/v1/messages")


@router.post(
    "/v1/messages/count_tokens", responses=_ANTHROPIC_ERRORS, response_model=None,
    openapi_extra=_openai_body("Anthropic count_tokens body (a Messages body without "
                               "max_tokens)", ["messages"], {
        "messages": {"type": "array", "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}}}),
)
async def count_tokens(
    ctx: Ctx, request: Request, x_api_key: Annotated[str | None, Header()] = None,
) -> Response:
    """The prompt tokens a Messages body renders to (nothing generated or recorded)."""
    return await _forward(ctx, request, "/v1/messages/count_tokens")


@router.get("/v1/models", responses=_ERRORS, response_model=None)
async def list_models(
    ctx: Ctx, request: Request, authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """The run's model, as OpenAI's model list; `Authorization: Bearer <episode key>`."""
    return await _forward(ctx, request, "/v1/models", with_body=False)


@router.get("/v1/models/{model:path}", responses=_ERRORS, response_model=None)
async def retrieve_model(
    ctx: Ctx, request: Request, model: str,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """The run's model by name (404 for another name)."""
    return await _forward(ctx, request, f"/v1/models/{quote(model, safe='/')}",
                          with_body=False)


@router.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
async def unknown_openai_route(ctx: Ctx, request: Request, rest: str) -> Response:
    """Any other `/v1/` path: an OpenAI-shaped 404 (Anthropic-shaped under
    `/v1/messages/`), once the episode key is checked."""
    path = f"/v1/{rest}"
    try:
        ctx.episodes.authorize(episode_key(request.headers))
    except ApiError as exc:
        return _wire_error(exc, path)
    return _wire_error(NotFound(f"{path} is not served on the episode plane",
                                "the episode plane serves /v1/chat/completions, "
                                "/v1/completions, /v1/responses, /v1/messages, "
                                "/v1/messages/count_tokens and /v1/models"), path)


async def _forward(ctx: Ctx, request: Request, path: str, *, with_body: bool = True
                   ) -> Response:
    try:
        body = await _read_bounded(request, ctx.settings.max_json_bytes) if with_body else None
        return await ctx.episodes.openai(episode_key(request.headers), method=request.method,
                                         path=path, body=body)
    except ApiError as exc:
        return _wire_error(exc, path)


def _wire_error(exc: ApiError, path: str) -> JSONResponse:
    # {"detail", "hint"} like every route, plus OpenAI's {"error": {...}} (Anthropic's on
    # the Messages routes) so that the client's exception message says what happened and
    # what to do
    return error_response(exc, openai=True, anthropic=is_anthropic_path(path))


async def _read_bounded(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"chat body is over {limit} bytes", "send a shorter conversation")
        chunks.append(chunk)
    return b"".join(chunks)


def _forwarded(path: str) -> Any:
    async def handler(ctx: ServerContext, request: Request, _: None) -> Response:
        return await _forward(ctx, request, path)

    return handler


#: The hot routes `EpisodeLane` serves without FastAPI's routing and dependency solving,
#: for the server's CPU per call; the declarations above stay the source of their auth and body bounds.
LANE_ROUTES = (
    LaneRoute("POST", "/begin_episode", begin_episode, _begin,
              body=TypeAdapter(BeginEpisodeRequest | None), required=False),
    LaneRoute("POST", "/end_episode", end_episode, _end,
              body=TypeAdapter(EndEpisodeRequest | OriginalEnd)),
    LaneRoute("POST", "/abort_episode", abort_episode, _abort,
              body=TypeAdapter(AbortEpisodeRequest | OriginalEnd)),
    LaneRoute("POST", "/v1/chat/completions", chat_completions,
              _forwarded("/v1/chat/completions"), openai=True),
    LaneRoute("POST", "/v1/completions", completions, _forwarded("/v1/completions"),
              openai=True),
    LaneRoute("POST", "/v1/responses", responses, _forwarded("/v1/responses"), openai=True),
    LaneRoute("POST", "/v1/messages", messages, _forwarded("/v1/messages"), openai=True,
              anthropic=True),
    LaneRoute("POST", "/v1/messages/count_tokens", count_tokens,
              _forwarded("/v1/messages/count_tokens"), openai=True, anthropic=True),
)
