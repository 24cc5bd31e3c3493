"""Wire models shared by the swarm server, the client and the engine's private channel.

Every HTTP body that crosses a process boundary is one of these pydantic models, so the
server (`swarm_server`), the client (`ajet.client`) and the engine (`ajet.engine`) agree
on one definition. This module imports nothing heavy: the laptop side imports it.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, computed_field, field_validator

__all__ = [
    "AbortEpisodeRequest",
    "ActivateRequest",
    "AgreeSyncWeightRequest",
    "ApprovalDecisionPublic",
    "ApprovalDecisionRequest",
    "ApprovalState",
    "ApprovalsPage",
    "PendingSnapshot",
    "ReviewFile",
    "ReviewPage",
    "ServerCodePublic",
    "SnapshotApproval",
    "AuditEntry",
    "AuditPage",
    "BeginEpisodeRequest",
    "DevicePoolStatus",
    "StartRunRequest",
    "BeginEpisodeResponse",
    "BlobsUploaded",
    "CanContinueEpisodeRequest",
    "CodeSyncResult",
    "CommitRequest",
    "ConfigAccepted",
    "ConfigNote",
    "EndEpisodeRequest",
    "EndEpisodeResponse",
    "ENGINE_FAILURE_FILE",
    "EngineFailure",
    "EngineReport",
    "EngineState",
    "EngineStatus",
    "ErrorBody",
    "FileEntry",
    "GCResult",
    "HealthResponse",
    "LastError",
    "LogsResponse",
    "ManifestRequest",
    "ManifestResponse",
    "MetricsResponse",
    "PlanePath",
    "Provenance",
    "RunPublic",
    "RunsPage",
    "SERVER_CODE",
    "SamplePublic",
    "SamplesPage",
    "SnapshotPublic",
    "SnapshotsPage",
    "StartEngineRequest",
    "StartEngineResponse",
    "StopEngineRequest",
    "StopEngineResponse",
    "SyncConfigRequest",
    "VersionResponse",
]

#: The snapshot id that stands for "the server's own installed ajet", i.e. no synced code.
SERVER_CODE = "server"


class EngineState(str, enum.Enum):
    """Lifecycle of the training engine. Values are the compatibility strings."""

    #: No engine process. The only state in which code and config may change.
    OFFLINE = "ENGINE.OFFLINE"
    #: Process spawned; importing, loading the model, not yet serving episodes.
    BOOTING = "ENGINE.BOOTING"
    #: Serving episodes: workers may claim, chat and end episodes.
    ROLLING = "ENGINE.ROLLING"
    #: A step's batch is full: no new claims, in-flight episodes drain.
    ROLLING_POST = "ENGINE.ROLLING_POST"
    #: Policy update in progress; claims wait for ROLLING again.
    WEIGHT_SYNCING = "ENGINE.WEIGHT_SYNCING"

    def __str__(self) -> str:  # so f-strings print "ENGINE.ROLLING"
        return self.value


class PlanePath:
    """The episode plane's paths: the same on the public server and on the engine's private
    socket, which the server forwards each call to unchanged. Plain strings (a namespace,
    not an enum), so they go wherever a path does."""

    BEGIN_EPISODE = "/begin_episode"
    END_EPISODE = "/end_episode"
    ABORT_EPISODE = "/abort_episode"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MODELS = "/v1/models"
    MESSAGES = "/v1/messages"
    COUNT_TOKENS = "/v1/messages/count_tokens"


class ApprovalState(str, enum.Enum):
    """Where a snapshot stands with the server's approvers (docs/design.md, "Approvals")."""

    #: The server has no approver tokens: nothing is enforced (laptop-side approval only).
    NOT_ENFORCED = "not_enforced"
    #: Stored, not yet approved: the engine cannot start on it and it cannot be activated.
    PENDING = "pending"
    #: An approver approved exactly this content (bound to the snapshot id; never expires).
    APPROVED = "approved"
    #: An approver refused it: it never runs (any edit makes a new, pending snapshot).
    DENIED = "denied"
    #: Approved, then revoked: it never runs again.
    REVOKED = "revoked"

    def __str__(self) -> str:
        return self.value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    """Every error response: what went wrong and what to call next (`ajet.errors`)."""

    detail: Any
    hint: str = ""
    param: str | None = Field(default=None, description="The request field at fault, where "
                                                        "one is named (sent only then)")


