"""The `sync_train_code` flow: plan what would change, get a human's approval, push.

1. `plan_sync` packages the git-tracked `ajet/` tree (`ajet.packaging`), asks the server
   which blobs it lacks (`POST /code/manifest`, which writes nothing) and builds the review
   with `ajet.code_review` (the one function the server, the CLIs and the console use):
   the local bytes that would be uploaded (each re-hashed) against the server's own stored
   files of the code it runs, the active snapshot (`GET /code`, `GET /code/blobs/...`) or
   the server's own `ajet/` (`GET /code/server`, `GET /code/server/blobs/...`). Never
   against `git diff HEAD`, which a commit or a `.gitattributes` line can empty.
2. Against a server that **enforces approvals** (approver tokens; `engine_status` says so)
   the bridge cannot approve anything: a sync uploads, the server stores the snapshot as
   pending, and the result is `pending_approval` with where the human approves (the web
   console URL, or `ajet-swarm approvals approve ID` with their approver token). Where the
   client supports elicitation, the human is shown the diff computed from the *server's*
   stored files and asked to continue once they approved it there.
3. Against a server without approvers (laptop-side approval, a convenience that stops only
   an agent without shell or file tools): `approval_question` asks through MCP
   elicitation when the whole diff fits the question, else `decide` files a pending
   approval that the human reads in full and confirms with `ajet-mcp approvals approve`.
   A live approval of exactly this snapshot id on this server, an accepted elicitation,
   or `--approval auto` lets the push go ahead; otherwise nothing is uploaded.

`decide` holds the laptop-side rules as a plain function, tested without MCP.
"""

from __future__ import annotations

import enum
import logging
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from mcp.server.mcpserver.resolve import AcceptedElicitation, Elicit, ElicitationResult
from pydantic import BaseModel, Field

from ajet.client import SwarmClient
from ajet.code_review import (
    FileChange,
    Review,
    build_review,
    compare_manifests,
    escape_text,
    summarize_changes,
)
from ajet.code_sync import push_package
from ajet.errors import ApprovalPending
from ajet.packaging import Package, package_tree
from ajet.protocol import (
    SERVER_CODE,
    ApprovalState,
    CodeSyncResult,
    EngineState,
    EngineStatus,
    FileEntry,
    SnapshotApproval,
)
from mcp_bridge.approvals import (
    Approval,
    LaptopApprovalStatus,
    ApprovalStore,
    default_approvals_dir,
    human_identity,
)
from mcp_bridge.bridge import Bridge, swarm_errors, tool_error
from mcp_bridge.models import ApprovalInfo, ApprovalMode, SyncApprovalStatus
from mcp_bridge.models import SyncResult, ToolName

__all__ = [
    "ApproveSync",
    "Decision",
    "NotAsked",
    "SyncPlan",
    "Verdict",
    "approval_question",
    "approve_command",
    "console_url",
    "decide",
    "plan_sync",
    "push_plan",
    "run_sync",
    "server_approve_command",
]

log = logging.getLogger(__name__)

#: Diff characters per tool result page; keeps the result well under 8 KB.
PAGE_DIFF_CHARS = 3000
#: Diff characters shown to the human in an elicitation. A laptop-side approval is asked
#: there only when the whole diff fits; a longer one is filed for `ajet-mcp approvals show`.
ELICIT_DIFF_CHARS = 20_000
_LIST_CAP = 25

Reader = Callable[[FileEntry], bytes]


class ApproveSync(BaseModel):
    """The form a human fills in to approve one sync (MCP elicitation)."""

    approve: bool = Field(description="Go ahead with exactly this snapshot (on a server that "
                                      "enforces approvals: once you approved it there)")


@dataclass(frozen=True)
class NotAsked:
    """The approval resolver's answer when no human was asked during this call."""


