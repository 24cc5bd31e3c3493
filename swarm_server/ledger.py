"""The runs ledger: an embedded SQLite database of snapshots, runs, approvals, settings
and audit.

Everything an experiment result must be traced to lives here and survives a server
restart: which snapshot and config a run used, how it ended, and who did what. The
schema is versioned with `PRAGMA user_version`; `_MIGRATIONS[i]` upgrades version i to
i + 1 and is applied at open. All access goes through one lock (SQLite connections are
shared between the event loop and the supervisor's threads).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarm_server.errors import StartupRefused

__all__ = ["ApprovalRecord", "AuditRecord", "Ledger", "LedgerUnusable", "RunRecord",
           "SnapshotRecord", "check_ledger_file", "set_ledger_aside"]

#: The first 16 bytes of every SQLite 3 database file.
_SQLITE_HEADER = b"SQLite format 3\x00"
_SIDE_FILES = ("-wal", "-shm", "-journal")

_MIGRATIONS: list[str] = [
    # 0 -> 1: initial schema
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        path TEXT NOT NULL,
        created REAL NOT NULL,
        file_count INTEGER NOT NULL,
        total_bytes INTEGER NOT NULL,
        manifest_json TEXT NOT NULL,
        provenance_json TEXT NOT NULL,
        approved_by TEXT
    );
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        snapshot_id TEXT NOT NULL,
        config_yaml TEXT NOT NULL,
        config_hash TEXT NOT NULL,
        experiment_name TEXT NOT NULL,
        started_by TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        status TEXT NOT NULL,
        final_state TEXT,
        exit_code INTEGER,
        reason TEXT,
        last_step INTEGER,
        summary_json TEXT NOT NULL DEFAULT '{}',
        run_dir TEXT NOT NULL,
        pid INTEGER,
        pid_start_time REAL
    );
    CREATE INDEX runs_started ON runs (started_at DESC);
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        action TEXT NOT NULL,
        role TEXT NOT NULL,
        outcome TEXT NOT NULL,
        detail_json TEXT NOT NULL DEFAULT '{}'
    );
    """,
    # 1 -> 2: approvers' decisions, append-only; a snapshot's state is its newest row
    """
    CREATE TABLE approvals (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        snapshot_id TEXT NOT NULL,
        decision TEXT NOT NULL,
        approver TEXT NOT NULL,
        at REAL NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        base_id TEXT
    );
    CREATE INDEX approvals_snapshot ON approvals (snapshot_id, id);
    """,
    # 2 -> 3: checkpoints: the run a run resumed from and its last complete checkpoint
    """
    ALTER TABLE runs ADD COLUMN resumed_from TEXT;
    ALTER TABLE runs ADD COLUMN resume_checkpoint TEXT;
    ALTER TABLE runs ADD COLUMN resume_step INTEGER;
    ALTER TABLE runs ADD COLUMN last_checkpoint TEXT;
    """,
    # 3 -> 4: concurrent runs: a run's name, whether start_engine started it, its devices
    """
    ALTER TABLE runs ADD COLUMN name TEXT;
    ALTER TABLE runs ADD COLUMN default_run INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE runs ADD COLUMN devices_json TEXT NOT NULL DEFAULT '[]';
    CREATE INDEX runs_name ON runs (name);
    """,
]

#: Run statuses. `booting`/`running` are open; `ended`/`failed` are final. `queued` (a
#: run of POST /runs waiting for devices) is active but has no process to reconcile.
OPEN_RUN_STATUSES = ("booting", "running")
ACTIVE_RUN_STATUSES = ("queued", *OPEN_RUN_STATUSES)


@dataclass
class SnapshotRecord:
    id: str
    path: str  # relative to the workdir: ajet_temp/<timestamp>/ajet
    created: float
    file_count: int
    total_bytes: int
    manifest: list[dict[str, Any]]
    provenance: dict[str, Any]
    approved_by: str | None = None


