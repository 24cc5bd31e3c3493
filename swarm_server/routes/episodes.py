"""Routes: the episode plane (`/begin_episode`, `/v1/chat/completions`, `/end_episode`,
`/abort_episode`), proxied to the engine by `EpisodeGateway`.

begin/end/abort need the worker or the control token; chat needs the episode key that
`begin_episode` returned (as the OpenAI API key), and nothing else.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from ajet.protocol import (
    AbortEpisodeRequest,
    BeginEpisodeRequest,
    BeginEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    ErrorBody,
)
from swarm_server.auth import bearer_token
from swarm_server.deps import Ctx, WorkerAuth
from swarm_server.errors import ApiError, PayloadTooLarge
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
    return await ctx.episodes.begin(body or BeginEpisodeRequest(),
                                    public_base_url=str(request.base_url))


@router.post("/end_episode", responses=_ERRORS, dependencies=_EPISODE_BODY)
async def end_episode(ctx: Ctx, _: WorkerAuth, body: EndEpisodeRequest) -> EndEpisodeResponse:
    """Report an episode's reward; the engine trains on its group."""
    return await ctx.episodes.end(body)


@router.post("/abort_episode", responses=_ERRORS, dependencies=_EPISODE_BODY)
async def abort_episode(ctx: Ctx, _: WorkerAuth, body: AbortEpisodeRequest) -> dict[str, Any]:
    """Give an episode up; `requeued` is true when another claim can start right away."""
    return await ctx.episodes.abort(body)


@router.post(
    "/v1/chat/completions", responses=_ERRORS, response_model=None,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"type": "object", "description": "OpenAI chat.completions body",
                   "required": ["messages"],
                   "properties": {"messages": {"type": "array", "items": {"type": "object"}},
                                  "stream": {"type": "boolean"},
                                  "max_tokens": {"type": "integer"}}}}}}},
)
async def chat_completions(
    ctx: Ctx, request: Request,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """OpenAI-compatible chat for one episode; `Authorization: Bearer <episode key>`."""
    try:
        body = await _read_bounded(request, ctx.settings.max_json_bytes)
        return await ctx.episodes.chat(bearer_token(authorization), body,
                                       content_type=request.headers.get("content-type"))
    except ApiError as exc:
        # {"detail", "hint"} like every route, plus OpenAI's {"error": {...}} so that the
        # openai client's exception message says what happened
        message = f"{exc.detail} (hint: {exc.hint})" if exc.hint else str(exc.detail)
        return JSONResponse(
            {"detail": exc.detail, "hint": exc.hint,
             "error": {"message": message, "type": _ERROR_TYPES.get(exc.status, "api_error"),
                       "code": exc.status}},
            status_code=exc.status, headers=exc.headers)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error"}


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
