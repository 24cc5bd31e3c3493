"""Routes: the approvers' review and decisions. An approver token only (`ApproverAuth`).

    GET  /approvals                          pending snapshots, recent decisions
    GET  /approvals/{ref}?offset=&limit=     one snapshot's review: the server-side diff
                                             (escaped, paged), flagged files, the
                                             client's claimed provenance, its history
    POST /approvals/{ref}/approve  {snapshot_id, note}
    POST /approvals/{ref}/deny     {snapshot_id, note}
    POST /approvals/{ref}/revoke   {snapshot_id, note}   (stops an engine running it)

`ref` of the review is a snapshot id or a unique prefix; the review answers the full id.
A decision takes the full id only, in the path and again in its body, so what is
decided is exactly what was reviewed (a prefix could name another snapshot uploaded
since). The control token is refused (403): it cannot
approve, not even read the review here (the bridge computes the same review from the
control routes). Every decision and refusal is in the audit log with the approver's name.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from ajet.protocol import (
    ApprovalDecisionPublic,
    ApprovalDecisionRequest,
    ApprovalsPage,
    ErrorBody,
    ReviewPage,
)
from ajet.errors import SwarmHTTPError, SwarmNotFound, SwarmValidationError
from swarm_server.context import ServerContext
from swarm_server.deps import ApproverAuth, Ctx
from swarm_server.ledger import SnapshotRecord

__all__ = ["decide", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/approvals", tags=["approvals"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Bad reference or confirmation"},
    401: {"model": ErrorBody, "description": "Missing or wrong token"},
    403: {"model": ErrorBody, "description": "Not an approver token (the control token "
                                             "cannot approve)"},
    404: {"model": ErrorBody, "description": "No such snapshot"},
    409: {"model": ErrorBody, "description": "The snapshot's state does not allow this "
                                             "decision"},
}
_FULL_ID = re.compile(r"[0-9a-f]{64}")
SnapshotRef = Annotated[str, PathParam(min_length=4, max_length=64,
                                       description="Snapshot id or unique prefix")]


@router.get("", responses=_ERRORS, summary="Pending snapshots and recent decisions")
def list_approvals(ctx: Ctx, approver: ApproverAuth,
                   recent: Annotated[int, Query(ge=0, le=200)] = 20) -> ApprovalsPage:
    gate = ctx.approvals
    return ApprovalsPage(enforced=gate.enforced, pending=gate.pending(),
                         recent=gate.recent(recent) if recent else [])


@router.get("/{snapshot_ref}", responses=_ERRORS,
            summary="One snapshot's review: the diff the server computes from its own files")
def review(
    snapshot_ref: SnapshotRef, ctx: Ctx, approver: ApproverAuth,
    offset: Annotated[int, Query(ge=0, le=100_000_000, description="First diff line")] = 0,
    limit: Annotated[int, Query(ge=1, le=5000, description="Diff lines per page")] = 500,
    base: Annotated[str | None, Query(max_length=64, description=(
        "Compare with 'server' or an approved snapshot instead of the default (the active "
        "code if approved, else the server's own ajet/)"))] = None,
) -> ReviewPage:
    rec = _snapshot(ctx, snapshot_ref)
    return ctx.approvals.review_page(rec, offset=offset, limit=limit, base=base)


@router.post("/{snapshot_ref}/approve", responses=_ERRORS, summary="Approve exactly this content")
def approve(snapshot_ref: SnapshotRef, body: ApprovalDecisionRequest, ctx: Ctx,
            approver: ApproverAuth) -> ApprovalDecisionPublic:
    return decide(ctx, _exact(ctx, snapshot_ref), "approved", approver=approver,
                  note=body.note, confirm=body.snapshot_id, base=body.base_id)


@router.post("/{snapshot_ref}/deny", responses=_ERRORS, summary="Refuse it: it never runs")
def deny(snapshot_ref: SnapshotRef, body: ApprovalDecisionRequest, ctx: Ctx,
         approver: ApproverAuth) -> ApprovalDecisionPublic:
    return decide(ctx, _exact(ctx, snapshot_ref), "denied", approver=approver,
                  note=body.note, confirm=body.snapshot_id)


@router.post("/{snapshot_ref}/revoke", responses=_ERRORS,
             summary="Revoke an approval: it never runs again (a running engine is stopped)")
def revoke(snapshot_ref: SnapshotRef, body: ApprovalDecisionRequest, ctx: Ctx,
           approver: ApproverAuth) -> ApprovalDecisionPublic:
    return decide(ctx, _exact(ctx, snapshot_ref), "revoked", approver=approver,
                  note=body.note, confirm=body.snapshot_id)


def decide(ctx: ServerContext, rec: SnapshotRecord, decision: str, *, approver: str,
           note: str, confirm: str, base: str | None = None) -> ApprovalDecisionPublic:
    """Record a decision (the API and the console share this); a refusal is audited too."""
    action = {"approved": "approve", "denied": "deny", "revoked": "revoke"}[decision]
    try:
        result, reopened = ctx.approvals.decide_cascading(rec, decision, approver=approver,
                                                          note=note, confirm=confirm,
                                                          base=base)
    except SwarmHTTPError as exc:
        detail = exc.detail.get("message", exc.detail) if isinstance(exc.detail, dict) \
            else exc.detail
        ctx.ledger.audit(action, f"approver:{approver}", f"refused: {str(detail)[:300]}",
                         {"snapshot_id": rec.id})
        raise
    if decision in ("revoked", "denied") or reopened:
        def why(snapshot_id: str) -> str:
            return (f"approval of snapshot {rec.id[:12]} revoked by {approver}"
                    if snapshot_id == rec.id else
                    f"the approval of snapshot {snapshot_id[:12]} rested on snapshot "
                    f"{rec.id[:12]}, {decision} by {approver}")

        # every run on a snapshot that may no longer run: the default one and POST /runs'
        ctx.runs.stop_unrunnable(role=f"approver:{approver}", why=why)
    return result


def _exact(ctx: ServerContext, ref: str) -> SnapshotRecord:
    """The snapshot named by its full id: a decision never resolves a prefix (another
    snapshot could be uploaded with the same first characters between review and decision)."""
    if not _FULL_ID.fullmatch(ref):
        raise SwarmValidationError(
            400, f"{ref[:64]!r} is not a full snapshot id: decisions take all 64 hex "
            "characters", "`ajet-swarm approvals show PREFIX` (or GET "
            "/approvals/PREFIX) prints the full id to decide on")
    rec = ctx.snapshots.get(ref)
    if rec is None:
        raise SwarmNotFound(404, f"no snapshot {ref[:12]}... is stored",
                            "GET /approvals lists the pending snapshots")
    return rec


def _snapshot(ctx: ServerContext, ref: str) -> SnapshotRecord:
    rec = ctx.snapshots.resolve(ref)
    if rec is None:
        raise SwarmNotFound(404, "the server's own code needs no approval",
                            "GET /approvals lists the pending snapshots")
    return rec
