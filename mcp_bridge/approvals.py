"""Laptop-side approval of code syncs: decisions bound to one snapshot id and one server URL.

This is for a server without approver tokens, and stops only an agent without shell or
file tools: the files below are plain JSON the agent's user can write. Against a server
that enforces approvals the bridge never consults them (docs/security.md).

The model never approves. A sync either asks the human through MCP elicitation, or
files a *pending approval* here, a JSON file in a local folder that only the human's
own command (`ajet-mcp approvals approve ID`) resolves. An approval covers exactly one
`snapshot_id` (the sha256 of the manifest that was shown) on one server URL, and it
expires: change one byte and the snapshot id changes, so a new approval is needed.

Folder: `$AJET_MCP_APPROVALS_DIR`, else `<user config dir>/ajet-mcp/approvals`
(`~/Library/Application Support` on macOS, `$XDG_CONFIG_HOME` or `~/.config` elsewhere).
Files are written atomically (temp file + rename) with mode 0600.
"""

from __future__ import annotations

import enum
import getpass
import json
import logging
import os
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "APPROVALS_DIR_ENV",
    "DEFAULT_TTL_S",
    "Approval",
    "ApprovalError",
    "ApprovalStore",
    "LaptopApprovalStatus",
    "default_approvals_dir",
    "human_identity",
]

log = logging.getLogger(__name__)

APPROVALS_DIR_ENV = "AJET_MCP_APPROVALS_DIR"
#: How long a pending request, and then a granted approval, stays valid.
DEFAULT_TTL_S = 30 * 60.0
#: The full diff kept for `approvals show`; a human reads it, the model never does. A
#: longer one is kept cut, says so, and cannot be approved here (`Approval.diff_cut`).
MAX_STORED_DIFF_CHARS = 8_000_000
DIFF_CUT_NOTE = "\n... the diff was cut here: it is too long to approve on the laptop\n"
_ID_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # no 0/o, 1/l/i: read aloud, typed by hand


class LaptopApprovalStatus(str, enum.Enum):
    """Where one laptop-side approval request stands (the server's own approvals are
    `ajet.protocol.ApprovalState`)."""

    #: Filed by the bridge; waits for the human.
    PENDING = "pending"
    #: The human approved this snapshot id for this server; valid until `expires_at`.
    APPROVED = "approved"
    #: The human refused; the content is not synced.
    DENIED = "denied"

    def __str__(self) -> str:
        return self.value


class ApprovalError(Exception):
    """An approval id is unknown, malformed, expired or already decided."""


