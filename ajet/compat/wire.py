"""The original AgentJet wire models: the bodies its swarm client and server exchange.

They are named and shaped as in AgentJet's `interchange_utils` (which re-exports them) so
that scripts importing them (`SwarmThrottlePolicy` above all) keep working, and so that
this project's server can read the original client's requests
(`swarm_server/routes/original.py`); `ajet.compat.boundary` converts them to this
project's models. Two bodies the engine also reads, `CanContinueEpisodeRequest` and
`AgreeSyncWeightRequest`, are this project's own (`ajet.protocol`), re-exported here
under the same names. Light: pydantic only.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from ajet.compat.task import WorkflowOutput
from ajet.protocol import AgreeSyncWeightRequest, CanContinueEpisodeRequest

__all__ = [
    "CLIENT_ACTIVE_TIMEOUT",
    "VALID_STATUSES",
    "ActiveSwarmClient",
    "AgreeSyncWeightRequest",
    "BoolResponse",
    "CanContinueEpisodeRequest",
    "CanContinueEpisodeResponse",
    "ClaimEpisodeRequest",
    "ClaimEpisodeResponse",
    "CurrentBatchRolloutPoolInformation",
    "EndEpisodeRequest",
    "EndEpisodeResponse",
    "EpisodeBufferResponse",
    "EpisodeStatus",
    "SwarmClientInstruction",
    "SwarmThrottlePolicy",
    "SyncTrainConfigRequest",
]

VALID_STATUSES = [
    "ENGINE.OFFLINE",
    "ENGINE.BOOTING",
    "ENGINE.ROLLING",
    "ENGINE.ROLLING_POST",
    "ENGINE.WEIGHT_SYNCING",
]

#: A client falls off the active list after this long without a claim or a chat (seconds).
CLIENT_ACTIVE_TIMEOUT = 10 * 60

_ID = 100  # longest client or episode id the server reads (this project's limit)
_TASK_ID = 500  # longest task id


class _Body(BaseModel):
    # A request body: unknown keys are refused so a typo is named, not ignored.
    model_config = ConfigDict(extra="forbid")


class SyncTrainConfigRequest(_Body):
    yaml_as_string: str = Field(max_length=1_000_000,
                                description="The job as the original's nested `ajet:` YAML")


class SwarmThrottlePolicy(BaseModel):
    """Keep one task from taking over a batch when several clients share a server."""

    ratio: float = Field(default=1.5, ge=0, le=100,
                         description="At most expected_batch_size * ratio distinct tasks of "
                                     "this client in a batch")
    expected_batch_size: int = Field(ge=0, description="Tasks in a batch")
    expected_num_repeat: int = Field(ge=0, description="Episodes per task")
    current_task_id: str = Field(max_length=_TASK_ID,
                                 description="The task about to be claimed for")


class ClaimEpisodeRequest(_Body):
    client_uuid: str = Field(max_length=_ID)
    episode_type: str = Field(max_length=20, description="'train' or 'eval'")
    discard_episode_timeout: float = Field(gt=0, le=86_400,
                                           description="Idle seconds before the server "
                                                       "re-queues the episode")
    throttle_policy: SwarmThrottlePolicy | None = None


class ClaimEpisodeResponse(BaseModel):
    success: bool
    client_uuid: str
    episode_uuid: str
    openai_base_url: str = ""
    openai_api_key: str = ""
    fail_cause: str = ""
    #: this project's addition: the server root for Anthropic clients (no `/v1`)
    anthropic_base_url: str = ""


class CanContinueEpisodeResponse(BaseModel):
    can_continue: bool


class EndEpisodeRequest(_Body):
    """The original's body of both `/end_episode` and `/abort_episode`."""

    client_uuid: str = Field(max_length=_ID)
    episode_uuid: str = Field(max_length=_ID)
    workflow_output: WorkflowOutput
    task_id: str = Field(max_length=_TASK_ID)
    declare_client_active: bool = True


class EndEpisodeResponse(BaseModel):
    success: bool


class EpisodeStatus(BaseModel):
    """One claimed episode, as `/get_episode_buffer` lists it (keys are never included)."""

    episode_uuid: str
    episode_status: str = ""
    episode_type: str = "train"
    openai_base_url: str = ""
    openai_api_key: str = ""
    client_uuid: str = ""
    zmq_listen_result_addr: str = ""
    latest_activity_timestamp: float = Field(default_factory=time.time)
    discard_episode_timeout: float
    llm_call_count: int = 0
    debug_log: list[str] = Field(default_factory=list)
    optional_task_id: str = ""


class EpisodeBufferResponse(BaseModel):
    buffer: list[EpisodeStatus]


class BoolResponse(BaseModel):
    success: bool
    failure_reason: str = ""


class ActiveSwarmClient(BaseModel):
    """A client that ended a rewarded episode since the last weight sync."""

    client_uuid: str
    last_activity_at: float
    allowed_sync_weight: bool = False


class SwarmClientInstruction(BaseModel):
    active_clients: list[ActiveSwarmClient] = Field(default_factory=list)


class CurrentBatchRolloutPoolInformation(BaseModel):
    """The reply of `GET /get_current_batch_rollout_pool_information`, which
    `SwarmClient.get_rollout_stat()` returns (docs/compat.md)."""

    sample_collection_method: str = ""
    completed_episodes: int = 0
    completed_episode_target: int = 0
    completed_tasks: int = 0
    completed_task_target: int = 0
    completed_non_dummy_tasks: int = 0
    completed_non_dummy_task_target: int = 0
    task_expected_num_repeat: int = 0
    #: task_id -> episode uuids / rewards / client uuids, one entry per ended episode
    completed_tasks_details: dict[str, list[str]] = Field(default_factory=dict)
    completed_tasks_rewards: dict[str, list[float]] = Field(default_factory=dict)
    completed_tasks_client_uuids: dict[str, list[str]] = Field(default_factory=dict)
    #: episode uuid -> {"episode_status", "time_since_last_activity", ...}; None when empty
    running_episode_details: dict[str, dict[str, str]] | None = None
    engine_status: str | None = None
    global_step: int | None = None
    booting_start_time: float | None = None
    training_model_path: str | None = None
    swarm_client_instruction: dict[str, object] = Field(default_factory=dict)
