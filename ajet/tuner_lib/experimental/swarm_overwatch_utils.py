"""`CurrentBatchRolloutPoolInformation`: the original's rollout-pool statistics reply.

`GET /get_current_batch_rollout_pool_information` answers with these keys, and
`SwarmClient.get_rollout_stat()` returns this model (docs/compat.md).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["CurrentBatchRolloutPoolInformation"]


class CurrentBatchRolloutPoolInformation(BaseModel):
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
