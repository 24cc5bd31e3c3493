"""`Task` and `WorkflowOutput`, as AgentJet's rollout scripts import them.

    from ajet.schema.task import Task, WorkflowOutput

A `Task` is one dataset item; episodes of the same `task_id` form one GRPO group. A
`WorkflowOutput` is what a workflow returns and `SwarmClient.end_episode` reports.
The fields and their types are the original's. As there, a list `reward` (per-step
rewards) is accepted by the model and refused when reported (`end_episode`), and
`log_metrics` may hold lists, which are averaged per key (docs/compat.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

__all__ = ["Task", "WorkflowOutput"]


class Task(BaseModel):
    main_query: str = Field(default="", description="The main query or instruction; may be "
                                                    "empty when init_messages are given")
    init_messages: list[dict[str, Any]] = Field(
        default_factory=list, description="Initial messages; may be empty when main_query is set")
    task_id: str = Field(default="", description="Same task_id, same task: one GRPO group")
    env_type: str = Field(default="", description="Set when the task runs in a gym environment")
    metadata: dict[str, Any] = Field(default_factory=dict,
                                     description="Anything else, e.g. the reference answer")


class WorkflowOutput(BaseModel):
    reward: float | list[float] | None = Field(
        default=None, description="The episode's reward; a list (step rewards) is refused "
                                  "when reported")
    is_success: bool | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    log_metrics: dict[str, float | list[float] | dict[str, Any]] = Field(
        default_factory=dict, description="Per-episode metrics; lists are averaged")