# ---------------------------------------------------------------------------- control


class HealthResponse(BaseModel):
    ok: bool = True


class VersionResponse(BaseModel):
    version: str
    api: int = 1
    ajet_file: str = Field(description="The server's own installed ajet package path")
    approvals_enforced: bool = Field(
        default=False, description="Approver tokens are configured: unapproved code never runs")


class LastError(BaseModel):
    """Why the last engine run ended badly."""

    run_id: str | None = None
    exit_code: int | None = None
    reason: str
    log_tail: list[str] = Field(default_factory=list)
    at: float = Field(description="Unix time of the failure")


class EngineStatus(BaseModel):
    state: EngineState
    run_id: str | None = None
    snapshot_id: str = SERVER_CODE
    snapshot_path: str | None = None
    pid: int | None = None
    step: int | None = None
    ajet_file: str | None = Field(default=None, description="ajet.__file__ the engine reported")
    has_config: bool = False
    experiment_name: str | None = None
    last_error: LastError | None = None
    since: float = Field(description="Unix time the current state was entered")
    approvals_enforced: bool = False
    snapshot_approval: ApprovalState = Field(
        default=ApprovalState.NOT_ENFORCED,
        description="Approval of the active code (the server's own code counts as approved)")
    trackers: dict[str, str] = Field(
        default_factory=dict, description="Where the current run's trackers write")
    name: str | None = Field(default=None, description="The run's name (POST /runs)")
    devices: list[int] = Field(default_factory=list,
                               description="Device slots the run holds (GPU indices on GPUs)")
    queue_position: int | None = Field(default=None,
                                       description="1 = next to start, while it is queued")
    queue_reason: str | None = Field(default=None, description="Why it waits, while queued")

    # The original AgentJet server's keys, so its client (and scripts reading the dict of
    # `get_engine_status()`) find what they expect (docs/compat.md).
    @computed_field(description="The state string (original AgentJet key)")  # type: ignore[prop-decorator]
    @property
    def engine_status(self) -> str:
        return self.state.value

    @computed_field(description="The engine's step count, 0 before any (original key)")  # type: ignore[prop-decorator]
    @property
    def global_step(self) -> int:
        return self.step or 0

    @computed_field(description="What the state means right now (original key)")  # type: ignore[prop-decorator]
    @property
    def engine_status_detail(self) -> str | None:
        if self.state == EngineState.OFFLINE and self.last_error is not None:
            return f"last run failed: {self.last_error.reason}"
        if self.state == EngineState.BOOTING:
            return f"booting run {self.run_id}"
        return None


class SyncConfigRequest(_Model):
    # `yaml_as_string` is the original AgentJet's name of the same field (its nested form)
    yaml: str = Field(description="AgentJetJob as YAML: this project's flat form, or the "
                                  "original's nested `ajet:` tree (also sent as "
                                  "`yaml_as_string`)",
                      max_length=1_000_000,
                      validation_alias=AliasChoices("yaml", "yaml_as_string"))
    check_only: bool = Field(
        default=False, description="Validate with the active code's validator and store "
                                   "nothing; allowed in any engine state (a check before a "
                                   "restart, so a refused config never stops a run)")


class ConfigNote(BaseModel):
    """A job setting that was accepted but is not applied as the original applies it."""

    field: str
    status: str = Field(description="no_effect | ignored | differs")
    reason: str