@dataclass(frozen=True)
class SyncPlan:
    """What a sync of the local tree would do right now."""

    package: Package
    running_snapshot_id: str
    changes: list[FileChange]
    missing: list[str]  # sha256 of blobs the server lacks
    bytes_to_upload: int
    engine_state: EngineState
    server_url: str
    diff: str  # the whole review, escaped
    #: what the diff compares with: the active (approved) snapshot, or 'server'
    base_id: str = SERVER_CODE
    #: the server enforces approvals (approver tokens): only an approver can approve
    enforced: bool = False
    #: the server's approval of this content, if it already stores it
    server_approval: SnapshotApproval | None = None
    flagged: tuple[str, ...] = field(default_factory=tuple)

    @property
    def snapshot_id(self) -> str:
        return self.package.snapshot_id

    @property
    def unchanged(self) -> bool:
        return self.snapshot_id == self.running_snapshot_id

    def change_lists(self) -> dict[str, list[str]]:
        return summarize_changes(self.changes)

    def summary(self, *, force_restart: bool = False) -> str:
        """A few lines for a human: what, from where, to where, how much."""
        prov = self.package.provenance
        lists = self.change_lists()
        head = (prov.git_head or "no commit")[:10] + (" +uncommitted edits" if prov.dirty else "")
        base = ("the server's own ajet/" if self.base_id == SERVER_CODE
                else f"snapshot {self.base_id[:16]}")
        lines = [
            f"Sync ajet/ from {self.package.root} (the client claims git {head}, branch "
            f"{escape_text(prov.branch or '-')})",
            f"to {self.server_url}: snapshot {self.snapshot_id[:16]} replaces "
            f"{self.running_snapshot_id[:16]}"
            + (" and the running engine restarts" if force_restart
               and self.engine_state != EngineState.OFFLINE else "") + ".",
            f"Diff against {base} (the server's stored files): "
            f"{len(lists['added'])} added, {len(lists['changed'])} changed, "
            f"{len(lists['removed'])} removed, {len(lists['renamed'])} renamed; "
            f"{len(self.missing)} blob(s), {self.bytes_to_upload} bytes to upload.",
        ]
        for kind in ("added", "changed", "removed", "renamed"):
            if lists[kind]:
                shown = lists[kind][:_LIST_CAP]
                extra = len(lists[kind]) - len(shown)
                more = f" (+{extra} more)" if extra else ""
                lines.append(f"{kind.capitalize()}: {', '.join(map(escape_text, shown))}{more}")
        if self.flagged:
            lines.append("FLAGGED (look closely): " + "; ".join(self.flagged[:_LIST_CAP]))
        if self.package.untracked_left_out:
            left_out = self.package.untracked_left_out[:_LIST_CAP]
            lines.append("Untracked, NOT shipped: " + ", ".join(map(escape_text, left_out)))
        return "\n".join(lines)


class Verdict(str, enum.Enum):
    PROCEED = "proceed"
    PENDING = "pending"
    DENIED = "denied"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    status: SyncApprovalStatus
    approved_by: str = ""  # set when the verdict is PROCEED; sent to the server
    approval: Approval | None = None  # the stored approval this decision rests on, if any


# ---------------------------------------------------------------------------- plan


def plan_sync(bridge: Bridge) -> SyncPlan:
    """Package the repo's `ajet/` and work out what a sync would change on the cluster."""
    client = bridge.client
    with swarm_errors(f"fix the tree, then call {ToolName.SYNC_TRAIN_CODE} again"):
        package = package_tree(bridge.repo)
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}, then {ToolName.SYNC_TRAIN_CODE} again"):
        status = client.engine_status()
        answer = client.check_manifest(package.entries(), package.provenance)
        base_id, old_entries, read_old = review_base(client, status)
        changes = compare_manifests(package.entries(), old_entries)
        review = build_review(changes, read_new=lambda e: package.read_blob(e.sha256),
                              read_old=read_old)
    sizes = {f.sha256: f.size for f in package.files}
    missing = list(dict.fromkeys(answer.missing))
    return SyncPlan(
        package=package,
        running_snapshot_id=status.snapshot_id,
        changes=changes,
        missing=missing,
        bytes_to_upload=sum(sizes.get(sha, 0) for sha in missing),
        engine_state=answer.state or status.state,
        server_url=bridge.config.swarm_url,
        diff=review.text(),
        base_id=base_id,
        enforced=status.approvals_enforced,
        server_approval=answer.approval,
        flagged=_flag_lines(review),
    )


