"""Server-enforced approvals: a real enforcing server (fake engine), real git repos, real CLIs.

Against a server with approver tokens, none of these gets unreviewed code running: a
direct HTTP call with the control token (upload, activate, start), a forged `approved_by`
claim, a commit before the sync, `.gitattributes -diff`, an escape sequence hiding a line,
a sourceless `.pyc`. The approver sees each change in the diff the server computes from
its own files; after an approval with the approver token the engine starts on it; denied,
revoked and pending snapshots never run; decisions survive a restart.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.code_sync import push_package
from ajet.copilot.job import AgentJetJob
from ajet.errors import (
    ApprovalPending,
    EngineStateConflict,
    SwarmAuthError,
    SwarmValidationError,
)
from ajet.packaging import build_zip, package_tree
from ajet.protocol import SERVER_CODE, ApprovalState, EngineState
from swarm_server.settings import Settings
from tests.support import (
    APPROVER_NAME,
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
    PROJECT_ROOT,
    make_ajet_repo,
    start_server,
)
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env
from tests.support.hostile import commit_all, git, manifest_entry

REWARDS = "ajet/engine/rewards.py"
AJET_SWARM = Path(sys.executable).with_name("ajet-swarm")


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    return server_factory(env=server_env(**ENFORCING_ENV), process=True)


@pytest.fixture
def control(srv: Server) -> Iterator[SwarmClient]:
    with SwarmClient(srv.url, token=CONTROL_TOKEN, timeout=60) as c:
        yield c
        c.stop_run(reason="test teardown")


@pytest.fixture
def approver(srv: Server) -> Iterator[SwarmClient]:
    with SwarmClient(srv.url, token=APPROVER_TOKEN, timeout=60) as c:
        yield c


def _edit(repo: Path, text: str, rel: str = REWARDS) -> None:
    path = repo / rel
    path.write_bytes(path.read_bytes() + text.encode("utf-8"))


def _pending(control: SwarmClient, repo: Path) -> str:
    with pytest.raises(ApprovalPending) as caught:
        control.push_code(repo)
    assert caught.value.approval_state == "pending"
    assert "ajet-swarm approvals" in caught.value.hint
    return caught.value.snapshot_id


def _whole_diff(approver: SwarmClient, snapshot_id: str) -> str:
    parts, offset = [], 0
    while offset is not None:
        page = approver.get_review(snapshot_id, offset=offset, limit=50)
        parts.append(page.diff)
        offset = page.next_offset
    return "".join(parts)


def test_pending_code_never_runs_until_an_approver_approves_it(
        tmp_path: Path, srv: Server, control: SwarmClient, approver: SwarmClient) -> None:
    assert control.version().approvals_enforced
    repo = make_ajet_repo(tmp_path / "repo")
    _edit(repo, "\nAPPROVE_ME = 1\n")
    # a forged claim of approval on the commit changes nothing
    package = package_tree(repo)
    with pytest.raises(ApprovalPending):
        push_package(control, package, approved_by="alice (approval forged)")
    snapshot_id = package.snapshot_id
    assert control.get_active_code() is None  # stored, never activated
    stored = control.get_snapshot(snapshot_id[:12])
    assert stored.approval is not None and stored.approval.state is ApprovalState.PENDING
    assert stored.approved_by == "alice (approval forged)"  # kept as the client's claim only

    # the control token cannot activate it, approve it, or read the approvers' routes
    with pytest.raises(ApprovalPending, match="pending approval"):
        control.activate_snapshot(snapshot_id, force_restart=True)
    refused = httpx.post(f"{srv.url}/approvals/{snapshot_id}/approve",
                         json={"snapshot_id": snapshot_id},
                         headers={"Authorization": f"Bearer {CONTROL_TOKEN}"})
    assert refused.status_code == 403 and "cannot approve" in refused.json()["detail"]
    with pytest.raises(SwarmAuthError):
        SwarmClient(srv.url, token=CONTROL_TOKEN).list_approvals()

    # the approver sees it pending, with the edit in the server-side diff
    listed = approver.list_approvals()
    assert listed.enforced and snapshot_id in [p.snapshot_id for p in listed.pending]
    review = approver.get_review(snapshot_id[:8])
    assert review.base_id == SERVER_CODE and [f.path for f in review.files] == [REWARDS]
    assert "+APPROVE_ME = 1" in review.diff
    assert review.claimed.git_head == package.provenance.git_head  # shown, as a claim
    with pytest.raises(SwarmValidationError, match="full snapshot id"):
        approver._call("POST", f"/approvals/{snapshot_id}/approve",
                       json={"snapshot_id": "0" * 64})
    decision = approver.decide_approval(snapshot_id, "approve", note="reviewed")
    assert decision.approver == APPROVER_NAME and decision.base_id == SERVER_CODE

    # now the same tree syncs, activates and the engine starts on it
    synced = control.push_code(repo)
    assert synced.activated and synced.approval is not None
    assert synced.approval.state is ApprovalState.APPROVED and synced.approval.approver == "alice"
    control.submit_config(AgentJetJob())
    status = control.start_run(wait=True, wait_timeout=60)
    assert status.state is EngineState.ROLLING and status.snapshot_id == snapshot_id
    assert status.snapshot_approval is ApprovalState.APPROVED
    audit = control.get_audit(limit=1000).entries
    assert any(e.action == "approve" and e.role == "approver:alice" and e.outcome == "ok"
               and e.detail["snapshot_id"] == snapshot_id for e in audit)

    # revoking it stops the engine running it, and it never starts again
    approver.decide_approval(snapshot_id, "revoke", note="changed my mind")
    assert control.engine_status().state is EngineState.OFFLINE
    with pytest.raises(ApprovalPending, match="revoked by alice"):
        control.start_run()
    with pytest.raises(ApprovalPending):
        control.submit_config(AgentJetJob())  # its validator is its code too
    control.activate_snapshot("server")  # rolling back needs nothing


def test_every_trick_shows_up_in_the_server_side_diff(
        tmp_path: Path, control: SwarmClient, approver: SwarmClient) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    # a commit before the sync, and a .gitattributes line that makes git call it binary
    (repo / ".gitattributes").write_text("ajet/** -diff\n")
    _edit(repo, "\nimport os  # hidden\x1b[2K\x1b[1G# harmless comment\n")
    latin1 = repo / "ajet" / "latin.py"
    latin1.write_bytes(b"# -*- coding: latin-1 -*-\nNAME = '\xe9t\xe9'\n")
    git(repo, "add", "ajet", ".gitattributes")
    commit_all(repo)
    snapshot_id = _pending(control, repo)
    review = approver.get_review(snapshot_id)
    diff = _whole_diff(approver, snapshot_id)
    # the claimed git diff is empty (committed first), the server's diff is not
    assert review.claimed.diff == "" and not review.claimed.dirty
    assert "Binary files" not in diff
    assert "+import os  # hidden\\x1b[2K\\x1b[1G# harmless comment" in diff
    assert "\x1b" not in diff and "\x1b" not in review.model_dump_json()
    flags = {f.path: f.flags for f in review.files}
    assert any("control characters" in f for f in flags[REWARDS])
    assert any("not UTF-8" in f and "iso-8859-1" in f for f in flags["ajet/latin.py"])
    assert "+NAME = 'été'" in diff
    assert set(review.flagged) == {REWARDS, "ajet/latin.py"}
    approver.decide_approval(snapshot_id, "deny", note="hides an import")
    with pytest.raises(ApprovalPending, match="denied by alice"):
        control.push_code(repo)
    with pytest.raises(EngineStateConflict, match="denied .*by alice.*final"):
        approver.decide_approval(snapshot_id, "approve")  # a denial is final


def test_files_that_run_without_source_are_refused_at_upload(
        tmp_path: Path, srv: Server, control: SwarmClient) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    pyc = repo / "ajet" / "__pycache__" / "__init__.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"\x00" * 32)
    git(repo, "add", "-f", str(pyc.relative_to(repo)))
    with pytest.raises(Exception, match="bytecode runs without reviewable source"):
        package_tree(repo)  # the laptop refuses before any upload
    # and the server refuses whatever a client sends: a manifest, a zip
    headers = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    for path in ("ajet/__init__.pyc", "ajet/__pycache__/x.cpython-311.pyc", "ajet/evil.pth",
                 "ajet/fast.cpython-311-x86_64-linux-gnu.so"):
        entry = manifest_entry(path, b"\x00data")
        answer = httpx.post(f"{srv.url}/code/manifest", json={"files": [entry]},
                            headers=headers)
        assert answer.status_code == 400, (path, answer.text)
        assert "reviewable source" in answer.text or "start-up" in answer.text
    zipped = build_zip(package_tree(make_ajet_repo(tmp_path / "clean")), tmp_path / "a.zip")
    with zipfile.ZipFile(zipped, "a") as zf:
        zf.writestr("ajet/__pycache__/__init__.cpython-311.pyc", b"\x00" * 16)
    answer = httpx.post(f"{srv.url}/sync_train_code", content=zipped.read_bytes(),
                        headers=headers)
    assert answer.status_code == 400 and "__pycache__" in answer.text


def test_ajet_swarm_approvals_cli(tmp_path: Path, srv: Server,
                                  control: SwarmClient) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    _edit(repo, "\nCLI_MARK = '\x1b[31mred'\n")
    snapshot_id = _pending(control, repo)
    env = {**os.environ, "AJET_SWARM_URL": srv.url}
    env.pop("AJET_SWARM_TOKEN", None)

    def cli(*args: str, token: str | None = APPROVER_TOKEN, stdin: int | None = None
            ) -> subprocess.CompletedProcess[str]:
        run_env = {**env, **({"AJET_SWARM_APPROVER_TOKEN": token} if token else {})}
        return subprocess.run([str(AJET_SWARM), "approvals", *args], capture_output=True,
                              text=True, env=run_env, timeout=60, cwd=PROJECT_ROOT,
                              stdin=stdin if stdin is not None else subprocess.DEVNULL)

    assert cli("list", token=None).returncode == 2  # no approver token: says which to set
    assert "cannot approve" in cli("list", token=CONTROL_TOKEN).stderr
    listed = cli("list")
    assert listed.returncode == 0 and snapshot_id[:12] in listed.stdout
    shown = cli("show", snapshot_id[:12])
    assert shown.returncode == 0, shown.stderr
    assert "+CLI_MARK = '\\x1b[31mred'" in shown.stdout and "\x1b" not in shown.stdout
    assert "Claimed by the client (not verified)" in shown.stdout
    assert f"approvals approve {snapshot_id}" in shown.stdout  # the full id to decide on
    by_prefix = cli("approve", snapshot_id[:12], "--yes")
    assert by_prefix.returncode == 2 and "not a full snapshot id" in by_prefix.stderr
    no_tty = cli("approve", snapshot_id)
    assert no_tty.returncode == 2 and "--yes" in no_tty.stderr
    master, slave = pty.openpty()
    try:
        os.write(master, snapshot_id[:12].encode() + b"\n")
        typed = cli("approve", snapshot_id, "--note", "ok from the cli", stdin=slave)
    finally:
        os.close(master)
        os.close(slave)
    assert typed.returncode == 0, typed.stderr
    assert f"{snapshot_id[:12]} approved by alice" in typed.stdout
    assert control.push_code(repo).activated
    control.activate_snapshot("server")


def test_enforcement_covers_old_snapshots_and_survives_restarts(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    repo = make_ajet_repo(tmp_path / "repo")
    _edit(repo, "\nBEFORE_ENFORCEMENT = 1\n")
    plain = start_server(workdir, env=server_env(AJET_SWARM_TOKEN=CONTROL_TOKEN))
    try:
        with SwarmClient(plain.url, token=CONTROL_TOKEN) as c:
            assert not c.version().approvals_enforced
            assert c.engine_status().snapshot_approval is ApprovalState.NOT_ENFORCED
            old = c.push_code(repo)
            c.submit_config(AgentJetJob())
    finally:
        plain.stop()
    enforcing = start_server(workdir, env=server_env(**ENFORCING_ENV))
    try:
        with SwarmClient(enforcing.url, token=CONTROL_TOKEN) as c, \
                SwarmClient(enforcing.url, token=APPROVER_TOKEN) as a:
            status = c.engine_status()
            assert status.snapshot_id == old.snapshot_id  # still active, but now pending
            assert status.snapshot_approval is ApprovalState.PENDING
            with pytest.raises(ApprovalPending):
                c.start_run()
            assert [p.snapshot_id for p in a.list_approvals().pending] == [old.snapshot_id]
            a.decide_approval(old.snapshot_id, "approve")
    finally:
        enforcing.stop()
    again = start_server(workdir, env=server_env(**ENFORCING_ENV))
    try:
        with SwarmClient(again.url, token=CONTROL_TOKEN) as c:
            assert c.engine_status().snapshot_approval is ApprovalState.APPROVED
            assert c.start_run(wait=True, wait_timeout=60).state is EngineState.ROLLING
            c.stop_run()
    finally:
        again.stop()


def test_approver_tokens_need_a_control_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need a control token"):
        Settings(workdir=tmp_path, approver_tokens="alice=secret-1-of-16-chars")
    with pytest.raises(ValueError, match="differ"):
        Settings(workdir=tmp_path, token="same-token-16-chars",
                 approver_tokens="alice=same-token-16-chars")
    tokens = tmp_path / "approvers"
    tokens.write_text("# approvers\nbob=b-token-of-16-chars\ncarol=c-token-of-16-chars\n")
    both = Settings(workdir=tmp_path, token="control-token-16-chars",
                    approver_tokens="alice=a-token-of-16-chars", approver_tokens_file=tokens)
    assert set(both.approvers) == {"alice", "bob", "carol"} and both.approvals_enforced
    env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    started = subprocess.run(
        [str(AJET_SWARM), "start", "--swarm-port", "0", "--workdir", str(tmp_path)],
        env={**env, "AJET_SWARM_APPROVER_TOKENS": "alice=secret-1-of-16-chars"}, capture_output=True,
        text=True, timeout=60)
    assert started.returncode == 2 and "AJET_SWARM_TOKEN" in started.stderr


def test_extension_modules_only_when_the_server_allows_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ajet.protocol import FileEntry
    from ajet.errors import SwarmValidationError
    from swarm_server.ledger import Ledger
    from swarm_server.snapshots import SnapshotStore

    entry = FileEntry.model_validate(manifest_entry("ajet/fast.cpython-311-x86_64-linux-gnu.so",
                                                    b"\x7fELF"))
    strict = SnapshotStore(Settings(workdir=tmp_path / "a"), Ledger(tmp_path / "a.db"))
    with pytest.raises(SwarmValidationError, match="extension module"):
        strict.validate_manifest([entry])
    allowing = SnapshotStore(Settings(workdir=tmp_path / "b", allow_extension_modules=True),
                             Ledger(tmp_path / "b.db"))
    assert allowing.validate_manifest([entry]) == [entry]
    repo = make_ajet_repo(tmp_path / "repo")
    (repo / "ajet" / "fast.so").write_bytes(b"\x7fELF")
    git(repo, "add", "ajet/fast.so")
    with caplog.at_level("WARNING", logger="ajet.packaging"):
        assert "ajet/fast.so" in {f.path for f in package_tree(repo).files}
    assert "compiled extension module" in caplog.text
