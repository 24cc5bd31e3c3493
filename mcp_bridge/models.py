"""Results of the bridge's MCP tools (structured output) and the names they share.

Every result is small by design (a few KB of JSON at default settings): lists are
capped and say how to page, diffs and logs are truncated with the offset to continue.
Each result carries `message`, one sentence saying what happened and what to call next.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from ajet.protocol import CheckpointInfo

__all__ = [
    "ActivateResult",
    "ApprovalInfo",
    "ApprovalMode",
    "CompareResult",
    "ConfigChange",
    "ConfigureResult",
    "DevicePool",
    "EngineStatusResult",
    "ErrorInfo",
    "LogsResult",
    "MetricTrend",
    "MetricsResult",
    "RolloutInfo",
    "RolloutStartResult",
    "RolloutStatusResult",
    "RolloutStopResult",
    "RunComparison",
    "RunOverlap",
    "RunRow",
    "RunsResult",
    "SnapshotRow",
    "SnapshotsResult",
    "StartResult",
    "StopResult",
    "SyncApprovalStatus",
    "SyncResult",
    "ToolName",
    "ToolResult",
]


class ToolName(str, enum.Enum):
    """The bridge's tools; messages name the next call with these."""

    SYNC_TRAIN_CODE = "sync_train_code"
    CONFIGURE = "configure"
    START_ENGINE = "start_engine"
    STOP_ENGINE = "stop_engine"
    ENGINE_STATUS = "engine_status"
    READ_METRICS = "read_metrics"
    READ_LOGS = "read_logs"
    LIST_RUNS = "list_runs"
    LIST_CHECKPOINTS = "list_checkpoints"
    COMPARE_RUNS = "compare_runs"
    LIST_SNAPSHOTS = "list_snapshots"
    ACTIVATE_SNAPSHOT = "activate_snapshot"
    START_ROLLOUTS = "start_rollouts"
    ROLLOUT_STATUS = "rollout_status"
    STOP_ROLLOUTS = "stop_rollouts"

    def __str__(self) -> str:
        return self.value


class ApprovalMode(str, enum.Enum):
    """How a sync gets a human's approval (`ajet-mcp --approval`)."""

    #: Ask through MCP elicitation when the client supports it, else file a pending approval.
    ASK = "ask"
    #: Always file a pending approval; a human runs `ajet-mcp approvals approve ID`.
    QUEUE = "queue"
    #: Approve every sync without a human (scripted loops); every result says so.
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


class ToolResult(BaseModel):
    """Fields every tool result has."""

    message: str = Field(description="What happened, and what to call next")
    notice: str | None = Field(
        default=None,
        description="Set when the bridge runs with --approval auto: no human reviews syncs",
    )


# ---------------------------------------------------------------------------- code


#: How a sync's approval stands, as the bridge reports it (the laptop's view, not the
#: server's `ajet.protocol.ApprovalState`): `elicited` = a human accepted in the client
#: just now; `approved` = through `ajet-mcp approvals approve`; `declined` = refused in the
#: client.
SyncApprovalStatus = Literal["not_needed", "pending", "approved", "denied", "declined",
                             "auto_approved", "elicited"]


class ApprovalInfo(BaseModel):
    mode: ApprovalMode
    status: SyncApprovalStatus
    approval_id: str | None = None
    human_command: str | None = Field(
        default=None, description="The command a human runs to approve; you cannot run it for them"
    )
    expires_at: str | None = None
    approved_by: str | None = None
    enforced_by_server: bool = Field(
        default=False, description="The server enforces approvals: only a human approver with "
                                   "their own token can approve, on the server")
    approve_url: str | None = Field(
        default=None, description="Web console page where the human approver reviews and "
                                  "approves this snapshot; show it to the human")


