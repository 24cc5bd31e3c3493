"""`Approvals`: server-enforced human approval of code snapshots (docs/design.md, "Approvals").

With approver tokens configured (`Settings.approvers`), every snapshot that no approver
approved is *pending* and cannot run: the engine controller asks `require_runnable`
before every start (a plain start, a `force_restart`, the restart after a code swap) and
before running a snapshot's config validator, and the code routes ask it before every
activation. That includes snapshots stored before enforcement was switched on. The
server's own code (`server`) counts as approved. Without approvers nothing is enforced
and every state reads `not_enforced`.

A decision is one append-only row in the ledger (`approved`, `denied`, `revoked`), bound to
the snapshot id, which is the hash of its content, and written to the audit log with the
approver's name. Approvals never expire; a denial, or a revocation after an approval, is
final for that content (any edit makes a new snapshot id, which is pending).

An approval rests on its review's base (`base_id`): what was approved is the diff
against that base, so the base's code is inside it unseen. A snapshot is runnable only
while its whole chain of bases, back to the server's own code, is approved. Revoking or
denying a snapshot sends every approval resting on it, directly or through a chain,
back to pending (a `reopened` row whose note names why), and the engine is stopped if
it runs any of them.

The review an approver reads is computed here, from the server's own stored files
(`ajet.code_review`): the pending snapshot against the code the engine runs now if that is
approved, else against the server's own `ajet/`. Comparing with approved code only means
that whatever the approver approves has been seen, diff by diff, back to code that was
approved or the server's own. The client's provenance (git HEAD, branch, dirty diff) is
shown apart, as a claim.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from ajet.code_review import FileReview, Review, build_review, compare_manifests, escape_text
from ajet.packaging import snapshot_id_of
from ajet.protocol import (
    SERVER_CODE,
    ApprovalDecisionPublic,
    ApprovalState,
    FileEntry,
    PendingSnapshot,
    Provenance,
    ReviewFile,
    ReviewPage,
    SnapshotApproval,
)
from ajet.errors import ApprovalPending, EngineStateConflict, SwarmValidationError
from swarm_server.ledger import ApprovalRecord, Ledger, SnapshotRecord
from swarm_server.server_code import ServerCode
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore

__all__ = ["DECISIONS", "Approvals", "approve_command"]

log = logging.getLogger(__name__)

#: decision -> the state it leads to
DECISIONS = {"approved": ApprovalState.APPROVED, "denied": ApprovalState.DENIED,
             "revoked": ApprovalState.REVOKED, "reopened": ApprovalState.PENDING}
#: decision -> the states it may be taken from
_FROM = {"approved": (ApprovalState.PENDING,), "denied": (ApprovalState.PENDING,),
         "revoked": (ApprovalState.APPROVED,)}
_AUDIT_ACTION = {"approved": "approve", "denied": "deny", "revoked": "revoke"}
_REVIEW_CACHE = 8
_SHORT = 12
#: Longest chain of bases followed (a chain is one approval per sync; far shorter).
_MAX_CHAIN = 10_000


def approve_command(snapshot_id: str) -> str:
    """What a headless approver runs (`ajet-swarm approvals`, AJET_SWARM_APPROVER_TOKEN)."""
    return f"ajet-swarm approvals show {snapshot_id[:_SHORT]}"


class Approvals:
    """Approval state, decisions and reviews of the snapshots of one server."""

    def __init__(self, settings: Settings, ledger: Ledger, snapshots: SnapshotStore,
                 server_code: ServerCode) -> None:
        self.settings = settings
        self.ledger = ledger
        self.snapshots = snapshots
        self.server_code = server_code
        self._lock = threading.Lock()  # decisions are compare-and-set on the newest row
        self._reviews: OrderedDict[tuple[str, str, str], Review] = OrderedDict()
        self._reviews_lock = threading.Lock()

    @property
    def enforced(self) -> bool:
        return self.settings.approvals_enforced

    # ------------------------------------------------------------------ state

    def state(self, snapshot_id: str) -> SnapshotApproval:
        if not self.enforced:
            return SnapshotApproval(state=ApprovalState.NOT_ENFORCED)
        if snapshot_id == SERVER_CODE:
            return SnapshotApproval(state=ApprovalState.APPROVED,
                                    note="the server's own code counts as approved")
        return self.states([snapshot_id])[snapshot_id]

    def states(self, snapshot_ids: list[str]) -> dict[str, SnapshotApproval]:
        """Each snapshot's state; an approval whose chain of bases is broken reads pending."""
        if not self.enforced:
            return {i: SnapshotApproval(state=ApprovalState.NOT_ENFORCED) for i in snapshot_ids}
        latest = self.ledger.latest_approvals()
        out: dict[str, SnapshotApproval] = {}
        for i in snapshot_ids:
            if i == SERVER_CODE:
                out[i] = SnapshotApproval(state=ApprovalState.APPROVED,
                                          note="the server's own code counts as approved")
                continue
            approval = _approval(latest.get(i))
            broken = _chain_break(i, latest) if approval.state is ApprovalState.APPROVED \
                else None
            if broken is not None:
                base, base_state = broken
                approval = SnapshotApproval(
                    state=ApprovalState.PENDING, approver=approval.approver, at=approval.at,
                    note=f"its review rested on snapshot {base[:_SHORT]}, which is "
                         f"{base_state.value}; an approver reviews it again")
            out[i] = approval
        return out

    def runnable(self, snapshot_id: str) -> bool:
        return self.state(snapshot_id).state in (ApprovalState.APPROVED,
                                                 ApprovalState.NOT_ENFORCED)

    def require_runnable(self, snapshot_id: str, *, doing: str) -> None:
        """Raise `ApprovalPending` (409) unless `snapshot_id` may run."""
        approval = self.state(snapshot_id)
        if approval.state in (ApprovalState.APPROVED, ApprovalState.NOT_ENFORCED):
            return
        raise ApprovalPending(409, self.refusal(snapshot_id, approval, doing=doing),
                              self.hint(snapshot_id, approval))

    def refusal(self, snapshot_id: str, approval: SnapshotApproval, *, doing: str
                ) -> dict[str, Any]:
        """The `detail` of an `ApprovalPending`: what, why, and where to approve."""
        short = snapshot_id[:_SHORT]
        if approval.state is ApprovalState.PENDING:
            why = f"snapshot {short} is pending approval by an approver"
        else:
            by = f" by {approval.approver}" if approval.approver else ""
            why = f"snapshot {short} was {approval.state.value}{by}; it never runs"
        return {"message": f"cannot {doing}: {why}", "snapshot_id": snapshot_id,
                "approval_state": approval.state.value, "approve_with": self.where(snapshot_id)}

    def hint(self, snapshot_id: str, approval: SnapshotApproval) -> str:
        if approval.state is ApprovalState.PENDING:
            return (f"an approver reviews and approves it: {approve_command(snapshot_id)}, then "
                    f"`ajet-swarm approvals approve {snapshot_id}` (their own "
                    "AJET_SWARM_APPROVER_TOKEN); then sync again or POST /code/activate")
        return ("change the code under ajet/ and sync again (a new snapshot is pending), or "
                "activate an approved snapshot (GET /code/snapshots)")

    def where(self, snapshot_id: str) -> dict[str, str]:
        """Where a human approves this snapshot."""
        return {"console": f"/ui/snapshots/{snapshot_id}",
                "cli": f"ajet-swarm approvals approve {snapshot_id}"}

    # ------------------------------------------------------------------ listing

    def pending(self) -> list[PendingSnapshot]:
        """Stored snapshots no approver decided yet, newest first (empty if not enforced)."""
        if not self.enforced:
            return []
        records = self.snapshots.records()
        states = self.states([r.id for r in records])
        return [self.pending_row(r, states[r.id]) for r in records
                if states[r.id].state is ApprovalState.PENDING]

    def pending_ids(self) -> set[str]:
        """Ids of the pending snapshots: garbage collection never removes them."""
        if not self.enforced:
            return set()
        records = self.ledger.list_snapshots()
        states = self.states([r.id for r in records])
        return {i for i, a in states.items() if a.state is ApprovalState.PENDING}

    def pending_row(self, rec: SnapshotRecord, approval: SnapshotApproval | None = None
                    ) -> PendingSnapshot:
        prov = _provenance(rec)
        return PendingSnapshot(
            snapshot_id=rec.id, created=rec.created, file_count=rec.file_count,
            total_bytes=rec.total_bytes,
            approval=approval if approval is not None else self.state(rec.id),
            claimed_head=escape_text(prov.git_head or "") or None,
            claimed_branch=escape_text(prov.branch or "") or None,
            claimed_host=escape_text(prov.host or "") or None)

    def history(self, snapshot_id: str) -> list[ApprovalDecisionPublic]:
        return [_public(r) for r in self.ledger.approvals_of(snapshot_id)]

    def recent(self, limit: int = 20) -> list[ApprovalDecisionPublic]:
        return [_public(r) for r in self.ledger.recent_approvals(limit)]

    # ------------------------------------------------------------------ decide

    def decide(self, rec: SnapshotRecord, decision: str, *, approver: str, note: str = "",
               confirm: str, base: str | None = None) -> ApprovalDecisionPublic:
        """Record `decision` on `rec`, if its current state allows it (else 409).

        A revocation or denial also reopens every approval resting on `rec`
        (`reopened_by`); the caller stops an engine running any of them.
        """
        row, _ = self.decide_cascading(rec, decision, approver=approver, note=note,
                                       confirm=confirm, base=base)
        return row

    def decide_cascading(self, rec: SnapshotRecord, decision: str, *, approver: str,
                         note: str = "", confirm: str, base: str | None = None
                         ) -> tuple[ApprovalDecisionPublic, list[str]]:
        """`decide`, and the ids of the approvals it sent back to pending.

        `base` is the base of the review the approver read; the approval rests on it
        (it must be the server's code or runnable now). Default: `self.base()`.
        """
        if confirm != rec.id:
            raise SwarmValidationError(
                400, f"the confirmation {confirm[:16]}... is not snapshot {rec.id}",
                "send the full snapshot id of what you reviewed")
        with self._lock:
            current = self.state(rec.id)
            if current.state not in _FROM[decision]:
                allowed = " or ".join(s.value for s in _FROM[decision])
                raise EngineStateConflict(
                    409, f"snapshot {rec.id[:_SHORT]} is {current.state.value}"
                    + (f" (by {current.approver})" if current.approver else "")
                    + f"; only a {allowed} snapshot can be {decision}",
                    "revoke an approved snapshot; denied and revoked ones are final"
                    if decision != "revoked" else "only an approved snapshot can be revoked")
            # only an approval rests on a base; a revocation or denial must never be
            # held up by the base its page showed
            base_id = self._checked_base(base)[0] if base is not None and \
                decision == "approved" else self.base()[0]
            now = time.time()
            row = self.ledger.add_approval(ApprovalRecord(
                snapshot_id=rec.id, decision=decision, approver=approver, at=now,
                note=note, base_id=base_id))
            reopened = self._reopen_resting_on(rec.id, decision, approver=approver, at=now) \
                if decision in ("revoked", "denied") else []
        self.ledger.audit(_AUDIT_ACTION[decision], f"approver:{approver}", "ok",
                          {"snapshot_id": rec.id, "note": note, "base_id": base_id,
                           "reopened": reopened})
        log.info("snapshot %s %s by %s%s", rec.id[:_SHORT], decision, approver,
                 f"; {len(reopened)} approval(s) resting on it back to pending"
                 if reopened else "")
        return _public(row), reopened

    def _reopen_resting_on(self, snapshot_id: str, decision: str, *, approver: str,
                           at: float) -> list[str]:
        """Reopen every approval whose chain of bases reaches `snapshot_id`. Holds `_lock`."""
        latest = self.ledger.latest_approvals()
        resting: dict[str, list[str]] = {}
        for sid, row in latest.items():
            if row.decision == "approved":
                resting.setdefault(row.base_id or SERVER_CODE, []).append(sid)
        reopened: list[str] = []
        todo, seen = [snapshot_id], {snapshot_id}
        while todo:
            base = todo.pop()
            for sid in resting.get(base, []):
                if sid in seen:
                    continue
                seen.add(sid)
                todo.append(sid)
                reopened.append(sid)
                via = "" if base == snapshot_id else f" through {base[:_SHORT]}"
                self.ledger.add_approval(ApprovalRecord(
                    snapshot_id=sid, decision="reopened", approver=approver, at=at,
                    note=f"back to pending: its review rested on snapshot "
                         f"{snapshot_id[:_SHORT]}{via}, which was {decision} by {approver}; "
                         "review it again", base_id=base))
        return reopened

    # ------------------------------------------------------------------ review

    def base(self) -> tuple[str, str]:
        """(base id, why) of the reviewed diff: the active code if approved, else `server`."""
        active = self.snapshots.active_id()
        if active == SERVER_CODE:
            return SERVER_CODE, "the server's own ajet/ (no snapshot is active)"
        if self.runnable(active):
            return active, "the approved snapshot the engine runs now"
        return SERVER_CODE, (f"the server's own ajet/: the active snapshot {active[:_SHORT]} is "
                             "not approved, so comparing with it could hide unreviewed code")

    def review(self, rec: SnapshotRecord, *, base: str | None = None
               ) -> tuple[Review, str, str]:
        """(review, base id, why) of `rec` against `base` (default: `self.base()`).

        `base` may name `server` or any approved snapshot (only approved code is a safe
        base). Reviews are cached: snapshots never change, and the key includes the
        server code's manifest id.
        """
        base_id, reason = self.base() if base is None else self._checked_base(base)
        old_entries, read_old = self._side(base_id)
        new_entries = [FileEntry.model_validate(e) for e in rec.manifest]
        key = (rec.id, base_id, snapshot_id_of(old_entries))
        with self._reviews_lock:
            cached = self._reviews.get(key)
            if cached is not None:
                self._reviews.move_to_end(key)
                return cached, base_id, reason
        _, read_new = self._side(rec.id)
        review = build_review(compare_manifests(new_entries, old_entries),
                              read_new=read_new, read_old=read_old)
        with self._reviews_lock:
            self._reviews[key] = review
            while len(self._reviews) > _REVIEW_CACHE:
                self._reviews.popitem(last=False)
        return review, base_id, reason

    def review_page(self, rec: SnapshotRecord, *, offset: int = 0, limit: int = 500,
                    base: str | None = None) -> ReviewPage:
        review, base_id, reason = self.review(rec, base=base)
        lines, next_offset = review.page(offset, limit)
        return ReviewPage(
            snapshot_id=rec.id, approval=self.state(rec.id), base_id=base_id,
            base_reason=reason, summary=review.summary(),
            files=[review_file(f) for f in review.files],
            flagged=[escape_text(f.path) for f in review.flagged],
            claimed=claimed_provenance(rec),
            diff="".join(line.escaped() + "\n" for line in lines),
            offset=offset, next_offset=next_offset, total_lines=len(review.lines),
            history=self.history(rec.id))

    def _checked_base(self, base: str) -> tuple[str, str]:
        if base == SERVER_CODE:
            return SERVER_CODE, "the server's own ajet/ (chosen)"
        rec = self.snapshots.resolve(base)
        if rec is None:
            return SERVER_CODE, "the server's own ajet/ (chosen)"
        if not self.runnable(rec.id):
            raise SwarmValidationError(
                400, f"snapshot {rec.id[:_SHORT]} is not approved, so it is no safe "
                "base for a review", "compare with 'server' or an approved snapshot")
        return rec.id, f"approved snapshot {rec.id[:_SHORT]} (chosen)"

    def _side(self, snapshot_id: str) -> tuple[list[FileEntry], Any]:
        if snapshot_id == SERVER_CODE:
            return self.server_code.manifest(), self.server_code.read
        rec = self.snapshots.get(snapshot_id)
        if rec is None:
            raise SwarmValidationError(
                400, f"snapshot {snapshot_id[:_SHORT]} is gone from the server",
                "GET /code/snapshots lists what is stored")
        base_dir = self.snapshots.base_dir(rec)

        def read(entry: FileEntry) -> bytes:
            # The materialised folder is exactly what the engine imports.
            return (base_dir / entry.path).read_bytes()

        return [FileEntry.model_validate(e) for e in rec.manifest], read