def review_base(client: SwarmClient, status: EngineStatus
                ) -> tuple[str, list[FileEntry], Reader]:
    """(id, manifest, reader) of what a sync is compared with, from the server's files.

    The active snapshot, unless the server enforces approvals and it is not approved (then
    the server's own `ajet/`, as the server's own review does, so unreviewed code never
    serves as the base); the server's own code when no snapshot is active.
    """
    active = status.snapshot_id
    if active != SERVER_CODE and (not status.approvals_enforced
                                  or status.snapshot_approval is ApprovalState.APPROVED):
        code = client.get_active_code()
        if code is not None and code.files is not None:
            return code.snapshot_id, list(code.files), lambda e: client.get_blob(e.sha256)
    server = client.get_server_code()
    return SERVER_CODE, list(server.files), lambda e: client.get_server_blob(e.sha256)


def server_review(bridge: Bridge, plan: SyncPlan) -> Review:
    """The review of the snapshot as the server stores it (its manifest and blobs)."""
    client = bridge.client
    stored = client.get_snapshot(plan.snapshot_id)
    status = client.engine_status()
    _, old_entries, read_old = review_base(client, status)
    return build_review(compare_manifests(stored.files or [], old_entries),
                        read_new=lambda e: client.get_blob(e.sha256), read_old=read_old)


def _flag_lines(review: Review) -> tuple[str, ...]:
    return tuple(f"{escape_text(f.path)}: {', '.join(f.flags)}" for f in review.flagged)


# ---------------------------------------------------------------------------- approval


def approve_command(store: ApprovalStore, approval_id: str) -> str:
    """The exact shell command a human runs to approve (names the folder if not default)."""
    cmd = ["ajet-mcp", "approvals", "approve", approval_id]
    if store.root.resolve() != default_approvals_dir().resolve():
        cmd[2:2] = ["--approvals-dir", str(store.root)]
    return shlex.join(cmd)


def server_approve_command(snapshot_id: str) -> str:
    """What an approver runs on an enforcing server (with their AJET_SWARM_APPROVER_TOKEN)."""
    return f"ajet-swarm approvals approve {snapshot_id}"


def console_url(bridge: Bridge, snapshot_id: str) -> str:
    """The web console page where an approver reviews and approves this snapshot."""
    return f"{bridge.config.swarm_url}/ui/snapshots/{snapshot_id}"


def _where_to_approve(bridge: Bridge, snapshot_id: str) -> str:
    return (f"an approver opens {console_url(bridge, snapshot_id)} (web console), or runs "
            f"`{server_approve_command(snapshot_id)}` with their own AJET_SWARM_APPROVER_TOKEN")


def approval_question(bridge: Bridge, plan: SyncPlan, *, can_elicit: bool, dry_run: bool,
                      force_restart: bool) -> Elicit[ApproveSync] | None:
    """The elicitation to send now, or None when no human is asked in this call."""
    if dry_run or plan.unchanged or not can_elicit:
        return None
    if plan.enforced:
        return _enforced_question(bridge, plan, force_restart=force_restart)
    if bridge.config.approval is not ApprovalMode.ASK:
        return None
    if plan.engine_state != EngineState.OFFLINE and not force_restart:
        return None  # run_sync refuses before anyone is bothered
    if bridge.approvals.find_valid(plan.snapshot_id, plan.server_url) is not None:
        return None
    if len(plan.diff) > ELICIT_DIFF_CHARS:
        return None  # never ask on part of a diff: decide() files it for `approvals show`
    message = (f"An AI agent asks to upload code to the training cluster.\n\n"
               f"{plan.summary(force_restart=force_restart)}\n"
               f"Snapshot id: {plan.snapshot_id}\n\n{plan.diff}")
    return Elicit(message, ApproveSync)