class ConfigAccepted(BaseModel):
    config_hash: str
    experiment_name: str
    config: dict[str, Any]
    notes: list[ConfigNote] = Field(
        default_factory=list,
        description="Settings stored without effect here, and nested keys with no meaning here")
    success: bool = Field(default=True, description="Always true (original AgentJet key)")
    memory: dict[str, Any] | None = Field(
        default=None,
        description="The memory planner's estimate per GPU (docs/distributed.md, 'How the "
                    "planner counts'); null when the model's config.json is not on the server")


class StartEngineRequest(_Model):
    force_restart: bool = Field(
        default=False, description="Stop a running engine first, then start with the current config"
    )


class StopEngineRequest(_Model):
    reason: str = Field(default="stopped by request", max_length=500)


class StartEngineResponse(EngineStatus):
    """The status right after a start (BOOTING), plus the original AgentJet keys."""

    success: bool = Field(default=True, description="The start was accepted (original key)")


class StopEngineResponse(BaseModel):
    stopped: bool = Field(description="True if an engine process was running and is now gone")
    run_id: str | None = None
    state: EngineState
    waited_for: list[str] = Field(
        default_factory=list,
        description="Checkpoints that were being written when the stop came; the stop "
                    "waited for them (up to the run's stop grace)")
    last_checkpoint: str | None = Field(
        default=None, description="The run's last complete checkpoint directory, if any")
    message: str | None = Field(default=None, description="What the stop did, in words")
    success: bool = Field(default=True, description="Always true: stop is idempotent (original key)")


# ---------------------------------------------------------------------------- code


class FileEntry(_Model):
    path: str = Field(description="POSIX path starting with 'ajet/'", max_length=1024)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    mode: int = Field(description="0o644 or 0o755", ge=0)


class Provenance(BaseModel):
    git_head: str | None = None
    branch: str | None = None
    dirty: bool = False
    diff: str = Field(default="", description="git diff HEAD of tracked files under ajet/ (capped)")
    untracked_left_out: list[str] = Field(default_factory=list)
    host: str | None = None
    created_at: float | None = None
    source: str = Field(default="manifest", description="manifest | zip")
    withheld: bool = Field(
        default=False, description="A worker-token view: `diff`, `untracked_left_out` and "
        "`host` are withheld (workers never see code); `diff_bytes` and `untracked_count` "
        "say how much there was")
    diff_bytes: int | None = None
    untracked_count: int | None = None

    def for_worker(self) -> Provenance:
        """What a worker-token holder may read: no diff, no file names, no host."""
        return self.model_copy(update={
            "diff": "", "untracked_left_out": [], "host": None, "withheld": True,
            "diff_bytes": len(self.diff.encode("utf-8")),
            "untracked_count": len(self.untracked_left_out)})


class ManifestRequest(_Model):
    files: list[FileEntry] = Field(max_length=100_000)
    provenance: Provenance = Field(default_factory=Provenance)


class SnapshotApproval(BaseModel):
    """The server's approval record of one snapshot (never the client's claim)."""

    state: ApprovalState
    approver: str | None = Field(default=None, description="Name of the approver who decided")
    at: float | None = None
    note: str = ""


class ManifestResponse(BaseModel):
    snapshot_id: str
    missing: list[str] = Field(description="sha256 of blobs the server lacks; upload them")
    exists: bool = Field(description="An identical snapshot already exists on the server")
    active: bool = Field(default=False,
                         description="That snapshot is already the active code: no commit needed")
    path: str | None = Field(default=None, description="Its ajet/ folder, relative to workdir")
    state: EngineState | None = Field(default=None, description="The engine state right now")
    approval: SnapshotApproval | None = Field(
        default=None, description="The existing snapshot's approval (absent for new content)")


class BlobsUploaded(BaseModel):
    """Answer of `POST /code/blobs`: every blob of the body was verified and stored."""

    stored: list[str] = Field(description="sha256 of blobs newly stored")
    already_present: list[str] = Field(description="sha256 of blobs the server had already")
    bytes_received: int


