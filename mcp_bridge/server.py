"""`build_server(bridge)`: the MCP server an agent talks to, one `@mcp.tool()` per tool.

Each tool function here only declares the interface the model sees (typed parameters
with descriptions, annotations, a pydantic result) and calls the plain logic in
`mcp_bridge.tools` / `mcp_bridge.sync`. The server's `instructions` state the research
loop and its rules; every `agent_prompts/*.md` is served as a prompt.
"""

# No `from __future__ import annotations` here: the tools and resolvers below are closures,
# and the SDK reads their annotations (Resolve markers naming local functions) at
# registration, which only works when the annotations are evaluated eagerly.
import base64
import inspect
import logging
from collections.abc import Callable
from importlib import resources
from typing import Annotated, Any, Literal, TypeVar

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.prompts.base import Prompt
from mcp.server.mcpserver.resolve import ElicitationResult, Resolve
from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations
from pydantic import Field

from ajet.copilot.job import AgentJetJob
from mcp_bridge import sync, tools
from mcp_bridge.bridge import Bridge
from mcp_bridge.models import (
    ActivateResult,
    ApprovalMode,
    CheckpointsResult,
    CompareResult,
    ConfigureResult,
    EngineStatusResult,
    LogsResult,
    MetricsResult,
    RolloutStartResult,
    RolloutStatusResult,
    RolloutStopResult,
    RunsResult,
    SnapshotsResult,
    StartResult,
    StopResult,
    SyncResult,
    ToolName,
    ToolResult,
)
from mcp_bridge.sync import ApproveSync, NotAsked, SyncPlan

__all__ = ["INSTRUCTIONS", "build_server", "prompt_files"]

log = logging.getLogger(__name__)

_R = TypeVar("_R", bound=ToolResult)

INSTRUCTIONS = """\
AgentJet Swarm bridge. You improve the AgentJet RL training code (the `ajet/` package in
the git repository {repo}) and the GPU cluster at {url} trains with it. The loop:

1. engine_status. If nothing runs: configure (fields of the job; engine must be OFFLINE),
   start_engine, then start_rollouts with a workflow 'package.module:function' from the
   repo. read_metrics until enough steps: that run id is your baseline.
2. Change ONE thing under ajet/ for one hypothesis. New files ship only once tracked:
   run `git add ajet/<file>`; untracked files are left out and listed.
3. sync_train_code with dry_run=true to preview the files and diff, then
   sync_train_code with force_restart=true (or stop_engine first). A human approves every
   sync. If the result says pending_approval, show the human where to approve (its
   approval.approve_url or approval.human_command), wait for them, then call
   sync_train_code again with the same tree. You can never approve a sync yourself: when
   the server enforces approvals (engine_status.approvals_enforced) only a human approver
   with their own token can, on the server; nothing you write, run or send counts.
   While approval is pending: do not edit ajet/ (any edit needs a new approval); you may
   read_metrics, read_logs, compare_runs or keep training the approved code.
4. start_engine / start_rollouts as needed, read_metrics for as many steps as the
   baseline had, then compare_runs baseline vs new.
5. Keep the change or roll back with activate_snapshot (list_snapshots, list_runs).

Several hypotheses at once (a sweep): start_engine with a name (and config with the
fields that differ, e.g. name='rank8', config={{'lora_rank': 8}}) starts a run beside the
others, on devices of its own; one named run per value. start_rollouts with run_id=<name>
for each, list_runs(state='active') shows every run with its devices and the queue,
compare_runs compares them (and says which ran side by side); stop_engine(run_id=<name>)
stops a loser and frees its devices. A run that does not fit the free devices waits in
the queue and boots by itself. Tools given no run_id use the run you started last.

Rules: one change per iteration; sync only while the engine is OFFLINE or with
force_restart=true; stop_rollouts before stop_engine; after a failed start read the
error, read_logs, fix or roll back; judge by compare_runs, not by one noisy step.
Outputs are small: page with offsets, plot with read_metrics(plot=true).
Prompts with longer playbooks: {prompts}. Approval mode: {mode}. Rollout workflows run
in a separate process that holds no control or approver token.
"""