def _enforced_question(bridge: Bridge, plan: SyncPlan, *, force_restart: bool
                       ) -> Elicit[ApproveSync] | None:
    """Upload for review, then show the human the server-side diff and where to approve."""
    approval = plan.server_approval
    if approval is not None and approval.state is not ApprovalState.PENDING:
        return None  # approved: run_sync activates it; denied/revoked: run_sync says so
    with swarm_errors(f"call {ToolName.SYNC_TRAIN_CODE} again"):
        stored = push_package(bridge.client, plan.package, force_restart=force_restart,
                              activate=False)
        if stored.approval is not None and stored.approval.state is not ApprovalState.PENDING:
            return None
        review = server_review(bridge, plan)
    text = review.text()
    shown = text[:ELICIT_DIFF_CHARS]
    if len(shown) < len(text):
        rest = text[len(shown):].count("\n")
        shown += (f"\n... {rest} more line(s) of the diff are not shown here: read them all "
                  f"at {console_url(bridge, plan.snapshot_id)}\n")
    message = (f"An AI agent uploaded code to the training cluster. The server stores it as "
               f"snapshot {plan.snapshot_id} and will not run it until an approver approves "
               f"it: {_where_to_approve(bridge, plan.snapshot_id)}. The agent cannot approve "
               f"it. Approve it there, then answer here to let the agent continue.\n\n"
               f"{plan.summary(force_restart=force_restart)}\n\n"
               f"Diff computed from the server's stored files ({review.summary()}):\n{shown}")
    return Elicit(message, ApproveSync)

def decide(*, mode: ApprovalMode, store: ApprovalStore, plan: SyncPlan,
           elicited: ElicitationResult[ApproveSync] | None, repo: str) -> Decision:
    """Whether a non-preview sync of `plan` may upload now. No side effects but filing.

    Order: an explicit human answer in this call wins (accept+approve proceeds, anything
    else refuses); then a live approval of exactly this snapshot on this server; then
    `auto`; else a pending approval is filed (or a recent denial of this content stands).
    """
    if elicited is not None:
        if (isinstance(elicited, AcceptedElicitation) and isinstance(elicited.data, ApproveSync)
                and elicited.data.approve):
            return Decision(Verdict.PROCEED, "elicited",
                            approved_by=f"{human_identity()} via MCP elicitation")
        return Decision(Verdict.DENIED, "declined")
    live = store.find_valid(plan.snapshot_id, plan.server_url)
    if live is not None:
        return Decision(Verdict.PROCEED, "approved",
                        approved_by=f"{live.decided_by} (approval {live.id})", approval=live)
    if mode is ApprovalMode.AUTO:
        return Decision(Verdict.PROCEED, "auto_approved",
                        approved_by="auto (ajet-mcp --approval auto)")
    latest = store.latest_for(plan.snapshot_id, plan.server_url)
    if latest is not None and latest.status is LaptopApprovalStatus.DENIED \
            and not latest.expired(time.time()):
        return Decision(Verdict.DENIED, "denied", approval=latest)
    lists = plan.change_lists()
    filed = store.request(
        snapshot_id=plan.snapshot_id, server_url=plan.server_url, repo=repo,
        summary=plan.summary(), diff=plan.diff, files=lists, bytes_to_upload=plan.bytes_to_upload,
    )
    return Decision(Verdict.PENDING, "pending", approval=filed)


# ---------------------------------------------------------------------------- run