class CommitRequest(_Model):
    snapshot_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    files: list[FileEntry] = Field(max_length=100_000)
    provenance: Provenance = Field(default_factory=Provenance)
    force_restart: bool = False
    approved_by: str | None = Field(
        default=None, max_length=200,
        description="The client's claim of who approved (laptop-side); recorded, never trusted")
    activate: bool = Field(
        default=True, description="false: store the snapshot only (e.g. for review); true: "
                                  "also activate it, which an enforcing server refuses (409) "
                                  "until an approver approved it")


class SnapshotPublic(BaseModel):
    snapshot_id: str
    path: str = Field(description="Server path of the snapshot's ajet/ folder, relative to workdir")
    created: float
    file_count: int
    total_bytes: int
    active: bool = False
    provenance: Provenance = Field(default_factory=Provenance)
    approved_by: str | None = Field(
        default=None, description="Who the client claimed approved it (laptop-side approval); "
                                  "not verified. The server's own record is `approval`")
    approval: SnapshotApproval | None = None
    files: list[FileEntry] | None = Field(
        default=None, description="The manifest; in GET /code and GET /code/snapshots/{id} only"
    )


class SnapshotsPage(BaseModel):
    active: str = SERVER_CODE
    snapshots: list[SnapshotPublic]


class CodeSyncResult(BaseModel):
    """Returned by commit, zip sync and activate; the client adds its own figures."""

    snapshot_id: str
    path: str
    reused: bool = Field(description="An identical snapshot existed; nothing was written")
    activated: bool
    restarted: bool = False
    run_id: str | None = None
    state: EngineState
    files: int = 0
    bytes_uploaded: int = 0
    untracked_left_out: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    approval: SnapshotApproval | None = None
    # the original AgentJet server's keys
    success: bool = Field(default=True, description="Always true on 200 (original key)")
    message: str = Field(default="Training code synced successfully.",
                         description="Original AgentJet key")

    @computed_field(description="The snapshot's ajet/ folder (original key; same as `path`)")  # type: ignore[prop-decorator]
    @property
    def temp_ajet_code_path(self) -> str:
        return self.path


class ActivateRequest(_Model):
    snapshot_id: str = Field(description=f"A snapshot id (or unique prefix), or '{SERVER_CODE}'")
    force_restart: bool = False


class GCResult(BaseModel):
    removed_snapshots: list[str]
    removed_blobs: int
    kept: list[str]


class ServerCodePublic(BaseModel):
    """The server's own installed `ajet/` (snapshot id `server`): what a first sync replaces."""

    ajet_dir: str
    files: list[FileEntry]


# ---------------------------------------------------------------------------- approvals


class PendingSnapshot(BaseModel):
    snapshot_id: str
    created: float
    file_count: int
    total_bytes: int
    approval: SnapshotApproval
    claimed_head: str | None = Field(default=None, description="git HEAD the client claimed")
    claimed_branch: str | None = None
    claimed_host: str | None = None


class ApprovalDecisionPublic(BaseModel):
    snapshot_id: str
    decision: Literal["approved", "denied", "revoked", "reopened"] = Field(
        description="reopened: sent back to pending because the approval its review "
                    "rested on was revoked or denied (the note names it)")
    approver: str
    at: float
    note: str = ""
    base_id: str | None = Field(default=None, description="What the reviewed diff compared with")


class ApprovalsPage(BaseModel):
    enforced: bool
    pending: list[PendingSnapshot]
    recent: list[ApprovalDecisionPublic] = Field(default_factory=list)


class ReviewFile(BaseModel):
    path: str = Field(description="Escaped: control characters shown as \\xNN")
    kind: Literal["added", "changed", "removed", "renamed"]
    old_path: str | None = None
    old_mode: int | None = None
    new_mode: int | None = None
    size: int
    shown: Literal["text", "whole", "binary"]
    flags: list[str] = Field(default_factory=list)
    first_line: int = Field(description="Offset of this file's first diff line")
    added: int = 0
    removed: int = 0