@dataclass
class RunRecord:
    id: str
    snapshot_id: str
    config_yaml: str
    config_hash: str
    experiment_name: str
    started_by: str
    started_at: float
    run_dir: str
    status: str = "booting"
    ended_at: float | None = None
    final_state: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    last_step: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    pid_start_time: float | None = None
    #: the run this one resumed from (its id; None for a fresh start or a bare path)
    resumed_from: str | None = None
    #: the checkpoint directory it resumed from, and that checkpoint's step
    resume_checkpoint: str | None = None
    resume_step: int | None = None
    #: the run's last complete checkpoint directory (written at its end)
    last_checkpoint: str | None = None
    #: the name given at POST /runs (None for start_engine's runs)
    name: str | None = None
    #: started by start_engine (the single-engine surface) rather than POST /runs
    default_run: bool = True
    #: the device slots it held (GPU indices on a GPU host)
    devices: list[int] = field(default_factory=list)


@dataclass
class ApprovalRecord:
    """One approver decision: `approved`, `denied` or `revoked`."""

    snapshot_id: str
    decision: str
    approver: str
    at: float
    note: str = ""
    base_id: str | None = None
    id: int | None = None


@dataclass
class AuditRecord:
    id: int
    at: float
    action: str
    role: str
    outcome: str
    detail: dict[str, Any]


_RUN_COLUMNS = ({f for f in RunRecord.__dataclass_fields__ if f not in ("summary", "devices")}
                | {"summary_json", "devices_json"})


class LedgerUnusable(StartupRefused):
    """The ledger file exists but cannot be used: empty, truncated, damaged, unreadable."""


_WHAT_TO_DO = ("restore it from a backup, or start with --new-ledger to set it aside and "
               "begin a fresh ledger (its history of runs, approvals and the audit log is "
               "then gone from this server)")


def check_ledger_file(path: Path) -> None:
    """Raise `LedgerUnusable`, naming `path`, unless it is absent or a sound ledger.

    An empty or damaged ledger must never read as "no history yet": approvals, denials
    and the audit log live there, so a fresh start is only ever asked for explicitly.
    """
    try:
        if not path.exists():
            return
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(len(_SQLITE_HEADER))
    except OSError as exc:
        raise LedgerUnusable(f"the ledger {path} cannot be read ({exc.strerror}); "
                             f"{_WHAT_TO_DO}") from exc
    if size == 0:
        raise LedgerUnusable(f"the ledger {path} is empty (0 bytes): its history is gone; "
                             f"{_WHAT_TO_DO}")
    if header != _SQLITE_HEADER:
        raise LedgerUnusable(f"the ledger {path} is not a SQLite database (truncated or "
                             f"overwritten); {_WHAT_TO_DO}")
    try:
        # read-write (never create): a read-only connection cannot recover a WAL a
        # crashed server left without its shared-memory file
        db = sqlite3.connect(f"file:{path}?mode=rw", uri=True)
        try:
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise LedgerUnusable(f"the ledger {path} is damaged ({exc}); {_WHAT_TO_DO}") from exc
    if check != "ok":
        raise LedgerUnusable(f"the ledger {path} is damaged ({check}); {_WHAT_TO_DO}")
    if version == 0 or version > len(_MIGRATIONS):
        raise LedgerUnusable(f"the ledger {path} has schema version {version}, which this "
                             f"server does not know (0 means no ledger was ever written "
                             f"there); {_WHAT_TO_DO}")


def set_ledger_aside(path: Path) -> Path:
    """Move an unusable ledger (and its side files) aside for `--new-ledger`; the new name."""
    aside = path.with_name(f"{path.name}.unusable-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", *_SIDE_FILES):
        old = path.with_name(path.name + suffix)
        if old.exists():
            old.rename(aside.with_name(aside.name + suffix))
    return aside


