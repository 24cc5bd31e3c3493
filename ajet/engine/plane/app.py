"""The private channel's routes: what the swarm server calls on the engine's Unix socket.

    GET  /status                -> protocol.EngineReport
    POST /begin_episode         BeginEpisodeRequest -> {"episode_uuid", "timeout_s"};
                                409 unless ROLLING
    POST /end_episode           EndEpisodeRequest -> EndEpisodeResponse; 404 unknown, 409 closed
    POST /abort_episode         AbortEpisodeRequest -> {"episode_uuid", "requeued"}
    /v1/...                     the OpenAI-compatible routes, header X-Episode-UUID: chat
                                completions, completions, models (`openai_api`),
                                responses (`responses_api`) and Anthropic's messages and
                                messages/count_tokens (`messages_api`)

The original AgentJet's statistics and client calls (answered by the server's
`routes/original.py` through the gateway):

    GET  /rollout_pool          the current batch's pool statistics
                                (CurrentBatchRolloutPoolInformation keys)
    GET  /episode_buffer        {"buffer": [EpisodeStatus, ...]} (claimed episodes, no keys)
    POST /can_continue_episode  {client_uuid, episode_uuid} -> {"can_continue": bool}
    POST /agree_sync_weight     {client_uuid} -> {"success", "failure_reason"}

Errors are `{"detail", "hint"}` like the public API, plus `param` (the request field at
fault) where one is named; the swarm server turns them into OpenAI's shape on `/v1/*`
(Anthropic's on `/v1/messages`).
Authentication is not done here: only the swarm server can reach the socket (0600, in the
run directory), and it checks tokens and signed episode keys before forwarding.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ajet.errors import SwarmHTTPError, error_response, validation_error
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.engine.plane.messages_api import messages_router
from ajet.engine.plane.openai_api import openai_router
from ajet.engine.plane.responses_api import responses_router
from ajet.protocol import (
    AbortEpisodeRequest,
    AgreeSyncWeightRequest,
    BeginEpisodeRequest,
    CanContinueEpisodeRequest,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineReport,
    PlanePath,
)

__all__ = ["create_channel_app"]

log = logging.getLogger(__name__)


def create_channel_app(plane: EpisodePlane) -> FastAPI:
    app = FastAPI(title="AgentJet engine (private channel)", docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    registry = plane.registry
    # The handlers are async: registry calls hold its lock for microseconds, so they run
    # on the event loop instead of paying a thread-pool hop per request.

    @app.get("/status")
    async def status() -> EngineReport:
        return plane.report()

    @app.post(PlanePath.BEGIN_EPISODE)
    async def begin_episode(body: BeginEpisodeRequest) -> dict[str, Any]:
        episode = registry.begin(timeout_s=body.discard_episode_timeout, metadata=body.metadata,
                                 episode_type=body.episode_type, client_uuid=body.client_uuid,
                                 task_id=body.task_id)
        return {"episode_uuid": episode.uuid, "timeout_s": episode.timeout_s}

    @app.post(PlanePath.END_EPISODE)
    async def end_episode(body: EndEpisodeRequest) -> EndEpisodeResponse:
        episode = registry.end(body.episode_uuid, task_id=body.task_id, reward=body.reward,
                               is_success=body.is_success, metadata=body.metadata,
                               log_metrics=body.log_metrics, client_uuid=body.client_uuid,
                               declare_client_active=body.declare_client_active)
        return EndEpisodeResponse(episode_uuid=body.episode_uuid, accepted=True,
                                  step=registry.step,
                                  trained=episode.episode_type == "train")

    @app.post(PlanePath.ABORT_EPISODE)
    async def abort_episode(body: AbortEpisodeRequest) -> dict[str, Any]:
        requeued = registry.abort(body.episode_uuid, client_uuid=body.client_uuid)
        cancelled = plane.generations.cancel(body.episode_uuid)  # frees their KV cache
        log.info("episode %s aborted: %s%s", body.episode_uuid, body.reason,
                 f" ({cancelled} generation(s) cancelled)" if cancelled else "")
        return {"episode_uuid": body.episode_uuid, "requeued": requeued}

    @app.get("/rollout_pool")
    async def rollout_pool() -> dict[str, Any]:
        return {**registry.pool_statistics(), "training_model_path": plane.cfg.model}

    @app.get("/episode_buffer")
    async def episode_buffer() -> dict[str, Any]:
        return {"buffer": registry.episode_buffer()}

    @app.post("/can_continue_episode")
    async def can_continue_episode(body: CanContinueEpisodeRequest) -> dict[str, Any]:
        return {"can_continue": registry.can_continue(body.episode_uuid, body.client_uuid)}

    @app.post("/agree_sync_weight")
    async def agree_sync_weight(body: AgreeSyncWeightRequest) -> dict[str, Any]:
        accepted, why_not = registry.agree_sync_weight(body.client_uuid)
        return {"success": accepted, "failure_reason": why_not}

    app.include_router(openai_router(plane))
    app.include_router(responses_router(plane))
    app.include_router(messages_router(plane))
    return app


# ---------------------------------------------------------------------------- errors


def _install_error_handlers(app: FastAPI) -> None:
    # the same rendering as the swarm server's (`ajet.errors.error_response`), which relays
    # these bodies: status, detail, hint, and param where a field is named
    @app.exception_handler(SwarmHTTPError)
    async def _swarm_error(_: Request, exc: SwarmHTTPError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(SwarmHTTPError(exc.status_code, exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(SwarmHTTPError(500, "internal engine error",
                                             "see the engine log (GET /runs/current/logs)"))