def review_file(f: FileReview) -> ReviewFile:
    """The wire form of one file's review, its paths escaped."""
    return ReviewFile(path=escape_text(f.path), kind=f.kind.value,
                      old_path=escape_text(f.old_path) if f.old_path else None,
                      old_mode=f.old_mode, new_mode=f.new_mode, size=f.size, shown=f.shown,
                      flags=list(f.flags), first_line=f.first_line, added=f.added,
                      removed=f.removed)


def claimed_provenance(rec: SnapshotRecord) -> Provenance:
    """The client's provenance with every string escaped (it is shown to humans)."""
    prov = _provenance(rec)
    return prov.model_copy(update={
        "git_head": escape_text(prov.git_head) if prov.git_head else None,
        "branch": escape_text(prov.branch) if prov.branch else None,
        "host": escape_text(prov.host) if prov.host else None,
        "diff": "\n".join(escape_text(ln) for ln in prov.diff.split("\n")),
        "untracked_left_out": [escape_text(n) for n in prov.untracked_left_out],
    })


def _provenance(rec: SnapshotRecord) -> Provenance:
    try:
        return Provenance.model_validate(rec.provenance)
    except ValueError:
        return Provenance()


def _chain_break(snapshot_id: str, latest: dict[str, ApprovalRecord]
                 ) -> tuple[str, ApprovalState] | None:
    """The first base up the approval chain of `snapshot_id` that is not approved, with its
    state, or None when the chain reaches the server's own code approved all the way."""
    seen = {snapshot_id}
    row = latest.get(snapshot_id)
    for _ in range(_MAX_CHAIN):
        base = (row.base_id if row is not None else None) or SERVER_CODE
        if base == SERVER_CODE:
            return None
        if base in seen:  # cannot be built by decide(); never trust a loop
            return base, ApprovalState.PENDING
        seen.add(base)
        row = latest.get(base)
        state = _approval(row).state
        if state is not ApprovalState.APPROVED:
            return base, state
    return snapshot_id, ApprovalState.PENDING


def _approval(latest: ApprovalRecord | None) -> SnapshotApproval:
    if latest is None:
        return SnapshotApproval(state=ApprovalState.PENDING)
    return SnapshotApproval(state=DECISIONS[latest.decision], approver=latest.approver,
                            at=latest.at, note=latest.note)


def _public(r: ApprovalRecord) -> ApprovalDecisionPublic:
    return ApprovalDecisionPublic(snapshot_id=r.snapshot_id, decision=r.decision,  # type: ignore[arg-type]
                                  approver=r.approver, at=r.at, note=r.note, base_id=r.base_id)

