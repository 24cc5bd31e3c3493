"""`ajet-swarm approvals ...`: the headless approver's commands (a human at a terminal).

Everything shown comes from the server's own review (`GET /approvals/{ref}`): the diff it
computed from its stored files, already escaped, and the client's provenance marked as a
claim. Only the approver token in `AJET_SWARM_APPROVER_TOKEN` is sent; the control token
is never used here (it cannot approve). Output goes to stdout; errors to stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import datetime

from ajet.client import SwarmClient
from ajet.errors import SwarmError
from ajet.protocol import ReviewPage

__all__ = ["APPROVER_TOKEN_ENV", "run_approvals"]

APPROVER_TOKEN_ENV = "AJET_SWARM_APPROVER_TOKEN"
_PAGE_LINES = 2000
_CONFIRM_CHARS = 12
_FULL_ID = re.compile(r"[0-9a-f]{64}")


def run_approvals(args: argparse.Namespace) -> int:
    token = os.environ.get(APPROVER_TOKEN_ENV)
    if not token:
        _complain(f"set {APPROVER_TOKEN_ENV} to your approver token (the server's list is "
                  "AJET_SWARM_APPROVER_TOKENS; the control token cannot approve)")
        return 2
    try:
        with SwarmClient(args.swarm_url, token=token, timeout=60) as client:
            if args.verb == "list":
                return _list(client)
            if args.verb == "show":
                return _show(client, args.ref, offset=args.offset, lines=args.lines,
                             base=args.base)
            return _decide(client, args.verb, args.ref, note=args.note, yes=args.yes)
    except SwarmError as exc:
        _complain(str(exc))
        return 1


def _list(client: SwarmClient) -> int:
    page = client.list_approvals()
    if not page.enforced:
        _say("Approvals are not enforced on this server (it has no approver tokens).")
    if not page.pending:
        _say("No pending snapshots.")
    else:
        _say(f"{'SNAPSHOT':<14} {'CREATED':<17} {'FILES':>6} {'BYTES':>9}  CLAIMED BY THE CLIENT")
        for p in page.pending:
            claim = f"git {(p.claimed_head or 'none')[:10]} on {p.claimed_branch or '-'} from " \
                    f"{p.claimed_host or '?'}"
            _say(f"{p.snapshot_id[:12]:<14} {_local(p.created):<17} {p.file_count:>6} "
                 f"{p.total_bytes:>9}  {claim}")
        _say("\nReview with `ajet-swarm approvals show ID` (a prefix will do); it prints the "
             "full id that `approve` and `deny` need.")
    if page.recent:
        _say("\nRecent decisions:")
        for d in page.recent:
            note = f": {d.note}" if d.note else ""
            _say(f"  {_local(d.at)}  {d.snapshot_id[:12]}  {d.decision} by {d.approver}{note}")
    return 0


def _header(review: ReviewPage) -> None:
    a = review.approval
    state = a.state.value + (f" by {a.approver} at {_local(a.at)}" if a.approver and a.at else "")
    _say(f"Snapshot {review.snapshot_id}: {state}")
    _say(f"Compared with: {review.base_id} ({review.base_reason})")
    _say(f"Changes: {review.summary}")
    for f in review.files:
        mark = "!" if f.flags else " "
        flags = f"  [{'; '.join(f.flags)}]" if f.flags else ""
        _say(f" {mark} {f.kind:<8} {f.path}{flags}")
    c = review.claimed
    _say("Claimed by the client (not verified): "
         f"git {c.git_head or 'none'} on branch {c.branch or '-'}, "
         f"{'uncommitted edits' if c.dirty else 'clean'}, from host {c.host or '?'}")
    if c.untracked_left_out:
        _say(f"  untracked files it left out: {', '.join(c.untracked_left_out[:20])}")
    for h in review.history:
        _say(f"  history: {_local(h.at)} {h.decision} by {h.approver}"
             + (f": {h.note}" if h.note else ""))


def _show(client: SwarmClient, ref: str, *, offset: int, lines: int | None,
          base: str | None) -> int:
    limit = min(lines or _PAGE_LINES, _PAGE_LINES)
    review = client.get_review(ref, offset=offset, limit=limit, base=base)
    _header(review)
    _say(f"\nDiff (server-side, {review.total_lines} lines; control characters shown as "
         "\\xNN escapes):")
    printed = 0
    while True:
        sys.stdout.write(review.diff)
        printed += review.diff.count("\n")
        if review.next_offset is None or (lines is not None and printed >= lines):
            break
        review = client.get_review(review.snapshot_id, offset=review.next_offset,
                                   limit=min(limit, (lines - printed) if lines else limit),
                                   base=base)
    if review.next_offset is not None:
        _say(f"... more: --offset {review.next_offset}")
    _say(f"\nTo decide, name the full id: ajet-swarm approvals approve {review.snapshot_id}"
         " (or deny / revoke)")
    return 0


def _decide(client: SwarmClient, verb: str, ref: str, *, note: str, yes: bool) -> int:
    # The full id only: a prefix resolved now could name a snapshot uploaded after `show`.
    snapshot_id = ref.strip().lower()
    if not _FULL_ID.fullmatch(snapshot_id):
        _complain(f"{verb}: {ref[:64]!r} is not a full snapshot id (64 hex characters); "
                  f"`ajet-swarm approvals show {ref[:12]}` prints the full id to {verb}")
        return 2
    review = client.get_review(snapshot_id, limit=1)
    if review.snapshot_id != snapshot_id:  # cannot happen with a full id; never trust it
        _complain(f"{verb}: the server answered another snapshot; nothing was decided")
        return 1
    _header(review)
    if not yes:
        if not sys.stdin.isatty():
            _complain(f"{verb}: not a terminal; review with `ajet-swarm approvals show "
                      f"{snapshot_id}`, then pass --yes")
            return 2
        typed = input(f"\nType the first {_CONFIRM_CHARS} characters of the snapshot id to "
                      f"{verb} it: ").strip().lower()
        if typed != snapshot_id[:_CONFIRM_CHARS]:
            _complain(f"{verb}: the id did not match; nothing was decided")
            return 1
    # the approval rests on the base of the review shown above, whatever changes meanwhile
    decision = client.decide_approval(snapshot_id, verb, note=note, base_id=review.base_id)
    _say(f"\nSnapshot {decision.snapshot_id[:12]} {decision.decision} by {decision.approver}.")
    if decision.decision == "approved":
        _say("The engine can now start on it: the agent syncs again (or activates it).")
    return 0


def _say(text: str = "") -> None:
    sys.stdout.write(f"{text}\n")


def _complain(text: str) -> None:
    sys.stderr.write(f"ajet-swarm approvals: {text}\n")


def _local(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"