class ReviewPage(BaseModel):
    """A snapshot's review, computed by the server from its own stored files."""

    snapshot_id: str
    approval: SnapshotApproval
    base_id: str = Field(description="What the diff compares with: the active approved snapshot, "
                                     "or 'server' (the server's own ajet/)")
    base_reason: str
    summary: str
    files: list[ReviewFile]
    flagged: list[str] = Field(description="Paths of files with flags: look at these")
    claimed: Provenance = Field(description="What the CLIENT claimed (git HEAD, branch, dirty "
                                            "diff): a claim, not verified; escaped")
    diff: str = Field(description="One page of the escaped diff text")
    offset: int
    next_offset: int | None = Field(default=None, description="Pass as offset for the next page")
    total_lines: int
    history: list[ApprovalDecisionPublic] = Field(default_factory=list)


class ApprovalDecisionRequest(_Model):
    snapshot_id: str = Field(pattern=r"^[0-9a-f]{64}$",
                             description="The full snapshot id, confirming what is decided")
    note: str = Field(default="", max_length=2000, description="Why (kept in the ledger)")
    base_id: str | None = Field(
        default=None, pattern=r"^([0-9a-f]{64}|server)$",
        description="The base of the review that was read (`ReviewPage.base_id`); the "
                    "approval rests on it. Default: the review's default base now")


# ---------------------------------------------------------------------------- runs


class RunPublic(BaseModel):
    run_id: str
    snapshot_id: str
    experiment_name: str
    config_hash: str
    config_yaml: str | None = Field(default=None, description="Only in GET /runs/{id}")
    started_by: str
    started_at: float
    ended_at: float | None = None
    status: str = Field(description="queued | booting | running | ended | failed")
    final_state: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    last_step: int | None = None
    summary: dict[str, dict[str, float | int | None]] = Field(
        default_factory=dict,
        description="Per metric: first, last, best, best_step",
    )
    provenance: Provenance | None = None
    resumed_from: str | None = Field(
        default=None, description="The run this one resumed from (job field resume_from)")
    resume_checkpoint: str | None = Field(
        default=None, description="The checkpoint directory it resumed from")
    resume_step: int | None = Field(
        default=None, description="The step of that checkpoint; this run's steps continue "
                                  "from it")
    last_checkpoint: str | None = Field(
        default=None, description="The run's last complete checkpoint directory (a later "
                                  "job's resume_from may name the run)")
    trackers: dict[str, str] = Field(
        default_factory=dict, description="Where each of the job's trackers writes (for "
                                          "TensorBoard, the command to read it)")
    name: str | None = Field(default=None, description="The name given at POST /runs")
    default_run: bool = Field(
        default=False, description="Started by start_engine (the single-engine surface), "
                                   "not by POST /runs")
    devices: list[int] = Field(
        default_factory=list, description="Device slots it holds (GPU indices on a GPU "
                                          "host: its CUDA_VISIBLE_DEVICES)")
    engine_state: EngineState | None = Field(
        default=None, description="Its engine's state while it is active (queued: None)")
    queue_position: int | None = Field(
        default=None, description="1 = next to start, while status is 'queued'")
    queue_reason: str | None = Field(default=None, description="Why it waits")


class CheckpointInfo(BaseModel):
    name: str = Field(description="final, step_<n>, or either with .partial (incomplete)")
    kind: Literal["step", "final"]
    step: int | None = None
    complete: bool = Field(description="Fully written (no .partial): the only kind to download")
    files: int
    bytes: int
    lora: bool | None = Field(default=None, description="An adapter (with the base named in "
                                                        "adapter_config.json), not full weights")
    merged: bool = Field(default=False, description="Has merged/: the adapter merged into the "
                                                    "base, a plain checkpoint")


class CheckpointsPage(BaseModel):
    run_id: str
    checkpoints: list[CheckpointInfo]