_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                             open_world_hint=False)
_WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                         open_world_hint=False)
_WRITE_IDEMPOTENT = ToolAnnotations(read_only_hint=False, destructive_hint=False,
                                    idempotent_hint=True, open_world_hint=False)
_DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False,
                               open_world_hint=False)
_DESTRUCTIVE_IDEMPOTENT = ToolAnnotations(read_only_hint=False, destructive_hint=True,
                                          idempotent_hint=True, open_world_hint=False)


#: The run a tool addresses; every run-taking tool has it, with the same meaning.
_RunArg = Annotated[str | None, Field(
    max_length=100,
    description="A run id or a run name (start_engine's name), or 'current' for the default "
                "run. Default: the run you started last in this session, else 'current'.")]


def prompt_files() -> dict[str, str]:
    """`{name: markdown}` of every playbook in the `agent_prompts` package (works from a wheel)."""
    out: dict[str, str] = {}
    for entry in sorted(resources.files("agent_prompts").iterdir(), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith(".md"):
            out[entry.name[:-3]] = entry.read_text(encoding="utf-8")
    return out


def build_server(bridge: Bridge) -> MCPServer:
    """An `MCPServer` whose tools drive the swarm server configured in `bridge`."""
    prompts = prompt_files()
    mcp: MCPServer = MCPServer(
        "ajet-mcp",
        title="AgentJet Swarm",
        instructions=INSTRUCTIONS.format(repo=bridge.repo, url=bridge.config.swarm_url,
                                         prompts=", ".join(prompts) or "none",
                                         mode=bridge.config.approval.value),
        version=_version(),
    )
    for name, text in prompts.items():
        mcp.add_prompt(_prompt(name, text))
    _register_tools(mcp, bridge)
    return mcp


def _prompt(name: str, text: str) -> Prompt:
    first = text.strip().splitlines()[0] if text.strip() else name
    description = first.lstrip("#").strip() or name

    def render() -> str:
        return text

    return Prompt.from_function(render, name=name, description=description)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentjet-swarm")
    except PackageNotFoundError:
        return "0.0.0"


def _register_tools(mcp: MCPServer, bridge: Bridge) -> None:  # noqa: C901 - one block per tool
    auto = bridge.config.approval is ApprovalMode.AUTO

    def done(result: _R) -> _R:
        if auto:
            result.notice = ("ajet-mcp runs with --approval auto: syncs reach the cluster "
                             "without a human review")
        return result

    # ------------------------------------------------------------------ code sync

    def make_plan() -> SyncPlan:
        # A resolver, so the question to the human and the tool body share one plan.
        return sync.plan_sync(bridge)

    def ask_human(ctx: Context, plan: Annotated[SyncPlan, Resolve(make_plan)],
                  dry_run: bool, force_restart: bool) -> Any:
        # Returns an Elicit marker when a human must be asked through the client, else
        # NotAsked: the SDK sends the question (as a request, or inside an
        # InputRequiredResult on newer protocols) and pins the answer to its exact text.
        caps = ctx.client_capabilities
        elicitation = caps.elicitation if caps is not None else None
        # Form elicitation: a bare `elicitation: {}` counts as form support (the SDK's rule);
        # a client that declared URL mode only cannot show the diff.
        can_elicit = elicitation is not None and (elicitation.form is not None
                                                  or elicitation.url is None)
        return sync.approval_question(bridge, plan, can_elicit=can_elicit, dry_run=dry_run,
                                      force_restart=force_restart) or NotAsked()

    @mcp.tool(name=ToolName.SYNC_TRAIN_CODE.value, annotations=_DESTRUCTIVE)
    def sync_train_code(
        plan: Annotated[SyncPlan, Resolve(make_plan)],
        answer: Annotated[ElicitationResult[ApproveSync], Resolve(ask_human)],
        dry_run: Annotated[bool, Field(
            description="Preview only: list the files that would change and their diff "
                        "against the code the cluster runs. Uploads nothing, asks no one.")
        ] = False,
        force_restart: Annotated[bool, Field(
            description="If the engine runs: stop it, activate the new code and restart it with "
                        "its last config. Without it the engine must be OFFLINE.")] = False,
        diff_offset: Annotated[int, Field(
            ge=0, description="Character offset into the diff; pass diff_next_offset from a "
                              "previous result to read a long diff page by page.")] = 0,
    ) -> SyncResult:
        """Sync the git-tracked files under ajet/ of the local repository to the cluster.

        Only git-tracked files ship (uncommitted edits included); untracked files are
        listed in untracked_left_out. Every sync needs a human's approval, which you cannot
        give. On a server that enforces approvals the code is uploaded and stored as
        pending; the result is status='pending_approval' with approval.approve_url (the web
        console) and approval.human_command for the human approver. Otherwise the human is
        asked directly when the client supports it, or the result is 'pending_approval'
        with a command for the human. Call this tool again with the same tree after they
        approved. Returns the snapshot_id; the engine runs it from its next start (at once
        with force_restart=true).
        """
        return done(sync.run_sync(bridge, plan, answer, dry_run=dry_run,
                                  force_restart=force_restart, diff_offset=diff_offset))

    # ------------------------------------------------------------------ config

    configure_fn = _configure_tool(bridge, done)
    mcp.add_tool(configure_fn, name=ToolName.CONFIGURE.value, annotations=_WRITE_IDEMPOTENT)

    # ------------------------------------------------------------------ engine

    @mcp.tool(name=ToolName.START_ENGINE.value, annotations=_DESTRUCTIVE)
    def start_engine(
        force_restart: Annotated[bool, Field(
            description="Stop the running run first (the default run, or the active run "
                        "with this name), then start a new one.")] = False,
        wait_s: Annotated[float | None, Field(
            ge=0, le=600, description="Seconds to wait for ENGINE.ROLLING before returning "
                                      "(default: the bridge's setting, 120).")] = None,
        name: Annotated[str | None, Field(
            min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
            description="Start a run BESIDE the ones running, under this name (unique among "
                        "active runs), e.g. 'rank8'; pass it as run_id to the other tools. "
                        "Omit for the single default run.")] = None,
        config: Annotated[dict[str, Any] | None, Field(
            description="For a named run: the job fields that differ from the stored config, "
                        "e.g. {'lora_rank': 8}; omit to use the stored config as it is.")
                          ] = None,
        snapshot_id: Annotated[str | None, Field(
            max_length=80, description="For a named run: the code snapshot (id or prefix from "
                                       "list_snapshots, or 'server'); default: the active "
                                       "one.")] = None,
        queue: Annotated[bool, Field(
            description="For a named run: wait in the queue while the devices it needs are "
                        "busy (it boots by itself later); false: refuse instead.")] = True,
    ) -> StartResult:
        """Start a training run and return its run_id (and name).

        Without a name: the default run, with the current config on the active code
        snapshot (one at a time; force_restart replaces it). With a name (and optionally
        config and snapshot_id): a concurrent run on device slots of its own, so several
        hypotheses train at once. A SWEEP is one named run per value, e.g. start_engine
        name='rank8' config={'lora_rank': 8}, then name='rank16' config={'lora_rank': 16};
        then start_rollouts run_id=<name> for each, list_runs state='active',
        compare_runs, and stop_engine run_id=<name> for the losers. A run that does not
        fit the free devices is queued (queue_position, queue_reason) and boots when
        devices free up. Waits a bounded time for ENGINE.ROLLING; if the engine dies
        while booting, the error carries the reason and the log tail.
        """
        return done(tools.start_engine(bridge, force_restart=force_restart, wait_s=wait_s,
                                       name=name, config=config, snapshot_id=snapshot_id,
                                       queue=queue))

    @mcp.tool(name=ToolName.STOP_ENGINE.value, annotations=_DESTRUCTIVE_IDEMPOTENT)
    def stop_engine(
        reason: Annotated[str, Field(max_length=500, description="Why, for the run's record.")
                          ] = "stopped by the research agent",
        stop_rollouts: Annotated[bool, Field(
            description="Also stop this bridge's rollout workers of that run first.")] = True,
        run_id: _RunArg = None,
    ) -> StopResult:
        """Stop a run (it ends and keeps its metrics; its devices go to the next queued
        run; a queued run leaves the queue). Default: the run you started last, else the
        default run. In a sweep, stop the losers by name. Idempotent."""
        return done(tools.stop_engine(bridge, reason=reason, stop_rollouts=stop_rollouts,
                                      run_id=run_id))

    @mcp.tool(name=ToolName.ENGINE_STATUS.value, annotations=_READ_ONLY)
    def engine_status(run_id: _RunArg = None) -> EngineStatusResult:
        """A run's engine state (ENGINE.OFFLINE/BOOTING/ROLLING/...), run id and step, code
        snapshot, devices or queue position, the last error with its log tail; this
        bridge's running rollouts and pending approvals. Default: the run you started last,
        else the default run; list_runs state='active' shows every run at once."""
        return done(tools.engine_status(bridge, run_id=run_id))

    # ------------------------------------------------------------------ runs

    @mcp.tool(name=ToolName.READ_METRICS.value, annotations=_READ_ONLY, structured_output=True)
    def read_metrics(
        run_id: _RunArg = None,
        metrics: Annotated[list[str] | None, Field(
            description="Metric names, e.g. reward_mean, success_rate, loss, kl, entropy, "
                        "response_length, tokens_per_s, or 'log/<name>' from workflows. "
                        "Default: reward_mean, success_rate, loss, response_length.")] = None,
        last_n: Annotated[int, Field(ge=1, le=500,
                                     description="Steps the trend covers.")] = 20,
        plot: Annotated[bool, Field(
            description="Also return a PNG plot of these metrics over the whole run.")] = False,
    ) -> Annotated[CallToolResult, MetricsResult]:
        """Training metrics of a run: the latest step's values, each metric's trend (first,
        last, min, max, mean, direction) over the last N steps, and optionally a plot. In a
        sweep, read each run by its name (run_id=<name>), or compare_runs them."""
        result, png = tools.read_metrics(bridge, run_id=run_id, metrics=metrics,
                                         last_n=last_n, plot=plot)
        result = done(result)
        content: list[ContentBlock] = [
            TextContent(type="text", text=result.model_dump_json(indent=1))]
        if png is not None:
            content.append(ImageContent(type="image", mime_type="image/png",
                                        data=base64.b64encode(png).decode()))
        return CallToolResult(content=content, structured_content=result.model_dump(mode="json"))

    @mcp.tool(name=ToolName.READ_LOGS.value, annotations=_READ_ONLY)
    def read_logs(
        run_id: _RunArg = None,
        tail: Annotated[int, Field(ge=1, le=500, description="How many last lines.")] = 50,
        grep: Annotated[str | None, Field(
            max_length=200, description="Only lines containing this text, e.g. "
                                        "'Traceback'.")] = None,
        regex: Annotated[bool, Field(
            description="Treat grep as a regular expression (Python syntax), e.g. "
                        "'Traceback|Error'; the server stops a search that takes too "
                        "long.")] = False,
    ) -> LogsResult:
        """The last lines of a run's engine log (boot, steps, tracebacks), optionally filtered."""
        return done(tools.read_logs(bridge, run_id=run_id, tail=tail, grep=grep, regex=regex))

    @mcp.tool(name=ToolName.LIST_RUNS.value, annotations=_READ_ONLY)
    def list_runs(
        state: Annotated[Literal["active", "ended", "all"] | None, Field(
            description="'active': the runs running or queued now (a sweep in progress), "
                        "with devices and queue positions; 'ended': finished ones; default: "
                        "all.")] = None,
        experiment_name: Annotated[str | None, Field(description="Only this experiment.")] = None,
        status: Annotated[Literal["queued", "booting", "running", "ended", "failed"] | None,
                          Field(description="Only runs in this status.")] = None,
        offset: Annotated[int, Field(ge=0, description="Skip this many (use next_offset).")] = 0,
        limit: Annotated[int, Field(ge=1, le=30, description="Rows per page.")] = 10,
    ) -> RunsResult:
        """Training runs, newest first: run id and name, status, snapshot, steps, reward
        last/best, the devices each active run holds and each queued run's position; and
        the server's device pool (total, free, held per run, queue). Several named runs
        run at once (start_engine with a name): this is where a sweep is watched."""
        return done(tools.list_runs(bridge, state=state, experiment_name=experiment_name,
                                    status=status, offset=offset, limit=limit))

    @mcp.tool(name=ToolName.LIST_CHECKPOINTS.value, annotations=_READ_ONLY)
    def list_checkpoints(
        run_id: _RunArg = None,
    ) -> CheckpointsResult:
        """A run's checkpoints (name, step, size, complete or not) and the command a person
        runs to download one; the weights never pass through this conversation."""
        return done(tools.list_checkpoints(bridge, run_id=run_id))

    @mcp.tool(name=ToolName.COMPARE_RUNS.value, annotations=_READ_ONLY)
    def compare_runs(
        run_ids: Annotated[list[str] | None, Field(
            max_length=6, description="Two to six run ids or names from list_runs; default: "
                                      "the active runs (your sweep).")] = None,
        metric: Annotated[str, Field(description="The metric that judges the runs.")
                          ] = "reward_mean",
    ) -> CompareResult:
        """Compare runs: code snapshot and config fields that differ, the metric's
        first/last/best, when and on which devices each ran, and which pairs ran side by
        side (overlapping in time, so under the same conditions). Use it to judge a change
        against its baseline, or the runs of a sweep against each other."""
        return done(tools.compare_runs(bridge, run_ids, metric=metric))

    # ------------------------------------------------------------------ snapshots

    @mcp.tool(name=ToolName.LIST_SNAPSHOTS.value, annotations=_READ_ONLY)
    def list_snapshots(
        limit: Annotated[int, Field(ge=1, le=50, description="Newest N snapshots.")] = 10,
    ) -> SnapshotsResult:
        """Code snapshots stored on the server, newest first, and which one is active."""
        return done(tools.list_snapshots(bridge, limit=limit))

    @mcp.tool(name=ToolName.ACTIVATE_SNAPSHOT.value, annotations=_DESTRUCTIVE_IDEMPOTENT)
    def activate_snapshot(
        snapshot_id: Annotated[str, Field(
            min_length=1, max_length=64,
            description="A snapshot id (or unique prefix) from list_snapshots / list_runs, or "
                        "'server' for the server's own installed code.")],
        force_restart: Annotated[bool, Field(
            description="If the engine runs: stop it, switch, restart with the last config.")
                                 ] = False,
    ) -> ActivateResult:
        """Roll back (or forward) to code already on the server; no upload, no new approval.
        On a server that enforces approvals only an approved snapshot (or 'server') can be
        activated; a pending one waits for a human approver."""
        return done(tools.activate_snapshot(bridge, snapshot_id, force_restart=force_restart))

    # ------------------------------------------------------------------ rollouts

    @mcp.tool(name=ToolName.START_ROLLOUTS.value, annotations=_WRITE)
    def start_rollouts(
        workflow: Annotated[str, Field(
            description="'package.module:function' importable from the repository root, or "
                        "'path/to/file.py:function' inside it; the module also defines TASKS "
                        "(a list of dicts with a task_id) or tasks().")],
        n_workers: Annotated[int, Field(ge=1, le=64, description="Concurrent local workers.")] = 4,
        num_repeat: Annotated[int | None, Field(
            ge=1, le=1024, description="Episodes per task (GRPO group); default: the config's "
                                       "num_repeat.")] = None,
        max_episodes: Annotated[int | None, Field(
            ge=1, description="Stop after this many episodes; default: run until stopped.")] = None,
        run_id: _RunArg = None,
    ) -> RolloutStartResult:
        """Run a workflow on this laptop against the cluster in the background: each worker
        claims an episode from the run, runs the workflow with the episode's OpenAI
        endpoint, and reports the reward. Episodes belong to one run (their keys work only
        there): in a sweep, start rollouts once per run, run_id=<name>. Returns a handle
        for rollout_status / stop_rollouts."""
        return done(tools.start_rollouts(bridge, workflow, n_workers=n_workers,
                                         num_repeat=num_repeat, max_episodes=max_episodes,
                                         run_id=run_id))

    @mcp.tool(name=ToolName.ROLLOUT_STATUS.value, annotations=_READ_ONLY)
    def rollout_status(
        handle: Annotated[str | None, Field(description="One handle; default: all.")] = None,
    ) -> RolloutStatusResult:
        """Progress of rollout workers started by start_rollouts (episodes, rewards, errors)."""
        return done(tools.rollout_status(bridge, handle=handle))

    @mcp.tool(name=ToolName.STOP_ROLLOUTS.value, annotations=_WRITE_IDEMPOTENT)
    def stop_rollouts(
        handle: Annotated[str | None, Field(description="One handle; default: all running.")
                          ] = None,
    ) -> RolloutStopResult:
        """Stop rollout workers (in-flight episodes are aborted and re-queued). Idempotent."""
        return done(tools.stop_rollouts(bridge, handle=handle))


def _configure_tool(bridge: Bridge, done: Callable[[ConfigureResult], ConfigureResult]
                    ) -> Callable[..., ConfigureResult]:
    """The `configure` tool, with one optional parameter per `AgentJetJob` field.

    Built from the job model so the parameters always match the installed schema; the
    server still validates with the active snapshot's own schema (`extra` reaches fields
    a synced schema added).
    """
    job_fields = AgentJetJob.model_fields

    def configure(**kwargs: Any) -> ConfigureResult:
        extra = kwargs.pop("extra", None) or {}
        reset = bool(kwargs.pop("reset", False))
        changes = {k: v for k, v in kwargs.items() if v is not None and k in job_fields}
        changes.update(extra)  # the server names any field its schema does not know
        return done(tools.configure(bridge, changes, reset=reset))

    params: list[inspect.Parameter] = []
    annotations: dict[str, Any] = {}
    for name, info in job_fields.items():
        ann = _optional_param(info.annotation, (info.description or name.replace("_", " "))
                              + "; omit to keep the current value.")
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=ann))
        annotations[name] = ann
    extra_ann = Annotated[dict[str, Any] | None, Field(
        description="Fields not listed above (e.g. added by synced code), as {name: value}.")]
    reset_ann = Annotated[bool, Field(
        description="Start from the defaults instead of the current config.")]
    params.append(inspect.Parameter("extra", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=extra_ann))
    params.append(inspect.Parameter("reset", inspect.Parameter.KEYWORD_ONLY, default=False,
                                    annotation=reset_ann))
    annotations.update(extra=extra_ann, reset=reset_ann, **{"return": ConfigureResult})
    signature = inspect.Signature(params, return_annotation=ConfigureResult)
    configure.__signature__ = signature  # type: ignore[attr-defined]
    configure.__annotations__ = annotations
    configure.__doc__ = (
        "Set the training job's config (only while the engine is OFFLINE). Pass only the "
        "fields to change; the rest keep their current values. The server validates the whole "
        "job and names any bad field. Returns what changed. Then call start_engine."
    )
    return configure


def _optional_param(tp: Any, description: str) -> Any:
    # Built at run time from the job model's field types.
    return Annotated[tp | None, Field(description=description)]
