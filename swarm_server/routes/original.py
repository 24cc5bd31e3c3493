"""Routes only the original AgentJet server has, with its bodies and reply keys.

    POST /claim_episode                                claim (the original's begin_episode)
    GET  /get_current_batch_rollout_pool_information   rollout-pool statistics
    POST /get_episode_buffer                           the claimed episodes
    POST /can_continue_episode                         {client_uuid, episode_uuid}
    GET  /get_server_experiment_dir                    where the current run writes
    POST /agree_sync_weight                            {client_uuid}

The engine answers the statistics over its socket (`EpisodeGateway.engine_call`); while
no engine serves, each route answers what the original does then (defaults, an empty
buffer, `can_continue: false`, `success: false`) rather than an error. The worker or
control token is required, like the rest of the episode plane; the original client
sends none, so it works against a server without tokens (docs/compat.md).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request

from ajet.compat.boundary import claim_fail_cause
from ajet.compat.wire import (
    AgreeSyncWeightRequest,
    BoolResponse,
    CanContinueEpisodeRequest,
    CanContinueEpisodeResponse,
    ClaimEpisodeRequest,
    ClaimEpisodeResponse,
    CurrentBatchRolloutPoolInformation,
    EpisodeBufferResponse,
)
from ajet.protocol import BeginEpisodeRequest, EngineState, ErrorBody
from ajet.errors import SwarmHTTPError, SwarmValidationError
from swarm_server.deps import Ctx, WorkerAuth

__all__ = ["router"]

router = APIRouter(tags=["original AgentJet"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong token"},
    422: {"model": ErrorBody, "description": "Malformed body; `detail` names the field"},
}


@router.post("/claim_episode", responses=_ERRORS)
async def claim_episode(ctx: Ctx, _: WorkerAuth, request: Request, body: ClaimEpisodeRequest
                        ) -> ClaimEpisodeResponse:
    """Claim an episode for `client_uuid`. A claim the engine cannot serve now is
    `success: false` with the original's `fail_cause` (its client backs off on it)."""
    if body.episode_type not in ("train", "eval"):
        raise SwarmValidationError(422, [{"loc": ["body", "episode_type"], "type": "value_error",
                              "msg": f"Unknown episode_type: {body.episode_type}"}],
                                   "send episode_type 'train' or 'eval'")
    policy = body.throttle_policy
    claim = BeginEpisodeRequest(
        discard_episode_timeout=body.discard_episode_timeout,
        episode_type=body.episode_type,  # type: ignore[arg-type]
        client_uuid=body.client_uuid, task_id=policy.current_task_id if policy else None)
    try:
        episode = await ctx.episodes.begin(claim, public_base_url=str(request.base_url))
    except SwarmHTTPError as exc:
        if exc.status != 409:
            raise
        state = ctx.engine.state
        return ClaimEpisodeResponse(
            success=False, client_uuid=body.client_uuid, episode_uuid="",
            fail_cause=claim_fail_cause(state, no_free_slot=state == EngineState.ROLLING))
    return ClaimEpisodeResponse(success=True, client_uuid=body.client_uuid,
                                episode_uuid=episode.episode_uuid,
                                openai_base_url=episode.openai_base_url,
                                openai_api_key=episode.openai_api_key,
                                anthropic_base_url=episode.anthropic_base_url or "")


@router.get("/get_current_batch_rollout_pool_information", responses=_ERRORS)
async def get_current_batch_rollout_pool_information(
    ctx: Ctx, _: WorkerAuth
) -> CurrentBatchRolloutPoolInformation:
    """The current batch: completed episodes and tasks against their targets, running
    episodes, active clients (the original's keys)."""
    status = ctx.engine.status()
    data = await ctx.episodes.engine_call("GET", "/rollout_pool") or {}
    info = CurrentBatchRolloutPoolInformation.model_validate(data)
    info.engine_status = status.state.value
    info.global_step = status.step if status.step is not None else info.global_step
    info.booting_start_time = status.since if status.state == EngineState.BOOTING else None
    if info.training_model_path is None:
        current = ctx.engine.current_config()
        info.training_model_path = str(current.config.get("model")) if current else None
    return info


@router.post("/get_episode_buffer", responses=_ERRORS)
async def get_episode_buffer(
    ctx: Ctx, _: WorkerAuth, body: Annotated[dict[str, Any] | None, Body()] = None
) -> EpisodeBufferResponse:
    """Every claimed episode of the running engine (their keys are never listed)."""
    data = await ctx.episodes.engine_call("GET", "/episode_buffer") or {"buffer": []}
    return EpisodeBufferResponse.model_validate(data)


@router.post("/can_continue_episode", responses=_ERRORS)
async def can_continue_episode(ctx: Ctx, _: WorkerAuth, body: CanContinueEpisodeRequest
                               ) -> CanContinueEpisodeResponse:
    """True while the episode is claimed by this client and the engine takes results."""
    data = await ctx.episodes.engine_call("POST", "/can_continue_episode", body.model_dump())
    return CanContinueEpisodeResponse(can_continue=bool(data and data.get("can_continue")))


@router.get("/get_server_experiment_dir", responses=_ERRORS)
async def get_server_experiment_dir(ctx: Ctx, _: WorkerAuth) -> dict[str, str | None]:
    """The absolute directory of the current (else the latest) run; null before any run."""
    run_id = ctx.engine.latest_run_id()
    return {"server_experiment_dir": str(ctx.engine.run_dir(run_id).resolve())
            if run_id else None}


@router.post("/agree_sync_weight", responses=_ERRORS)
async def agree_sync_weight(ctx: Ctx, _: WorkerAuth, body: AgreeSyncWeightRequest
                            ) -> BoolResponse:
    """Agree to the next update (the agree_sync_weight collection methods only)."""
    data = await ctx.episodes.engine_call("POST", "/agree_sync_weight", body.model_dump())
    if data is None:
        state = ctx.engine.state
        return BoolResponse(success=False, failure_reason=f"engine is {state}: no batch is "
                            "being collected; agree once it is ENGINE.ROLLING")
    return BoolResponse.model_validate(data)