def run_sync(bridge: Bridge, plan: SyncPlan, answer: ElicitationResult[Any] | None, *,
             dry_run: bool, force_restart: bool, diff_offset: int = 0) -> SyncResult:
    """The tool's body: preview, refuse, file a pending approval, or push."""
    elicited = None
    if answer is not None and not (isinstance(answer, AcceptedElicitation)
                                   and isinstance(answer.data, NotAsked)):
        elicited = answer
    mode = bridge.config.approval
    base = _result_fields(plan, diff_offset)
    if dry_run:
        status: Literal["no_changes", "preview"] = "no_changes" if plan.unchanged else "preview"
        if plan.unchanged:
            next_call = f"nothing to sync. Next: {ToolName.START_ENGINE} or edit ajet/"
        else:
            restart = ("" if plan.engine_state == EngineState.OFFLINE
                       else " and with force_restart=true")
            next_call = (f"Next: call {ToolName.SYNC_TRAIN_CODE} without dry_run{restart} to "
                         "upload (a human approves)")
        return SyncResult(message=f"Preview of snapshot {plan.snapshot_id[:16]}; {next_call}.",
                          status=status, **base)
    if plan.unchanged:
        return SyncResult(
            message=(f"The cluster already runs snapshot {plan.snapshot_id[:16]}; nothing "
                     f"uploaded. Next: {ToolName.START_ENGINE} (force_restart=true for a fresh "
                     "run), or edit ajet/."),
            status="no_changes", **base)
    if plan.engine_state != EngineState.OFFLINE and not force_restart:
        raise tool_error(
            f"the engine is {plan.engine_state}; code can change only while it is OFFLINE. "
            "Nothing was uploaded",
            f"call {ToolName.SYNC_TRAIN_CODE} with force_restart=true, or "
            f"{ToolName.STOP_ENGINE} first",
        )
    if plan.enforced:
        return _run_enforced(bridge, plan, elicited, force_restart=force_restart, base=base)
    decision = decide(mode=mode, store=bridge.approvals, plan=plan, elicited=elicited,
                      repo=str(bridge.repo))
    approval = decision.approval
    if decision.verdict is Verdict.DENIED:
        if approval is None:  # declined in the client during this call
            raise tool_error(
                f"the human declined the sync of snapshot {plan.snapshot_id[:16]}; nothing was "
                "uploaded",
                "ask the human what to change; edit ajet/ and call sync_train_code again "
                "(dry_run=true to preview)",
            )
        raise tool_error(
            f"the human denied approval {approval.id} for exactly this content "
            f"(snapshot {plan.snapshot_id[:16]}); nothing was uploaded",
            "ask the human why; change the code under ajet/, then call sync_train_code again",
        )
    if decision.verdict is Verdict.PENDING and approval is not None:
        command = approve_command(bridge.approvals, approval.id)
        return SyncResult(
            message=(f"Nothing was uploaded: snapshot {plan.snapshot_id[:16]} needs a human's "
                     f"approval. Ask the human to review and run: {command} . You cannot approve "
                     f"it yourself. Next: after they approve, call {ToolName.SYNC_TRAIN_CODE} "
                     "again with the same tree (any edit needs a new approval)."),
            status="pending_approval",
            approval=ApprovalInfo(mode=mode, status="pending", approval_id=approval.id,
                                  human_command=command, expires_at=_iso(approval.expires_at)),
            **base,
        )
    # Verdict.PROCEED
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}, then {ToolName.SYNC_TRAIN_CODE} again"):
        outcome = push_plan(bridge, plan, approved_by=decision.approved_by,
                            force_restart=force_restart)
    if approval is not None:
        bridge.approvals.mark_used(approval.id)
    base["engine_state"] = outcome.state.value
    if outcome.restarted:
        bridge.last_run = None  # the default run restarted: the tools follow it again
        next_call = f"{ToolName.ENGINE_STATUS} until ENGINE.ROLLING, then {ToolName.START_ROLLOUTS}"
    elif outcome.state == EngineState.OFFLINE:
        next_call = f"{ToolName.START_ENGINE}"
    else:
        next_call = f"{ToolName.ENGINE_STATUS}"
    note = " (auto-approved: no human reviewed it)" if decision.status == "auto_approved" else ""
    return SyncResult(
        message=(f"Synced snapshot {outcome.snapshot_id[:16]}{note}: {outcome.bytes_uploaded} "
                 f"bytes uploaded, active={outcome.activated}, restarted={outcome.restarted}. "
                 f"Next: {next_call}."),
        status="synced",
        approval=ApprovalInfo(mode=mode, status=decision.status,
                              approval_id=approval.id if approval else None,
                              approved_by=decision.approved_by),
        server_path=outcome.path, bytes_uploaded=outcome.bytes_uploaded,
        restarted=outcome.restarted, run_id=outcome.run_id,
        **base,
    )