@dataclass(frozen=True)
class Approval:
    """One approval request and its decision."""

    id: str
    snapshot_id: str
    server_url: str
    repo: str
    created_at: float
    expires_at: float
    status: LaptopApprovalStatus = LaptopApprovalStatus.PENDING
    summary: str = ""
    diff: str = ""
    files: dict[str, list[str]] = field(default_factory=dict)
    bytes_to_upload: int = 0
    decided_at: float | None = None
    decided_by: str | None = None
    used_at: float | None = None

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    @property
    def diff_cut(self) -> bool:
        """The stored diff is not whole: a human cannot have read all of it."""
        return self.diff.endswith(DIFF_CUT_NOTE)

    def valid_for(self, snapshot_id: str, server_url: str, now: float) -> bool:
        """True if this is a live approval of exactly this content on exactly this server."""
        return (self.status is LaptopApprovalStatus.APPROVED and not self.expired(now)
                and self.snapshot_id == snapshot_id
                and _norm_url(self.server_url) == _norm_url(server_url))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Approval:
        data = dict(data)
        data["status"] = LaptopApprovalStatus(data.get("status", "pending"))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def default_approvals_dir() -> Path:
    """`$AJET_MCP_APPROVALS_DIR`, else the per-user config folder's `ajet-mcp/approvals`."""
    override = os.environ.get(APPROVALS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "ajet-mcp" / "approvals"


def human_identity() -> str:
    """`user@host`, recorded as who decided (and sent to the server as `approved_by`)."""
    try:
        user = getpass.getuser()
    except Exception:  # getuser raises a bare OSError/KeyError on odd systems
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _norm_url(url: str) -> str:
    return url.rstrip("/").lower()


class ApprovalStore:
    """Pending and decided approvals, one JSON file per approval under `root`."""

    def __init__(self, root: Path, *, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.root = root
        self.ttl_s = ttl_s
        self._clock = clock

    # ------------------------------------------------------------------ bridge side

    def request(self, *, snapshot_id: str, server_url: str, repo: str, summary: str,
                diff: str, files: dict[str, list[str]], bytes_to_upload: int) -> Approval:
        """File a pending approval, or return the live one already filed for this content."""
        now = self._clock()
        for existing in self.all():
            if (existing.status is LaptopApprovalStatus.PENDING and not existing.expired(now)
                    and existing.snapshot_id == snapshot_id
                    and _norm_url(existing.server_url) == _norm_url(server_url)):
                return existing
        approval = Approval(
            id=self._new_id(), snapshot_id=snapshot_id, server_url=server_url, repo=repo,
            created_at=now, expires_at=now + self.ttl_s, summary=summary,
            diff=(diff if len(diff) <= MAX_STORED_DIFF_CHARS
                  else diff[:MAX_STORED_DIFF_CHARS] + DIFF_CUT_NOTE),
            files=files, bytes_to_upload=bytes_to_upload,
        )
        self._write(approval)
        log.info("filed approval %s for snapshot %s on %s", approval.id, snapshot_id[:12],
                 server_url)
        return approval

    def find_valid(self, snapshot_id: str, server_url: str) -> Approval | None:
        """A live approval of exactly this snapshot on this server, if the human gave one."""
        now = self._clock()
        matches = [a for a in self.all() if a.valid_for(snapshot_id, server_url, now)]
        return max(matches, key=lambda a: a.decided_at or 0.0) if matches else None

    def latest_for(self, snapshot_id: str, server_url: str) -> Approval | None:
        """The newest request for this content and server, whatever its status."""
        matches = [a for a in self.all() if a.snapshot_id == snapshot_id
                   and _norm_url(a.server_url) == _norm_url(server_url)]
        return max(matches, key=lambda a: a.created_at) if matches else None

    def mark_used(self, approval_id: str) -> Approval:
        approval = replace(self.get(approval_id), used_at=self._clock())
        self._write(approval)
        return approval

    # ------------------------------------------------------------------ human side

    def approve(self, approval_id: str, *, by: str | None = None) -> Approval:
        """Grant a pending request; it then stays valid for `ttl_s` from now."""
        return self._decide(approval_id, LaptopApprovalStatus.APPROVED, by)

    def deny(self, approval_id: str, *, by: str | None = None) -> Approval:
        return self._decide(approval_id, LaptopApprovalStatus.DENIED, by)

    def get(self, approval_id: str) -> Approval:
        path = self._path(approval_id)
        try:
            return Approval.from_json(json.loads(path.read_text("utf-8")))
        except FileNotFoundError:
            raise ApprovalError(
                f"no approval {approval_id!r} in {self.root}; run `ajet-mcp approvals list`"
            ) from None
        except (ValueError, TypeError) as exc:
            raise ApprovalError(f"approval file {path} is corrupt ({exc}); delete it") from exc

    def all(self) -> list[Approval]:
        """Every approval on disk, newest first; unreadable files are skipped with a warning."""
        if not self.root.is_dir():
            return []
        out: list[Approval] = []
        for path in self.root.glob("*.json"):
            try:
                out.append(Approval.from_json(json.loads(path.read_text("utf-8"))))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable approval file %s: %s", path, exc)
        return sorted(out, key=lambda a: a.created_at, reverse=True)

    def prune(self, *, older_than_s: float = 7 * 86_400.0) -> int:
        """Delete approvals that expired more than `older_than_s` ago; returns how many."""
        now = self._clock()
        removed = 0
        for approval in self.all():
            if approval.expires_at + older_than_s < now:
                self._path(approval.id).unlink(missing_ok=True)
                removed += 1
        return removed

    # ------------------------------------------------------------------ private

    def _decide(self, approval_id: str, status: LaptopApprovalStatus, by: str | None) -> Approval:
        approval = self.get(approval_id)
        now = self._clock()
        if status is LaptopApprovalStatus.APPROVED and approval.diff_cut:
            raise ApprovalError(f"approval {approval_id}: its diff is too long to show whole "
                                "here; ask for a smaller change, or use approver tokens and "
                                "the server's paged review")
        if approval.status is not LaptopApprovalStatus.PENDING:
            raise ApprovalError(f"approval {approval_id} is already {approval.status}")
        if approval.expired(now):
            raise ApprovalError(
                f"approval {approval_id} expired; ask the agent to call sync_train_code again "
                "to file a new one"
            )
        # An approval stays valid for ttl_s from the decision, not from the request.
        expires = now + self.ttl_s if status is LaptopApprovalStatus.APPROVED else approval.expires_at
        decided = replace(approval, status=status, decided_at=now,
                          decided_by=by or human_identity(), expires_at=expires)
        self._write(decided)
        return decided

    def _new_id(self) -> str:
        while True:
            candidate = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
            if not self._path(candidate).exists():
                return candidate

    def _path(self, approval_id: str) -> Path:
        # Ids come from a human's command line: refuse anything that is not a bare id, so a
        # crafted id can never name a file outside the folder.
        if not approval_id or any(c not in _ID_ALPHABET for c in approval_id):
            raise ApprovalError(
                f"{approval_id!r} is not an approval id (8 letters/digits); "
                "run `ajet-mcp approvals list`"
            )
        return self.root / f"{approval_id}.json"

    def _write(self, approval: Approval) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(approval.to_json(), f, indent=1)
            os.chmod(tmp, 0o600)
            os.replace(tmp, self._path(approval.id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
