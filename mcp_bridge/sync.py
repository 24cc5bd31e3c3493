"""The `sync_train_code` flow: plan what would change, get a human's approval, push.

1. `plan_sync` packages the git-tracked `ajet/` tree (`ajet.packaging`), compares it
   with the manifest of the snapshot the cluster runs (`GET /code`), asks the
   server which blobs it lacks (`POST /code/manifest`, which writes nothing) and renders the
   diff, fetching old contents with `GET /code/blobs/{sha256}`.
2. `approval_question` says whether the human must be asked through MCP elicitation
   now (the SDK then asks and pins the answer to the question's exact text, which
   names the snapshot id).
3. `run_sync` decides: a live approval of exactly this snapshot id on this server, an
   accepted elicitation, or `--approval auto` lets the push go ahead; otherwise a pending
   approval is filed (or the human's refusal is reported) and nothing is uploaded.
   The push uploads the planned bytes only (each re-checked against its hash) and
   commits the planned manifest, so what reaches the cluster is what was approved.

`decide` holds the approval rules as a plain function, tested without MCP.
"""

from __future__ import annotations

import enum
import logging
import shlex
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from mcp.server.mcpserver.resolve import AcceptedElicitation, Elicit, ElicitationResult
from pydantic import BaseModel, Field

from ajet.code_sync import push_package
from ajet.packaging import Package, package_tree
from ajet.protocol import SERVER_CODE, CodeSyncResult, EngineState, FileEntry
from mcp_bridge.approvals import (
    Approval,
    ApprovalStatus,
    ApprovalStore,
    default_approvals_dir,
    human_identity,
)
from mcp_bridge.bridge import Bridge, swarm_errors, tool_error
from mcp_bridge.diffing import FileChange, compare_manifests, render_diff, summarize_changes
from mcp_bridge.models import ApprovalInfo, ApprovalMode, ApprovalState, SyncResult, ToolName

__all__ = [
    "ApproveSync",
    "Decision",
    "NotAsked",
    "SyncPlan",
    "Verdict",
    "approval_question",
    "approve_command",
    "decide",
    "plan_sync",
    "push_plan",
    "run_sync",
]

log = logging.getLogger(__name__)

#: The whole diff kept in a plan (paged to the model, stored for `approvals show`).
PLAN_DIFF_CHARS = 512 * 1024
#: Diff characters per tool result page; keeps the result well under 8 KB.
PAGE_DIFF_CHARS = 3000
#: Diff characters shown to the human in the elicitation message.
ELICIT_DIFF_CHARS = 12_000
_LIST_CAP = 25


class ApproveSync(BaseModel):
    """The form a human fills in to approve one sync (MCP elicitation)."""

    approve: bool = Field(description="Upload and activate exactly this snapshot on the cluster")


@dataclass(frozen=True)
class NotAsked:
    """The approval resolver's answer when no human was asked during this call."""


@dataclass(frozen=True)
class SyncPlan:
    """What a sync of the local tree would do right now."""

    package: Package
    running_snapshot_id: str
    running_known: bool  # False: the cluster runs its own code, whose files are unknown
    changes: list[FileChange]
    missing: list[str]  # sha256 of blobs the server lacks
    bytes_to_upload: int
    engine_state: EngineState
    server_url: str
    diff: str

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
        lines = [
            f"Sync ajet/ from {self.package.root} (git {head}, branch {prov.branch or '-'})",
            f"to {self.server_url}: snapshot {self.snapshot_id[:16]} replaces "
            f"{self.running_snapshot_id[:16]}"
            + (" and the running engine restarts" if force_restart
               and self.engine_state != EngineState.OFFLINE else "") + ".",
            f"{len(lists['added'])} added, {len(lists['changed'])} changed, "
            f"{len(lists['removed'])} removed; {len(self.missing)} blob(s), "
            f"{self.bytes_to_upload} bytes to upload.",
        ]
        if not self.running_known:
            lines.append("The cluster runs its own installed code, so every file counts as added.")
        for kind in ("added", "changed", "removed"):
            if lists[kind]:
                shown = lists[kind][:_LIST_CAP]
                extra = len(lists[kind]) - len(shown)
                more = f" (+{extra} more)" if extra else ""
                lines.append(f"{kind.capitalize()}: {', '.join(shown)}{more}")
        if self.package.untracked_left_out:
            left_out = self.package.untracked_left_out[:_LIST_CAP]
            lines.append("Untracked, NOT shipped: " + ", ".join(left_out))
        return "\n".join(lines)