def _run_enforced(bridge: Bridge, plan: SyncPlan, elicited: ElicitationResult[Any] | None, *,
                  force_restart: bool, base: dict[str, Any]) -> SyncResult:
    """Against an enforcing server: upload, let the server decide, report where to approve."""
    mode = bridge.config.approval
    sid = plan.snapshot_id
    if elicited is not None and not (isinstance(elicited, AcceptedElicitation)
                                     and isinstance(elicited.data, ApproveSync)
                                     and elicited.data.approve):
        raise tool_error(
            f"the human declined to go ahead with snapshot {sid[:16]} (the server keeps it, "
            "pending: it does not run unless an approver approves it)",
            "ask the human what to change; edit ajet/ and call sync_train_code again")
    pending: ApprovalPending | None = None
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}, then {ToolName.SYNC_TRAIN_CODE} again"):
        try:
            outcome = push_package(bridge.client, plan.package, force_restart=force_restart)
        except ApprovalPending as exc:  # stored, not activated: the expected answer
            pending = exc
    where = _where_to_approve(bridge, sid)
    if pending is not None:
        if pending.approval_state != ApprovalState.PENDING.value:
            raise tool_error(
                f"an approver {pending.approval_state} snapshot {sid[:16]} on the server; it "
                "never runs. Nothing was activated",
                "ask the human why; change the code under ajet/, then call sync_train_code "
                "again (new content is a new snapshot)")
        return SyncResult(
            message=(f"Uploaded; the server stores snapshot {sid[:16]} and will not run it until "
                     f"a human approver approves it: {where}. You cannot approve it (no tool or "
                     f"token of yours can). Ask the human to review it there. Next: once they "
                     f"approved, call {ToolName.SYNC_TRAIN_CODE} again with the same tree "
                     f"(force_restart=true to restart a running engine on it); meanwhile "
                     f"{ToolName.ENGINE_STATUS} shows the approval state."),
            status="pending_approval",
            approval=ApprovalInfo(mode=mode, status="pending", enforced_by_server=True,
                                  human_command=server_approve_command(sid),
                                  approve_url=console_url(bridge, sid)),
            **base)
    base["engine_state"] = outcome.state.value
    if outcome.restarted:
        bridge.last_run = None  # the default run restarted: the tools follow it again
    approver = outcome.approval.approver if outcome.approval else None
    next_call = (f"{ToolName.ENGINE_STATUS} until ENGINE.ROLLING, then {ToolName.START_ROLLOUTS}"
                 if outcome.restarted else str(ToolName.START_ENGINE))
    return SyncResult(
        message=(f"Synced snapshot {outcome.snapshot_id[:16]}, approved on the server by "
                 f"{approver or 'an approver'}: {outcome.bytes_uploaded} bytes uploaded, "
                 f"restarted={outcome.restarted}. Next: {next_call}."),
        status="synced",
        approval=ApprovalInfo(mode=mode, status="approved", enforced_by_server=True,
                              approved_by=approver),
        server_path=outcome.path, bytes_uploaded=outcome.bytes_uploaded,
        restarted=outcome.restarted, run_id=outcome.run_id, **base)


def push_plan(bridge: Bridge, plan: SyncPlan, *, approved_by: str,
              force_restart: bool) -> CodeSyncResult:
    """Upload the blobs the server lacked at plan time and commit the planned manifest."""
    return push_package(bridge.client, plan.package, force_restart=force_restart,
                        approved_by=approved_by)


def _result_fields(plan: SyncPlan, diff_offset: int) -> dict[str, Any]:
    lists = plan.change_lists()
    page = plan.diff[diff_offset:diff_offset + PAGE_DIFF_CHARS]
    end = diff_offset + len(page)
    truncated = any(len(v) > _LIST_CAP for v in lists.values())
    return {
        "snapshot_id": plan.snapshot_id,
        "running_snapshot_id": plan.running_snapshot_id,
        "files_total": len(plan.package.files),
        "added": lists["added"][:_LIST_CAP],
        "changed": lists["changed"][:_LIST_CAP],
        "removed": lists["removed"][:_LIST_CAP],
        "renamed": lists["renamed"][:_LIST_CAP],
        "flagged": list(plan.flagged[:_LIST_CAP]),
        "lists_truncated": truncated,
        "untracked_left_out": list(plan.package.untracked_left_out[:_LIST_CAP]),
        "blobs_to_upload": len(plan.missing),
        "bytes_to_upload": plan.bytes_to_upload,
        "diff": page,
        "diff_next_offset": end if end < len(plan.diff) else None,
        "engine_state": plan.engine_state.value,
    }


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")