class SyncResult(ToolResult):
    status: Literal["preview", "no_changes", "pending_approval", "synced"]
    snapshot_id: str = Field(
        description="Content id of the local ajet/ tree (sha256 of its manifest)")
    running_snapshot_id: str = Field(
        description="Snapshot the cluster runs now ('server' = its own code)")
    files_total: int
    added: list[str] = Field(default_factory=list)
    changed: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    renamed: list[str] = Field(default_factory=list)
    flagged: list[str] = Field(default_factory=list, description="Files the reviewer is warned "
                                                                 "about, and why")
    lists_truncated: bool = False
    untracked_left_out: list[str] = Field(
        default_factory=list,
        description="Untracked files under ajet/ that do NOT ship; git add them",
    )
    blobs_to_upload: int = 0
    bytes_to_upload: int = 0
    diff: str = Field(default="",
                      description="Diff against the code the cluster runs, from the server's "
                                  "stored files; control characters escaped (one page)")
    diff_next_offset: int | None = Field(
        default=None, description="Pass as diff_offset to read more of the diff"
    )
    approval: ApprovalInfo | None = None
    server_path: str | None = None
    bytes_uploaded: int | None = None
    restarted: bool = False
    run_id: str | None = None
    engine_state: str | None = None


class SnapshotRow(BaseModel):
    snapshot_id: str
    created: str
    files: int
    bytes: int
    active: bool
    git_head: str | None = None
    dirty: bool = False
    approved_by: str | None = None


class SnapshotsResult(ToolResult):
    active: str
    snapshots: list[SnapshotRow]
    total: int


class ActivateResult(ToolResult):
    snapshot_id: str
    path: str
    activated: bool
    restarted: bool
    run_id: str | None = None
    engine_state: str


# ---------------------------------------------------------------------------- config / engine


class ConfigChange(BaseModel):
    field: str
    before: Any = None
    after: Any = None


class ConfigureResult(ToolResult):
    experiment_name: str
    config_hash: str
    changed: list[ConfigChange]
    compared_with: str = Field(description="Where the previous config came from")
    config: dict[str, Any] = Field(description="The full config the server accepted")


class ErrorInfo(BaseModel):
    reason: str
    exit_code: int | None = None
    run_id: str | None = None
    at: str | None = None
    log_tail: list[str] = Field(default_factory=list)


class StartResult(ToolResult):
    run_id: str | None
    engine_state: str
    snapshot_id: str
    ajet_file: str | None = None
    waited_s: float
    name: str | None = Field(default=None, description="The run's name: pass it as run_id to "
                                                       "the other tools")
    status: str | None = Field(default=None, description="queued | booting | running (runs "
                                                         "started with a name)")
    devices: list[int] = Field(default_factory=list, description="Device slots it holds")
    queue_position: int | None = Field(default=None, description="1 = next to start")
    queue_reason: str | None = None


class StopResult(ToolResult):
    stopped: bool
    run_id: str | None = None
    engine_state: str
    rollouts_stopped: list[str] = Field(default_factory=list)
    waited_for: list[str] = Field(default_factory=list,
                                  description="Checkpoints being written that the stop waited for")
    last_checkpoint: str | None = Field(
        default=None, description="The run's last complete checkpoint: configure "
                                  "resume_from=<run_id> (or 'latest') to continue from it")


class RolloutInfo(BaseModel):
    handle: str
    run: str | None = Field(default=None, description="The run its episodes go to (None: the "
                                                      "default run)")
    workflow: str
    running: bool
    n_workers: int
    num_repeat: int
    tasks: int
    started: str
    stats: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None


class EngineStatusResult(ToolResult):
    engine_state: str
    run_id: str | None = None
    step: int | None = None
    snapshot_id: str
    snapshot_path: str | None = None
    experiment_name: str | None = None
    has_config: bool
    ajet_file: str | None = None
    in_state_since: str | None = None
    last_error: ErrorInfo | None = None
    rollouts: list[RolloutInfo] = Field(default_factory=list)
    approval_mode: ApprovalMode
    approvals_enforced: bool = Field(
        default=False, description="The server enforces approvals: a human approver approves "
                                   "each snapshot on the server; you cannot")
    snapshot_approval: str | None = Field(
        default=None, description="The server's approval of the active code")
    pending_approvals: list[str] = Field(
        default_factory=list, description="Pending approval ids (laptop-side) or snapshot ids "
                                          "pending on the server")
    approve_url: str | None = Field(default=None,
                                    description="Where the human approves, if something waits")
    name: str | None = Field(default=None, description="The run's name, if it has one")
    devices: list[int] = Field(default_factory=list, description="Device slots the run holds")
    queue_position: int | None = Field(default=None,
                                       description="1 = next to start, while it is queued")
    queue_reason: str | None = None


