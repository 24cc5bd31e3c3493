"""The approval store: binding to snapshot id and server URL, expiry, safe ids, files on disk."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mcp_bridge.approvals import (
    APPROVALS_DIR_ENV,
    ApprovalError,
    LaptopApprovalStatus,
    ApprovalStore,
    default_approvals_dir,
)

SNAP_A = "a" * 64
SNAP_B = "b" * 64
URL = "http://127.0.0.1:10086"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _request(store: ApprovalStore, snapshot_id: str = SNAP_A, url: str = URL):
    return store.request(snapshot_id=snapshot_id, server_url=url, repo="/repo",
                         summary="1 changed", diff="--- a\n+++ b\n",
                         files={"added": [], "changed": ["ajet/x.py"], "removed": []},
                         bytes_to_upload=10)


def test_pending_until_a_human_approves_then_bound_to_snapshot_and_server(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    filed = _request(store)
    assert filed.status is LaptopApprovalStatus.PENDING
    assert store.find_valid(SNAP_A, URL) is None

    approved = store.approve(filed.id, by="alice@laptop")
    assert approved.status is LaptopApprovalStatus.APPROVED and approved.decided_by == "alice@laptop"
    assert store.find_valid(SNAP_A, URL).id == filed.id
    assert store.find_valid(SNAP_A, URL + "/") is not None  # same server, trailing slash
    assert store.find_valid(SNAP_B, URL) is None  # other content
    assert store.find_valid(SNAP_A, "http://127.0.0.1:10087") is None  # other server


def test_same_content_reuses_the_pending_request(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    first = _request(store)
    assert _request(store).id == first.id
    assert _request(store, SNAP_B).id != first.id
    assert len(store.all()) == 2


def test_requests_and_approvals_expire(tmp_path: Path) -> None:
    clock = Clock()
    store = ApprovalStore(tmp_path, ttl_s=60, clock=clock)
    filed = _request(store)
    clock.now += 61
    with pytest.raises(ApprovalError, match="expired"):
        store.approve(filed.id)
    fresh = _request(store)  # the expired request is not reused
    assert fresh.id != filed.id
    store.approve(fresh.id)
    clock.now += 59
    assert store.find_valid(SNAP_A, URL) is not None  # valid for ttl from the decision
    clock.now += 2
    assert store.find_valid(SNAP_A, URL) is None


def test_decided_once_and_denial_is_not_an_approval(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    filed = _request(store)
    denied = store.deny(filed.id)
    assert denied.status is LaptopApprovalStatus.DENIED
    assert store.find_valid(SNAP_A, URL) is None
    assert store.latest_for(SNAP_A, URL).status is LaptopApprovalStatus.DENIED
    with pytest.raises(ApprovalError, match="already denied"):
        store.approve(filed.id)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "", "ABCDEFGH", "abc/def", "-rf"])
def test_ids_that_could_name_other_files_are_refused(tmp_path: Path, bad: str) -> None:
    store = ApprovalStore(tmp_path / "approvals")
    with pytest.raises(ApprovalError, match="not an approval id|no approval"):
        store.approve(bad)


def test_unknown_id_names_the_list_command(tmp_path: Path) -> None:
    with pytest.raises(ApprovalError, match="ajet-mcp approvals list"):
        ApprovalStore(tmp_path).get("abcdefgh")


def test_files_are_private_json_and_corrupt_ones_are_skipped(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    filed = _request(store)
    path = tmp_path / f"{filed.id}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["snapshot_id"] == SNAP_A
    (tmp_path / "zzzzzzzz.json").write_text("{not json")
    assert [a.id for a in store.all()] == [filed.id]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_mark_used_and_prune(tmp_path: Path) -> None:
    clock = Clock()
    store = ApprovalStore(tmp_path, ttl_s=10, clock=clock)
    filed = _request(store)
    store.approve(filed.id)
    assert store.mark_used(filed.id).used_at == clock.now
    clock.now += 8 * 86_400
    assert store.prune() == 1
    assert store.all() == []


def test_default_dir_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.setenv(APPROVALS_DIR_ENV, str(tmp_path / "mine"))
    assert default_approvals_dir() == tmp_path / "mine"
    monkeypatch.delenv(APPROVALS_DIR_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    expected = (Path.home() / "Library" / "Application Support" / "ajet-mcp" / "approvals"
                if os.uname().sysname == "Darwin" else tmp_path / "cfg" / "ajet-mcp" / "approvals")
    assert default_approvals_dir() == expected