class Verdict(str, enum.Enum):
    PROCEED = "proceed"
    PENDING = "pending"
    DENIED = "denied"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    status: ApprovalState
    approved_by: str = ""  # set when the verdict is PROCEED; sent to the server
    approval: Approval | None = None  # the stored approval this decision rests on, if any


# ---------------------------------------------------------------------------- plan


def plan_sync(bridge: Bridge) -> SyncPlan:
    """Package the repo's `ajet/` and work out what a sync would change on the cluster."""
    client = bridge.client
    with swarm_errors(f"fix the tree, then call {ToolName.SYNC_TRAIN_CODE} again"):
        package = package_tree(bridge.repo)
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}, then {ToolName.SYNC_TRAIN_CODE} again"):
        active = client.get_active_code()  # GET /code carries the active manifest
        answer = client.check_manifest(package.entries(), package.provenance)
        state = answer.state or client.engine_status().state
        running_files: list[FileEntry] | None = active.files if active is not None else None
        changes = compare_manifests(package.entries(), running_files)
        sizes = {f.sha256: f.size for f in package.files}
        missing = list(dict.fromkeys(answer.missing))
        if active is None:
            diff = _diff_against_head(package)
        else:
            diff = render_diff(
                changes,
                read_new=lambda e: package.read_blob(e.sha256),
                read_old=lambda e: client.get_blob(e.sha256),
                max_chars=PLAN_DIFF_CHARS,
            )
    return SyncPlan(
        package=package,
        running_snapshot_id=active.snapshot_id if active is not None else SERVER_CODE,
        running_known=active is not None,
        changes=changes,
        missing=missing,
        bytes_to_upload=sum(sizes.get(sha, 0) for sha in missing),
        engine_state=state,
        server_url=bridge.config.swarm_url,
        diff=diff,
    )


def _diff_against_head(package: Package) -> str:
    # The cluster runs its own installed ajet, whose files the API does not list: a diff
    # of every file as "added" would bury the edit, so show the local edits against HEAD.
    prov = package.provenance
    intro = (f"(The cluster runs its own installed code, whose files are not listed: all "
             f"{len(package.files)} tracked files under ajet/ would be uploaded. Below: the "
             f"local edits against git HEAD {(prov.git_head or 'none')[:12]}.)\n")
    return intro + (prov.diff or "(none: the tracked files match HEAD)\n")


# ---------------------------------------------------------------------------- approval


def approve_command(store: ApprovalStore, approval_id: str) -> str:
    """The exact shell command a human runs to approve (names the folder if not default)."""
    cmd = ["ajet-mcp", "approvals", "approve", approval_id]
    if store.root.resolve() != default_approvals_dir().resolve():
        cmd[2:2] = ["--approvals-dir", str(store.root)]
    return shlex.join(cmd)


def approval_question(bridge: Bridge, plan: SyncPlan, *, can_elicit: bool, dry_run: bool,
                      force_restart: bool) -> Elicit[ApproveSync] | None:
    """The elicitation to send now, or None when no human is asked in this call."""
    if dry_run or plan.unchanged or bridge.config.approval is not ApprovalMode.ASK:
        return None
    if not can_elicit:
        return None
    if plan.engine_state != EngineState.OFFLINE and not force_restart:
        return None  # run_sync refuses before anyone is bothered
    if bridge.approvals.find_valid(plan.snapshot_id, plan.server_url) is not None:
        return None
    diff = plan.diff[:ELICIT_DIFF_CHARS]
    if len(plan.diff) > ELICIT_DIFF_CHARS:
        diff += f"\n... diff cut here ({len(plan.diff)} characters in all)\n"
    message = (f"An AI agent asks to upload code to the training cluster.\n\n"
               f"{plan.summary(force_restart=force_restart)}\n"
               f"Snapshot id: {plan.snapshot_id}\n\n{diff}")
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
    if latest is not None and latest.status is ApprovalStatus.DENIED \
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
