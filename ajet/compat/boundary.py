"""The boundary between the original AgentJet's shapes and this project's models.

Everything that turns an original body, result or reply into this project's typed
models (or back) lives here, so the original client (`ajet.compat.client`), the
server's routes and the rollout runner convert the same way and handlers see one model:

- a `WorkflowOutput` becomes the reward, success flag and metrics of an
  `EndEpisodeRequest` (a list reward is refused with the original's message; list
  metrics are averaged), or the fields of the rollout runner's own result
  (`workflow_output_fields`);
- the original's `/end_episode` and `/abort_episode` bodies become this project's
  requests (the task id of `workflow_output.metadata` must match `task_id`);
- a refused claim becomes the original's `fail_cause` text, which the original
  client's back-off reads;
- a request body on a path both servers have (`/end_episode`, `/abort_episode`) is
  read as whichever shape it has (`end_request`, `abort_request`).

This is the module of the compatibility room that two core modules may import (the
routes serving both body shapes, `swarm_server/routes/episodes.py`, and the rollout
runner, `ajet/rollout.py`); it imports only models, never the original client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ajet.compat.task import WorkflowOutput
from ajet.compat.wire import EndEpisodeRequest as OriginalEnd
from ajet.protocol import AbortEpisodeRequest, EndEpisodeRequest, EngineState

__all__ = [
    "STEP_REWARD_REFUSED",
    "OriginalBodyError",
    "OriginalEnd",
    "abort_request",
    "abort_request_from_original",
    "claim_fail_cause",
    "end_request",
    "end_request_from_original",
    "end_request_from_output",
    "flat_log_metrics",
    "reward_of",
    "workflow_output_fields",
]

#: The original's message for a list (per-step) reward.
STEP_REWARD_REFUSED = "AgentJet will support step reward in future versions."


class OriginalBodyError(ValueError):
    """An original body that cannot be served; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def reward_of(output: WorkflowOutput) -> float:
    """The episode's scalar reward; refuses a list or a missing reward."""
    reward = output.reward
    if isinstance(reward, list):
        raise OriginalBodyError("workflow_output.reward", STEP_REWARD_REFUSED)
    if reward is None:
        raise OriginalBodyError("workflow_output.reward",
                                "workflow_output.reward is None; a reward is required")
    value = _finite(reward)
    if value is None:
        raise OriginalBodyError("workflow_output.reward", "the reward must be a finite number")
    return value


def flat_log_metrics(log_metrics: Mapping[str, Any]) -> dict[str, float]:
    """Per-episode metrics as numbers: a list is averaged, a dict's numbers become
    `key/sub`; anything else, and non-finite numbers, are left out."""
    flat: dict[str, float] = {}
    for key, value in log_metrics.items():
        if isinstance(value, Mapping):
            for sub, inner in value.items():
                _put(flat, f"{key}/{sub}", inner)
        else:
            _put(flat, str(key), value)
    return flat


def _put(flat: dict[str, float], key: str, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        numbers = [n for n in map(_finite, value) if n is not None]
        if not numbers:
            return
        value = sum(numbers) / len(numbers)
    number = _finite(value)
    if number is not None:
        flat[key] = number


def _finite(value: Any) -> float | None:
    """`value` as a finite float; None for anything else (a bool, a string, 1e400)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return number if math.isfinite(number) else None


def workflow_output_fields(result: object) -> dict[str, Any] | None:
    """The rollout runner's result fields (reward, is_success, log_metrics, metadata) of an
    original `WorkflowOutput`; None when `result` is not one."""
    if not isinstance(result, WorkflowOutput):
        return None
    return {"reward": reward_of(result), "is_success": result.is_success,
            "log_metrics": flat_log_metrics(result.log_metrics),
            "metadata": dict(result.metadata)}


def end_request_from_output(episode_uuid: str, task_id: str, output: WorkflowOutput, *,
                            client_uuid: str | None, declare_client_active: bool = True
                            ) -> EndEpisodeRequest:
    """This project's end request for a workflow's output."""
    metadata = {**output.metadata, "task_id": task_id}
    return EndEpisodeRequest(
        episode_uuid=episode_uuid, task_id=task_id, reward=reward_of(output),
        is_success=output.is_success, metadata=metadata,
        log_metrics=flat_log_metrics(output.log_metrics), client_uuid=client_uuid,
        declare_client_active=declare_client_active)


def end_request_from_original(body: OriginalEnd) -> EndEpisodeRequest:
    """The original `/end_episode` body as this project's request."""
    meta_task = body.workflow_output.metadata.get("task_id")
    if meta_task is None:
        raise OriginalBodyError("workflow_output.metadata.task_id",
                                "workflow_output.metadata must contain task_id")
    if str(meta_task) != body.task_id:
        raise OriginalBodyError(
            "workflow_output.metadata.task_id",
            f"workflow_output.metadata.task_id ({meta_task!r}) must match task_id "
            f"({body.task_id!r})")
    if not body.task_id:
        raise OriginalBodyError("task_id", "task_id must be a non-empty string")
    return end_request_from_output(body.episode_uuid, body.task_id, body.workflow_output,
                                   client_uuid=body.client_uuid,
                                   declare_client_active=body.declare_client_active)


def abort_request_from_original(body: OriginalEnd) -> AbortEpisodeRequest:
    """The original `/abort_episode` body (an end body with no result) as an abort."""
    return AbortEpisodeRequest(episode_uuid=body.episode_uuid, reason="aborted by the client",
                               client_uuid=body.client_uuid,
                               declare_client_active=body.declare_client_active)


def end_request(body: EndEpisodeRequest | OriginalEnd) -> EndEpisodeRequest:
    """The one model `/end_episode` handles, from either body shape."""
    return end_request_from_original(body) if isinstance(body, OriginalEnd) else body


def abort_request(body: AbortEpisodeRequest | OriginalEnd) -> AbortEpisodeRequest:
    """The one model `/abort_episode` handles, from either body shape."""
    return abort_request_from_original(body) if isinstance(body, OriginalEnd) else body


def claim_fail_cause(state: EngineState, *, no_free_slot: bool) -> str:
    """The original server's `fail_cause` for a refused claim (its client matches on it)."""
    if state == EngineState.ROLLING and no_free_slot:
        return "No available episodes to claim. Try again (maybe 1 minute) later."
    advice = {
        EngineState.OFFLINE: "Please start the engine first. Please use one of the client to "
                             "run `client.sync_train_config() + client.start_engine()` to "
                             "start the engine.",
        EngineState.BOOTING: "Please wait until the engine is fully booted. Try again (maybe "
                             "1 minute) later.",
        EngineState.WEIGHT_SYNCING: "Engine is syncing weights. Try again (maybe 1 minute) "
                                    "later.",
        EngineState.ROLLING_POST: "Engine is in post-rolling phase. Try again (maybe 1 "
                                  "minute) later.",
    }.get(state, "Try again later.")
    return f"Engine not ready. Current status: [{state.value}]. {advice}"
