"""Routes: the episode plane (`/begin_episode`, `/v1/chat/completions`, `/end_episode`,
`/abort_episode`), proxied to the engine by `EpisodeGateway`.

`/end_episode` and `/abort_episode` also take the original AgentJet client's body
(`client_uuid`, `workflow_output`, ...); `ajet.original_wire` turns either shape into
the one model the handler uses, and the reply carries `success` next to this project's
keys. The original's own claim route, `/claim_episode`, is in `routes/original.py`.

begin/end/abort need the worker or the control token; chat needs the episode key that
`begin_episode` returned (as the OpenAI API key), and nothing else.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ajet import original_wire
from ajet.protocol import (
    AbortEpisodeRequest,
    BeginEpisodeRequest,
    BeginEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    ErrorBody,
)
from ajet.tuner_lib.experimental.interchange_utils import EndEpisodeRequest as OriginalEnd
from swarm_server.auth import bearer_token
from swarm_server.deps import Ctx, WorkerAuth
from swarm_server.errors import ApiError, PayloadTooLarge, Unprocessable

router = APIRouter(tags=["episodes"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "token or episode key missing, wrong or void"},
    404: {"model": ErrorBody, "description": "unknown episode, or one of an earlier run"},
    409: {"model": ErrorBody,
          "description": "engine not ROLLING (retry; see Retry-After), or episode already ended"},
}


@router.post("/begin_episode", responses=_ERRORS)
async def begin_episode(
    ctx: Ctx, _: WorkerAuth, request: Request,
    body: Annotated[BeginEpisodeRequest | None, Body()] = None,
) -> BeginEpisodeResponse:
    """Claim an episode; returns its id and an OpenAI base URL and API key bound to it."""
    return await ctx.episodes.begin(body or BeginEpisodeRequest(),
                                    public_base_url=str(request.base_url))


@router.post("/end_episode", responses=_ERRORS)
async def end_episode(ctx: Ctx, _: WorkerAuth,
                      body: Annotated[EndEpisodeRequest | OriginalEnd, Body()]
                      ) -> EndEpisodeResponse:
    """Report an episode's reward; the engine trains on its group (not on an eval episode)."""
    return await ctx.episodes.end(_converted(original_wire.end_request, body))


@router.post("/abort_episode", responses=_ERRORS)
async def abort_episode(ctx: Ctx, _: WorkerAuth,
                        body: Annotated[AbortEpisodeRequest | OriginalEnd, Body()]
                        ) -> dict[str, Any]:
    """Give an episode up; `requeued` is true when another claim can start right away."""
    return {**await ctx.episodes.abort(_converted(original_wire.abort_request, body)),
            "success": True}


def _converted(convert: Any, body: Any) -> Any:
    """An original body as this project's request; 422 naming the field it cannot serve."""
    try:
        return convert(body)
    except original_wire.OriginalBodyError as exc:
        raise Unprocessable([{"loc": ["body", *exc.field.split(".")], "msg": str(exc),
                              "type": "value_error"}],
                            f"fix the field {exc.field}") from exc
    except ValidationError as exc:  # a value this project's request model bounds tighter
        errors = [{"loc": ["body", *(str(p) for p in e["loc"])], "msg": e["msg"],
                   "type": e["type"]} for e in exc.errors()]
        raise Unprocessable(errors, "fix the field(s): " + ", ".join(
            ".".join(e["loc"][1:]) for e in errors)) from exc


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