class CheckpointFileHash(BaseModel):
    path: str
    size: int
    sha256: str


class CheckpointManifest(BaseModel):
    run_id: str
    name: str
    files: list[CheckpointFileHash]
    archive_bytes: int = Field(description="Size of GET .../archive (a tar, the same bytes "
                                           "every time)")
    etag: str = Field(description="Changes when any file does; send as If-Range to resume")


class DevicePoolStatus(BaseModel):
    """The server's device slots and who holds them (`--devices`, or the visible GPUs)."""

    kind: Literal["gpu", "cpu", "ray"] = Field(
        description="gpu: slots are GPU indices; cpu: --devices N slots for CPU processes; "
                    "ray: none here, Ray's placement groups reserve each run's devices")
    total: int
    free: list[int]
    held: dict[str, list[int]] = Field(default_factory=dict, description="run id -> slots")
    queued: list[str] = Field(default_factory=list, description="Run ids waiting, in order")


class RunsPage(BaseModel):
    runs: list[RunPublic]
    total: int
    offset: int
    limit: int
    devices: DevicePoolStatus | None = None


class StartRunRequest(_Model):
    """`POST /runs`: start a run beside the ones already running, pinned to one snapshot
    and one config, on devices of its own."""

    snapshot_id: str | None = Field(
        default=None, max_length=80,
        description=f"A snapshot id (or unique prefix), or '{SERVER_CODE}'; default: the "
                    "active snapshot")
    yaml: str | None = Field(
        default=None, max_length=1_000_000,
        description="AgentJetJob YAML; default: the stored config (sync_train_config)")
    name: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
        description="A name for the run, unique among active runs; tools accept it for "
                    "the run id")
    queue: bool = Field(
        default=True, description="Wait in the queue while the devices it needs are busy; "
                                  "false: refuse with 409 instead")

    @field_validator("name")
    @classmethod
    def _not_current(cls, name: str | None) -> str | None:
        # every route that takes a run reads 'current' as the default run
        if name == "current":
            raise ValueError("'current' names the default run wherever a run is named; "
                             "pick another name")
        return name


class MetricsResponse(BaseModel):
    run_id: str
    points: list[dict[str, Any]]
    total_steps: int
    last_step: int | None = None
    downsampled: bool = False


class SamplePublic(BaseModel):
    """One training sample of a step: a timeline of one agent in one episode."""

    episode_uuid: str
    task_id: str | None = None
    agent: str = ""
    advantage: float
    reward: float | None = None
    #: indices (in the episode's completions, in the order served) of the calls merged
    completions: list[int]
    token_ids: list[int]
    #: the tokens decoded (special tokens kept); None when the engine had no tokenizer
    text: str | None = None
    #: 1 on the sampled tokens trained here, 0 on prompt, tool and template tokens
    loss_mask: list[int]
    #: the sampling log-prob at each trained position, 0.0 elsewhere
    logprobs: list[float]


class SamplesPage(BaseModel):
    run_id: str
    step: int
    samples: list[SamplePublic]
    #: samples in the step
    total: int
    offset: int
    #: where the next page starts; None when this page ends the step
    next_offset: int | None = None


class LogsResponse(BaseModel):
    run_id: str
    lines: list[str]
    total_lines: int
    truncated: bool = False


class AuditEntry(BaseModel):
    id: int
    at: float
    action: str
    role: str
    outcome: str
    detail: dict[str, Any] = Field(default_factory=dict)


class AuditPage(BaseModel):
    entries: list[AuditEntry]
    total: int


# ---------------------------------------------------------------------------- episodes


EpisodeType = Literal["train", "eval"]


