"""Routes: health, version, engine status, training config, engine start and stop.

Handlers are plain `def`: FastAPI runs them in its thread pool, where the controller may
block (a stop waits for the process group, a config check runs a subprocess).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

import ajet
from ajet.protocol import (
    ConfigAccepted,
    EngineStatus,
    ErrorBody,
    HealthResponse,
    StartEngineRequest,
    StartEngineResponse,
    StopEngineRequest,
    StopEngineResponse,
    SyncConfigRequest,
    VersionResponse,
)
from ajet.errors import SwarmNotFound
from swarm_server.deps import ControlAuth, Ctx, ReaderAuth

__all__ = ["router"]

router = APIRouter(tags=["control"])

_READER_ERRORS: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong token"},
}
_AUTH_ERRORS: dict[int | str, dict[str, object]] = {
    **_READER_ERRORS,
    403: {"model": ErrorBody, "description": "The worker token cannot call this route"},
}
_STATE_ERROR: dict[int | str, dict[str, object]] = {
    409: {"model": ErrorBody, "description": "The engine is in the wrong state; see `hint`"},
}


@router.get("/health", summary="Liveness; needs no token")
def health() -> HealthResponse:
    return HealthResponse()


@router.get("/version", responses=_READER_ERRORS)
def version(request: Request, _: ReaderAuth) -> VersionResponse:
    """Server version, API version, the server's own installed ajet path, and whether
    approvals are enforced (approver tokens configured)."""
    return VersionResponse(version=request.app.version, ajet_file=ajet.__file__ or "",
                           approvals_enforced=request.app.state.ctx.settings.approvals_enforced)


@router.get("/get_engine_status", responses=_READER_ERRORS)
def get_engine_status(ctx: Ctx, _: ReaderAuth) -> EngineStatus:
    """Engine state (`ENGINE.*`), current run, active snapshot, and `last_error`."""
    return ctx.engine.status()


_INVALID_JOB: dict[int | str, dict[str, object]] = {
    422: {"model": ErrorBody, "description": "Invalid job; `detail` names the fields"},
}


@router.post("/sync_train_config", responses={**_AUTH_ERRORS, **_STATE_ERROR, **_INVALID_JOB})
def sync_train_config(body: SyncConfigRequest, ctx: Ctx, role: ControlAuth) -> ConfigAccepted:
    """Store an `AgentJetJob` YAML, validated by the active code. Only while OFFLINE.

    With `check_only`, validate and store nothing, in any state."""
    return ctx.engine.set_config(body.yaml, role=role, check_only=body.check_only)


@router.get("/sync_train_config", responses={**_READER_ERRORS, 404: {"model": ErrorBody}})
def get_train_config(ctx: Ctx, _: ReaderAuth) -> ConfigAccepted:
    """The stored job config: what the next `start_engine` runs with."""
    current = ctx.engine.current_config()
    if current is None:
        raise SwarmNotFound(404, "no training config was sent to this server yet",
                            "call sync_train_config with an AgentJetJob YAML")
    return current


@router.post("/start_engine", responses={**_AUTH_ERRORS, **_STATE_ERROR})
def start_engine(ctx: Ctx, role: ControlAuth, body: StartEngineRequest | None = None
                 ) -> StartEngineResponse:
    """Start the engine on the last config (a new run). Returns at once in BOOTING.

    Poll `GET /get_engine_status` until a serving state; a failed boot falls back to
    OFFLINE with `last_error`.
    """
    ctx.engine.start(role=role, force_restart=body.force_restart if body else False)
    return StartEngineResponse.model_validate(ctx.engine.status().model_dump())


@router.post("/stop_engine", responses=_AUTH_ERRORS)
def stop_engine(ctx: Ctx, role: ControlAuth, body: StopEngineRequest | None = None
                ) -> StopEngineResponse:
    """Stop the engine's process group (TERM, grace, KILL). Idempotent."""
    return ctx.engine.stop(role=role, reason=body.reason if body else "stopped by request")
