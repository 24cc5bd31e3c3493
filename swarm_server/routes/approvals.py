"""Routes: the approvers' review and decisions. An approver token only (`ApproverAuth`).

    GET  /approvals                          pending snapshots, recent decisions
    GET  /approvals/{ref}?offset=&limit=     one snapshot's review: the server-side diff
                                             (escaped, paged), flagged files, the
                                             client's claimed provenance, its history
    POST /approvals/{ref}/approve  {snapshot_id, note}
    POST /approvals/{ref}/deny     {snapshot_id, note}
    POST /approvals/{ref}/revoke   {snapshot_id, note}   (stops an engine running it)

`ref` is a snapshot id or a unique prefix; a decision's body repeats the full id, so what
is decided is exactly what was reviewed. The control token is refused (403): it cannot
approve, not even read the review here (the bridge computes the same review from the
control routes). Every decision and refusal is in the audit log with the approver's name.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from ajet.errors import SwarmHTTPError, SwarmNotFound
from ajet.protocol import (
    ApprovalDecisionPublic,
    ApprovalDecisionRequest,
    ApprovalsPage,
    ApprovalState,
    EngineState,
    ErrorBody,
    ReviewPage,
)
from swarm_server.approvals import AUDIT_ACTION
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
    return decide(ctx, _snapshot(ctx, snapshot_ref), ApprovalState.APPROVED, approver=approver,
                  note=body.note, confirm=body.snapshot_id)


@router.post("/{snapshot_ref}/deny", responses=_ERRORS, summary="Refuse it: it never runs")
def deny(snapshot_ref: SnapshotRef, body: ApprovalDecisionRequest, ctx: Ctx,
         approver: ApproverAuth) -> ApprovalDecisionPublic:
    return decide(ctx, _snapshot(ctx, snapshot_ref), ApprovalState.DENIED, approver=approver,
                  note=body.note, confirm=body.snapshot_id)


@router.post("/{snapshot_ref}/revoke", responses=_ERRORS,
             summary="Revoke an approval: it never runs again (a running engine is stopped)")
def revoke(snapshot_ref: SnapshotRef, body: ApprovalDecisionRequest, ctx: Ctx,
           approver: ApproverAuth) -> ApprovalDecisionPublic:
    return decide(ctx, _snapshot(ctx, snapshot_ref), ApprovalState.REVOKED, approver=approver,
                  note=body.note, confirm=body.snapshot_id)


def decide(ctx: ServerContext, rec: SnapshotRecord, decision: ApprovalState, *,
           approver: str, note: str, confirm: str) -> ApprovalDecisionPublic:
    """Record a decision (the API and the console share this); a refusal is audited too."""
    action = AUDIT_ACTION[decision]
    try:
        result = ctx.approvals.decide(rec, decision, approver=approver, note=note,
                                      confirm=confirm)
    except SwarmHTTPError as exc:
        detail = exc.detail.get("message", exc.detail) if isinstance(exc.detail, dict) \
            else exc.detail
        ctx.ledger.audit(action, f"approver:{approver}", f"refused: {str(detail)[:300]}",
                         {"snapshot_id": rec.id})
        raise
    if decision is ApprovalState.REVOKED:
        status = ctx.engine.status()
        if status.snapshot_id == rec.id and status.state is not EngineState.OFFLINE:
            ctx.engine.stop(role=f"approver:{approver}",
                            reason=f"approval of snapshot {rec.id[:12]} revoked by {approver}")
    return result


def _snapshot(ctx: ServerContext, ref: str) -> SnapshotRecord:
    rec = ctx.snapshots.resolve(ref)
    if rec is None:
        raise SwarmNotFound(404, "the server's own code needs no approval",
                            "GET /approvals lists the pending snapshots")
    return rec
