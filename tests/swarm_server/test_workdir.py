"""Everything the server creates under its work directory is private to its user.

A real server started under the default umask (022), over a work directory an earlier
server left world-readable: after a code sync, a run and a stop, no database, snapshot,
blob, run file or log has a group or other permission bit; what was there is
tightened at start, files the server does not own are left alone, and the server warns
that the work directory itself is open.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState
from swarm_server.ledger import Ledger
from swarm_server.workdir import SERVER_OWNED
from tests.support import make_ajet_repo, start_server
from tests.support.fake_engine import server_env


def open_entries(workdir: Path) -> dict[str, str]:
    """Server-owned paths with any group/other bit: relative path -> octal mode."""
    found: dict[str, str] = {}
    for name in SERVER_OWNED:
        top = workdir / name
        if not top.exists():
            continue
        for path in [top, *top.rglob("*")]:
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                found[str(path.relative_to(workdir))] = oct(stat.S_IMODE(st.st_mode))
    return found


def test_server_files_are_private_and_earlier_ones_are_tightened(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    old_log = workdir / "runs" / "r-old" / "engine.log"
    old_log.parent.mkdir(parents=True)
    old_log.write_text("a run of an earlier server\n")
    old_blob_dir = workdir / "ajet_temp" / ".blobs" / "ab"
    old_blob_dir.mkdir(parents=True)
    (old_blob_dir / ("ab" * 32)).write_text("x = 1\n")
    mine = workdir / "notes.txt"  # not the server's: left as it is
    mine.write_text("my notes\n")
    old_ledger = workdir / "swarm.sqlite3"  # runs without their ledger would not start
    Ledger(old_ledger).close()
    for path in (workdir, old_log.parent, old_log, old_blob_dir, mine, old_ledger):
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert open_entries(workdir)

    previous = os.umask(0o022)  # the server inherits the default umask
    try:
        server = start_server(workdir, env=server_env())
    finally:
        os.umask(previous)
    try:
        assert not open_entries(workdir)  # tightened at start
        with SwarmClient(server.url) as client:
            client.push_code(make_ajet_repo(tmp_path / "repo"))
            client.configure_and_start(AgentJetJob(experiment_name="private"), wait_timeout=60)
            status = client.engine_status()
            assert status.state is EngineState.ROLLING and status.run_id
            run_dir = workdir / "runs" / status.run_id
            assert not open_entries(workdir), open_entries(workdir)  # while it runs
            client.stop_run()
        made = {p.relative_to(workdir).parts[0] for p in workdir.rglob("*")}
        assert {"swarm.sqlite3", "ajet_temp", "runs"} <= made
        assert any((workdir / "ajet_temp").glob("*/ajet/engine/rewards.py"))  # a snapshot
        assert (run_dir / "engine.log").is_file() and (run_dir / "job.yaml").is_file()
        assert not open_entries(workdir), open_entries(workdir)
        module = next((workdir / "ajet_temp").glob("*/ajet/__init__.py"))  # 0o644 in git
        assert stat.S_IMODE(module.stat().st_mode) == 0o600
    finally:
        server.stop()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o644
    assert "other users can list it" in server.log() and "chmod 700" in server.log()
