"""What must hold after any fault: the checks every test in tests/faults ends with.

- the engine state is consistent: OFFLINE, with `last_error` naming a reason when the
  engine died, and no run left open (`booting`/`running`) in the ledger;
- no orphan: every engine process the server started (and any child it spawned) is gone;
- no half-written snapshot: nothing `*.partial` under `ajet_temp/`, no upload temp files,
  and every snapshot folder has its ledger row and every row its folder;
- the server still works: a fresh engine start reaches ROLLING (checked by callers).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import httpx

from ajet.protocol import EngineState, EngineStatus
from tests.support.hostile import snapshot_dirs
from tests.support.servers import wait_gone, wait_status

__all__ = ["assert_consistent", "assert_no_orphans", "assert_store_whole", "wait_gone",
           "wait_status"]


def assert_no_orphans(pids: Iterable[int]) -> None:
    alive = [pid for pid in pids if not wait_gone(pid)]
    assert not alive, f"processes left running: {alive}"


def assert_store_whole(url: str, workdir: Path, headers: dict[str, str] | None = None) -> None:
    """No half-written snapshot, no upload leftovers; folders and ledger rows agree."""
    folders = set(snapshot_dirs(workdir))
    assert not [f for f in folders if f.endswith(".partial")], folders
    incoming = workdir / "ajet_temp" / ".incoming"
    assert not incoming.exists() or not any(incoming.iterdir()), list(incoming.iterdir())
    page = httpx.get(f"{url}/code/snapshots", headers=headers, timeout=30).json()
    rows = {Path(s["path"]).parent.name for s in page["snapshots"]}
    assert rows == folders, (rows, folders)
    for snap in page["snapshots"]:  # every file of every snapshot is there, whole
        listing = httpx.get(f"{url}/code/snapshots/{snap['snapshot_id']}", headers=headers,
                            timeout=30).json()
        for entry in listing["files"]:
            path = workdir / Path(snap["path"]).parent / entry["path"]
            assert path.is_file() and path.stat().st_size == entry["size"], entry["path"]


def assert_consistent(url: str, workdir: Path, *, engine_pids: Iterable[int] = (),
                      died: str | None = None, headers: dict[str, str] | None = None
                      ) -> EngineStatus:
    """OFFLINE, no open run, no orphan, store whole; `died`: text the reason must hold."""
    status = wait_status(url, EngineState.OFFLINE, headers=headers)
    if died is not None:
        assert status.last_error is not None, "the engine died but last_error is empty"
        assert died in status.last_error.reason, status.last_error.reason
        run = httpx.get(f"{url}/runs/{status.last_error.run_id}", headers=headers,
                        timeout=30).json()
        assert run["status"] == "failed" and died in run["reason"], run
    for open_status in ("booting", "running"):
        page = httpx.get(f"{url}/runs", params={"status": open_status}, headers=headers,
                         timeout=30).json()
        assert page["total"] == 0, page
    assert_no_orphans(engine_pids)
    assert_store_whole(url, workdir, headers)
    return status
