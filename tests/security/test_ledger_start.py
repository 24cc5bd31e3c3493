"""The ledger fails loudly: empty, truncated, damaged, unreadable or missing while runs
are on disk, the server refuses to start, naming the file and what to do; only
`--new-ledger` starts a fresh one (the old file is set aside, not deleted). An emptied
ledger used to start the server fresh, every approval and the audit log gone, silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarm_server.errors import StartupRefused
from swarm_server.ledger import Ledger, LedgerUnusable, check_ledger_file
from swarm_server.main import build_context
from swarm_server.settings import Settings
from tests.support import PROJECT_ROOT


def _ledger_with_history(workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(workdir / "swarm.sqlite3")
    for i in range(200):
        ledger.audit("approve", "approver:alice", "ok", {"i": i, "pad": "x" * 200})
    ledger.close()
    (workdir / "runs" / "20260101-000000-abcdef").mkdir(parents=True)
    return workdir / "swarm.sqlite3"


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "missing"])
def test_an_unusable_ledger_stops_the_start(tmp_path: Path, damage: str) -> None:
    path = _ledger_with_history(tmp_path)
    for side in ("-wal", "-shm"):
        Path(str(path) + side).unlink(missing_ok=True)
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:6000])
    elif damage == "garbage":
        path.write_bytes(b"not a database at all" * 100)
    else:
        path.unlink()
    with pytest.raises(LedgerUnusable) as exc:
        build_context(Settings(workdir=tmp_path, warm_standby=False))
    assert str(path) in str(exc.value) and "--new-ledger" in str(exc.value)
    # --new-ledger: explicit, and the old file is kept aside
    ctx = build_context(Settings(workdir=tmp_path, warm_standby=False, new_ledger=True))
    ctx.ledger.close()
    if damage != "missing":
        assert [p for p in tmp_path.iterdir() if ".unusable-" in p.name]


def test_a_sound_or_absent_ledger_starts(tmp_path: Path) -> None:
    check_ledger_file(tmp_path / "none.sqlite3")
    path = _ledger_with_history(tmp_path / "w")
    check_ledger_file(path)
    assert issubclass(LedgerUnusable, StartupRefused)
    # what a killed server leaves: the main file and an unmerged WAL, no shared memory
    live = Ledger(tmp_path / "live.sqlite3")
    live.audit("approve", "approver:alice", "ok", {})
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal"):
        shutil.copy(tmp_path / f"live.sqlite3{suffix}", crashed / f"swarm.sqlite3{suffix}")
    live.close()
    check_ledger_file(crashed / "swarm.sqlite3")
    assert Ledger(crashed / "swarm.sqlite3").list_audit(limit=10)[1] == 1


def test_unreadable_is_named(tmp_path: Path) -> None:
    path = tmp_path / "swarm.sqlite3"
    path.mkdir()  # unreadable as a file, whoever the server runs as (root included)
    with pytest.raises(LedgerUnusable, match="cannot be read"):
        check_ledger_file(path)


def test_the_cli_refuses_with_exit_code_2(tmp_path: Path) -> None:
    path = _ledger_with_history(tmp_path)
    path.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    started = subprocess.run(
        [sys.executable, "-m", "swarm_server", "start", "--swarm-port", "0", "--workdir",
         str(tmp_path)], env={**env, "AJET_SWARM_WARM_STANDBY": "0"}, capture_output=True,
        text=True, timeout=60, cwd=PROJECT_ROOT)
    assert started.returncode == 2, started.stderr[-2000:]
    assert "is empty" in started.stderr and str(path) in started.stderr