# ---------------------------------------------------------------------------- runs


class MetricTrend(BaseModel):
    metric: str
    first: float | None = None
    last: float | None = None
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    change: float | None = Field(
        default=None, description="The least-squares rise over the window (slope x steps): "
                                  "the trend `direction` names, less fooled by noisy ends "
                                  "than last - first")
    direction: Literal["up", "down", "flat", "n/a"] = "n/a"
    points: int = 0


class MetricsResult(ToolResult):
    run_id: str
    total_steps: int
    last_step: int | None = None
    window: str = Field(description="Steps the trend covers, e.g. '11-30'")
    latest: dict[str, Any] = Field(default_factory=dict)
    trend: list[MetricTrend] = Field(default_factory=list)
    recent: list[dict[str, Any]] = Field(default_factory=list,
                                         description="The last few points, selected metrics only")
    plot_attached: bool = False


class LogsResult(ToolResult):
    run_id: str
    lines: list[str]
    total_lines: int
    truncated: bool


class RunRow(BaseModel):
    run_id: str
    name: str | None = None
    status: str
    experiment_name: str
    snapshot_id: str
    started: str
    ended: str | None = None
    last_step: int | None = None
    reason: str | None = None
    reward_last: float | None = None
    reward_best: float | None = None
    resumed_from: str | None = Field(default=None,
                                     description="The run this one continued (resume_from)")
    resume_step: int | None = Field(default=None, description="The step it continued from")
    last_checkpoint: str | None = Field(
        default=None, description="Its last complete checkpoint; resume_from: <run_id> "
                                  "continues from there")
    default_run: bool = Field(default=False,
                              description="Started by start_engine without a name")
    devices: list[int] = Field(default_factory=list,
                               description="Device slots it holds while active")
    engine_state: str | None = None
    queue_position: int | None = None
    queue_reason: str | None = None


class DevicePool(BaseModel):
    """The server's device slots: GPUs, or `--devices N` slots on a CPU host."""

    kind: str
    total: int
    free: list[int]
    held: dict[str, list[int]] = Field(default_factory=dict, description="run -> slots")
    queued: list[str] = Field(default_factory=list, description="Runs waiting, next first")


class RunsResult(ToolResult):
    runs: list[RunRow]
    total: int
    next_offset: int | None = None
    devices: DevicePool | None = None


class CheckpointsResult(ToolResult):
    run_id: str
    checkpoints: list[CheckpointInfo]
    download: str | None = Field(
        default=None, description="The command a person runs to download the latest "
                                  "complete one (weights never go through the agent)")


class RunComparison(BaseModel):
    run_id: str
    name: str | None = None
    snapshot_id: str
    status: str
    experiment_name: str
    started: str | None = None
    ended: str | None = None
    devices: list[int] = Field(default_factory=list)
    steps: int | None = None
    first: float | None = None
    last: float | None = None
    best: float | None = None
    best_step: int | None = None


class RunOverlap(BaseModel):
    """Two runs that ran at the same time (side by side, on their own devices)."""

    runs: list[str]
    seconds: float = Field(description="How long both ran at once")


class CompareResult(ToolResult):
    metric: str
    runs: list[RunComparison]
    side_by_side: list[RunOverlap] = Field(
        default_factory=list, description="Pairs of these runs that overlapped in time")
    same_code: bool = Field(description="All runs used the same snapshot")
    config_differences: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="field -> {run_id: value}, only fields that differ"
    )
    best_run: str | None = None


# ---------------------------------------------------------------------------- rollouts


class RolloutStartResult(ToolResult):
    handle: str
    run: str | None = Field(default=None, description="The run its episodes go to (None: the "
                                                      "default run)")
    workflow: str
    n_workers: int
    num_repeat: int
    tasks: int


class RolloutStatusResult(ToolResult):
    rollouts: list[RolloutInfo]


class RolloutStopResult(ToolResult):
    stopped: list[RolloutInfo]