class BeginEpisodeRequest(_Model):
    # The arguments of AgentJet's begin_episode(...); all optional.
    discard_episode_timeout: float | None = Field(default=None, gt=0, le=86_400)
    metadata: dict[str, Any] = Field(default_factory=dict)
    episode_type: EpisodeType = Field(
        default="train", description="'eval' episodes are served but never trained on")
    client_uuid: str | None = Field(
        default=None, max_length=100,
        description="The claiming client; only it may end or abort the episode")
    task_id: str | None = Field(
        default=None, max_length=500,
        description="The task this episode will run, if known (throttle policies count it)")
    run_id: str | None = Field(
        default=None, max_length=100,
        description="The run to collect for (a run id or name of POST /runs); default: "
                    "the run start_engine started. The episode's key works only for it")


class BeginEpisodeResponse(BaseModel):
    episode_uuid: str
    openai_base_url: str
    openai_api_key: str
    #: the server root, without `/v1`: Anthropic clients append `/v1/messages` themselves
    #: (`anthropic.Anthropic(base_url=..., api_key=openai_api_key)`, `ANTHROPIC_BASE_URL`)
    anthropic_base_url: str | None = None
    run_id: str | None = None
    timeout_s: float | None = None


class EndEpisodeRequest(_Model):
    episode_uuid: str = Field(max_length=100)
    task_id: str = Field(max_length=500)
    reward: float = Field(allow_inf_nan=False)
    is_success: bool | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    log_metrics: dict[str, float] = Field(default_factory=dict)
    client_uuid: str | None = Field(default=None, max_length=100,
                                    description="Must match the claiming client, if it named one")
    declare_client_active: bool = Field(
        default=True, description="Count this client as active (agree_sync_weight methods)")


class EndEpisodeResponse(BaseModel):
    episode_uuid: str
    accepted: bool
    step: int | None = None
    trained: bool = Field(default=True, description="False for an eval episode: never trained on")
    success: bool = Field(default=True, description="Original AgentJet key")


class AbortEpisodeRequest(_Model):
    episode_uuid: str = Field(max_length=100)
    reason: str = Field(default="aborted", max_length=500)
    client_uuid: str | None = Field(default=None, max_length=100,
                                    description="Must match the claiming client, if it named one")
    declare_client_active: bool = True


class CanContinueEpisodeRequest(_Model):
    """`POST /can_continue_episode`: is the episode still claimed by this client?"""

    client_uuid: str = Field(max_length=100)
    episode_uuid: str = Field(max_length=100)


class AgreeSyncWeightRequest(_Model):
    """`POST /agree_sync_weight`: this client agrees to the next update."""

    client_uuid: str = Field(max_length=100)


# ---------------------------------------------------------------------------- engine


class EngineReport(BaseModel):
    """What the engine answers on its private channel at `GET /status`."""

    state: EngineState
    pid: int
    ajet_file: str
    step: int = 0
    run_id: str | None = None
    world_size: int = 1
    ranks_ajet_files: list[str] = Field(default_factory=list)
    snapshot_id: str | None = Field(
        default=None, description="Content id of the ajet/ tree rank 0 imported (the "
        "snapshot id of its files, whatever the folder is called); None from older code")
    ranks_snapshot_ids: list[str | None] = Field(
        default_factory=list, description="The same for every rank, in rank order")
    episodes_in_flight: int = 0
    info: dict[str, Any] = Field(default_factory=dict)


#: Where a failed engine process records why, in its run directory (`EngineFailure`).
ENGINE_FAILURE_FILE = "failure.json"


class EngineFailure(BaseModel):
    """The first exception of a failed run, written by the engine for the server's
    `last_error` (under torchrun: whichever rank failed first, recorded on node 0)."""

    rank: int = Field(ge=0)
    world_size: int = Field(default=1, ge=1)
    error: str = Field(max_length=2000, description="'ExceptionType: message'")
    traceback: list[str] = Field(default_factory=list, max_length=200)

    def describe(self) -> str:
        who = f"rank {self.rank} of {self.world_size}" if self.world_size > 1 else "the engine"
        return f"{who} failed: {self.error}"


Role = Literal["control", "worker", "open"]