class Ledger:
    """SQLite-backed store; one instance per server process."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        with self._lock:
            version = self.schema_version
            for target, script in enumerate(_MIGRATIONS[version:], start=version + 1):
                self._db.executescript(f"BEGIN; {script}; PRAGMA user_version = {target}; COMMIT;")

    # ------------------------------------------------------------------ meta

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row["value"] if row else default

    def set_meta(self, key: str, value: str | None) -> None:
        with self._lock:
            if value is None:
                self._db.execute("DELETE FROM meta WHERE key = ?", (key,))
            else:
                self._db.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )

    # ------------------------------------------------------------------ snapshots

    def add_snapshot(self, rec: SnapshotRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO snapshots (id, path, created, file_count, total_bytes, "
                "manifest_json, provenance_json, approved_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.id, rec.path, rec.created, rec.file_count, rec.total_bytes,
                 json.dumps(rec.manifest), json.dumps(rec.provenance), rec.approved_by),
            )

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
        return _snapshot(row) if row else None

    def find_snapshots(self, prefix: str) -> list[SnapshotRecord]:
        """Snapshots whose id starts with `prefix` (for short ids typed by humans)."""
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM snapshots WHERE id LIKE ? ESCAPE '\\' ORDER BY created DESC",
                (escaped + "%",),
            ).fetchall()
        return [_snapshot(r) for r in rows]

    def list_snapshots(self) -> list[SnapshotRecord]:
        """Newest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM snapshots ORDER BY created DESC").fetchall()
        return [_snapshot(r) for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))

    # ------------------------------------------------------------------ runs

    def create_run(self, rec: RunRecord) -> None:
        data = asdict(rec)
        data["summary_json"] = json.dumps(data.pop("summary"))
        data["devices_json"] = json.dumps(data.pop("devices"))
        cols = ", ".join(data)
        marks = ", ".join("?" for _ in data)
        with self._lock:
            self._db.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", tuple(data.values()))

    def update_run(self, run_id: str, **fields: Any) -> None:
        if "summary" in fields:
            fields["summary_json"] = json.dumps(fields.pop("summary"))
        if "devices" in fields:
            fields["devices_json"] = json.dumps(fields.pop("devices"))
        unknown = set(fields) - _RUN_COLUMNS
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE runs SET {sets} WHERE id = ?", (*fields.values(), run_id))

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return _run(row) if row else None

    def list_runs(self, *, experiment_name: str | None = None, status: str | None = None,
                  statuses: Sequence[str] | None = None, name: str | None = None,
                  offset: int = 0, limit: int = 20) -> tuple[list[RunRecord], int]:
        """Newest first, with the total count matching the filters."""
        where: list[str] = []
        args: list[Any] = []
        if experiment_name:
            where.append("experiment_name = ?")
            args.append(experiment_name)
        if status:
            where.append("status = ?")
            args.append(status)
        if statuses:
            where.append(f"status IN ({', '.join('?' for _ in statuses)})")
            args.extend(statuses)
        if name:
            where.append("name = ?")
            args.append(name)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self._lock:
            total = self._db.execute(f"SELECT COUNT(*) FROM runs {clause}", args).fetchone()[0]
            rows = self._db.execute(
                f"SELECT * FROM runs {clause} ORDER BY started_at DESC, rowid DESC "
                "LIMIT ? OFFSET ?", (*args, limit, offset),
            ).fetchall()
        return [_run(r) for r in rows], int(total)

    def open_runs(self) -> list[RunRecord]:
        """Runs not yet ended (after a server crash: the ones to reconcile)."""
        marks = ", ".join("?" for _ in OPEN_RUN_STATUSES)
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM runs WHERE status IN ({marks})", OPEN_RUN_STATUSES
            ).fetchall()
        return [_run(r) for r in rows]

    def snapshot_ids_used_by_runs(self, run_ids: list[str] | None = None) -> set[str]:
        with self._lock:
            if run_ids is None:
                rows = self._db.execute("SELECT DISTINCT snapshot_id FROM runs").fetchall()
            else:
                marks = ", ".join("?" for _ in run_ids) or "NULL"
                rows = self._db.execute(
                    f"SELECT DISTINCT snapshot_id FROM runs WHERE id IN ({marks})", run_ids
                ).fetchall()
        return {r[0] for r in rows}

    # ------------------------------------------------------------------ approvals

    def add_approval(self, rec: ApprovalRecord) -> ApprovalRecord:
        """Append one decision (never updated or deleted); returns it with its id."""
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO approvals (snapshot_id, decision, approver, at, note, base_id) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (rec.snapshot_id, rec.decision, rec.approver, rec.at, rec.note, rec.base_id))
        return ApprovalRecord(**{**asdict(rec), "id": cur.lastrowid})

    def approvals_of(self, snapshot_id: str) -> list[ApprovalRecord]:
        """Every decision on one snapshot, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM approvals WHERE snapshot_id = ? ORDER BY id",
                                    (snapshot_id,)).fetchall()
        return [ApprovalRecord(**dict(r)) for r in rows]

    def latest_approvals(self, snapshot_ids: list[str] | None = None
                         ) -> dict[str, ApprovalRecord]:
        """The newest decision per snapshot (of `snapshot_ids`, or of all)."""
        query = ("SELECT * FROM approvals WHERE id IN (SELECT MAX(id) FROM approvals "
                 "GROUP BY snapshot_id)")
        with self._lock:
            rows = self._db.execute(query).fetchall()
        wanted = None if snapshot_ids is None else set(snapshot_ids)
        return {r["snapshot_id"]: ApprovalRecord(**dict(r)) for r in rows
                if wanted is None or r["snapshot_id"] in wanted}

    def recent_approvals(self, limit: int = 20) -> list[ApprovalRecord]:
        """The newest decisions, newest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM approvals ORDER BY id DESC LIMIT ?",
                                    (limit,)).fetchall()
        return [ApprovalRecord(**dict(r)) for r in rows]

    # ------------------------------------------------------------------ audit

    def audit(self, action: str, role: str, outcome: str, detail: dict[str, Any] | None = None
              ) -> None:
        """Append one control action. Never updated or deleted."""
        with self._lock:
            self._db.execute(
                "INSERT INTO audit (at, action, role, outcome, detail_json) VALUES (?, ?, ?, ?, ?)",
                (time.time(), action, role, outcome, json.dumps(detail or {}, default=str)),
            )

    def uploaders(self, snapshot_ids: Sequence[str]) -> dict[str, tuple[str, float]]:
        """Who first stored each snapshot, from the audit log: id -> (role, when).

        A sync's audit entry names the snapshot it stored (`snapshot_id` with `path`,
        which is set once the snapshot exists, whatever became of the activation).
        Snapshots with no such entry are left out.
        """
        ids = list(dict.fromkeys(snapshot_ids))[:500]
        if not ids:
            return {}
        marks = ", ".join("?" for _ in ids)
        with self._lock:
            rows = self._db.execute(
                "SELECT json_extract(detail_json, '$.snapshot_id') AS sid, role, at FROM audit "
                "WHERE action = 'sync_code' "
                "AND json_extract(detail_json, '$.path') IS NOT NULL "
                f"AND json_extract(detail_json, '$.snapshot_id') IN ({marks}) ORDER BY id",
                tuple(ids)).fetchall()
        out: dict[str, tuple[str, float]] = {}
        for row in rows:
            out.setdefault(str(row["sid"]), (str(row["role"]), float(row["at"])))
        return out

    def list_audit(self, *, offset: int = 0, limit: int = 100) -> tuple[list[AuditRecord], int]:
        """Oldest first, so the log reads in order."""
        with self._lock:
            total = self._db.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
            rows = self._db.execute(
                "SELECT * FROM audit ORDER BY id LIMIT ? OFFSET ?", (limit, offset)
            ).fetchall()
        return [
            AuditRecord(r["id"], r["at"], r["action"], r["role"], r["outcome"],
                        json.loads(r["detail_json"]))
            for r in rows
        ], int(total)


def _snapshot(row: sqlite3.Row) -> SnapshotRecord:
    return SnapshotRecord(
        id=row["id"], path=row["path"], created=row["created"], file_count=row["file_count"],
        total_bytes=row["total_bytes"], manifest=json.loads(row["manifest_json"]),
        provenance=json.loads(row["provenance_json"]), approved_by=row["approved_by"],
    )


def _run(row: sqlite3.Row) -> RunRecord:
    data = dict(row)
    data["summary"] = json.loads(data.pop("summary_json") or "{}")
    data["devices"] = json.loads(data.pop("devices_json") or "[]")
    data["default_run"] = bool(data["default_run"])
    return RunRecord(**data)
