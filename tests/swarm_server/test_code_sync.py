"""Code sync end to end: real git repos, swarm servers (in process), the fake engine.

What is checked: exactly the git-tracked files reach `./ajet_temp/<timestamp>/ajet` and
the engine runs them; untracked files are named, not shipped; unchanged trees upload
nothing, a one-file edit uploads one blob; hostile zips and manifests are refused with
4xx and leave the snapshots byte-for-byte as they were; rollback, GC and audit.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict, SwarmNotFound, SwarmValidationError
from ajet.packaging import build_zip, package_tree, snapshot_id_of
from ajet.protocol import SERVER_CODE, BlobsUploaded, EngineState, FileEntry, Provenance
from ajet.errors import SwarmHTTPError
from swarm_server.ledger import Ledger
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore
from swarm_server.uploads import check_free_disk
from tests.support import (
    CONTROL_TOKEN,
    PROJECT_ROOT,
    WORKER_TOKEN,
    ServerHandle,
    make_ajet_repo,
    start_server,
)
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env
from tests.support.hostile import (
    HOSTILE_LIMITS,
    blob_record,
    commit_all,
    git,
    manifest_entry,
    snapshot_dirs,
    snapshot_folders_state,
    tree_digest,
    tree_repo,
)
from tests.support.hostile_zips import HOSTILE

SNAPSHOT_PATH = re.compile(r"^ajet_temp/\d{8}_\d{6}_\d{6}/ajet$")


def files_under(folder: Path) -> dict[str, bytes]:
    """Files of a snapshot's ajet/ folder as ajet/... paths, bytecode caches left out."""
    return {
        "ajet/" + p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture
def engine_server(server_factory: ServerFactory) -> Iterator[Server]:
    with server_factory.fresh(env=server_env()) as server:  # in process, one per test
        yield server


@pytest.fixture
def client(engine_server: Server) -> Iterator[SwarmClient]:
    with engine_server.client(timeout=60) as c:
        yield c


# ---------------------------------------------------------------------------- sync


def test_sync_ships_tracked_files_and_engine_runs_them(
        tmp_path: Path, engine_server: Server, client: SwarmClient) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    marker = f"PATCHED-{os.getpid()}-{time.time_ns()}"
    init = repo / "ajet" / "__init__.py"
    init.write_text(init.read_text() + f"\nimport sys as _s\n_s.stderr.write('{marker}\\n')\n")
    (repo / "ajet" / "new_module.py").write_text("UNTRACKED = True\n")
    server_ajet = client.version().ajet_file

    result = client.push_code(repo)

    # exactly the tracked files, with working-tree content, in ./ajet_temp/<timestamp>/ajet
    assert SNAPSHOT_PATH.match(result.path), result.path
    folder = engine_server.workdir / result.path
    tracked = set(git(repo, "ls-files", "--", "ajet").split())
    shipped = files_under(folder)
    assert set(shipped) == tracked
    assert all(shipped[p] == (repo / p).read_bytes() for p in tracked)
    assert marker in shipped["ajet/__init__.py"].decode()
    pycs = list(folder.glob("__pycache__/*.pyc"))
    assert pycs, "snapshot was not precompiled"
    assert all(int.from_bytes(p.read_bytes()[4:8], "little") == 0b01 for p in pycs)  # unchecked
    # the untracked module is named, not shipped
    assert result.untracked_left_out == ["ajet/new_module.py"]
    assert not (folder / "new_module.py").exists()
    # figures: every distinct blob went up once
    pkg = package_tree(repo)
    assert result.snapshot_id == pkg.snapshot_id and result.activated and not result.reused
    distinct = {f.sha256: f.size for f in pkg.files}
    assert result.files == len(distinct) and result.bytes_uploaded == sum(distinct.values())
    assert {"package_s", "manifest_s", "upload_s", "commit_s", "total_s"} <= set(result.timings)

    active = client.get_active_code()
    assert active is not None and active.snapshot_id == result.snapshot_id and active.active
    assert active.provenance.dirty and marker in active.provenance.diff
    assert active.provenance.untracked_left_out == ["ajet/new_module.py"]
    assert {f.path for f in active.files or []} == tracked
    blob = client.get_blob(next(f.sha256 for f in pkg.files if f.path == "ajet/__init__.py"))
    assert blob == init.read_bytes()

    # the engine starts on the snapshot and runs the patched code
    client.submit_config(AgentJetJob())
    status = client.start_run(wait=True, wait_timeout=60)
    assert status.snapshot_id == result.snapshot_id
    assert Path(status.ajet_file or "").resolve().is_relative_to(folder.resolve())
    log = (engine_server.workdir / "runs" / (status.run_id or "") / "engine.log").read_text()
    assert f"[start_engine] Using synced training code from ./{result.path}" in log
    assert marker in log
    assert f"Using synced training code from ./{result.path}" in engine_server.log()

    # syncing changed code while the engine runs: 409 unless force_restart
    (repo / "ajet" / "errors.py").write_text((repo / "ajet" / "errors.py").read_text() + "\n#\n")
    with pytest.raises(EngineStateConflict, match="force_restart"):
        client.push_code(repo)
    assert client.get_active_code().snapshot_id == result.snapshot_id  # type: ignore[union-attr]
    forced = client.push_code(repo, force_restart=True)
    assert forced.restarted and forced.run_id and forced.run_id != status.run_id
    assert forced.files == 0  # its one blob went up with the refused attempt
    status = client.wait_for_state(EngineState.ROLLING, timeout=60)
    assert status.run_id == forced.run_id and status.snapshot_id == forced.snapshot_id
    assert Path(status.ajet_file or "").resolve().is_relative_to(
        (engine_server.workdir / forced.path).resolve())
    client.stop_run()

    # the server's own code is untouched
    assert client.version().ajet_file == server_ajet
    assert not Path(server_ajet).resolve().is_relative_to(engine_server.workdir.resolve())
    assert marker not in (PROJECT_ROOT / "ajet" / "__init__.py").read_text()
    assert not (PROJECT_ROOT / "ajet" / "new_module.py").exists()

    actions = [(e.action, e.outcome.split(":")[0]) for e in client.get_audit().entries]
    assert ("sync_code", "ok") in actions and ("sync_code", "refused") in actions


def test_unchanged_tree_uploads_nothing_and_one_edit_uploads_one_blob(
        tmp_path: Path, engine_server: Server, client: SwarmClient) -> None:
    repo = tree_repo(tmp_path / "repo", 150, file_bytes=10_000)
    first = client.push_code(repo)
    assert first.files == len({f.sha256 for f in package_tree(repo).files})
    dirs = snapshot_dirs(engine_server.workdir)
    assert len(dirs) == 1

    again = client.push_code(repo)
    assert again.bytes_uploaded == 0 and again.files == 0 and again.reused
    assert again.snapshot_id == first.snapshot_id and again.path == first.path
    assert "commit_s" not in again.timings  # one round trip: the manifest
    assert snapshot_dirs(engine_server.workdir) == dirs

    edited = repo / "ajet" / "m7" / "mod_77.py"
    edited.write_text(edited.read_text() + "EDITED = True\n")
    one = client.push_code(repo)
    assert one.files == 1 and one.bytes_uploaded == edited.stat().st_size
    assert one.snapshot_id != first.snapshot_id and not one.reused
    assert len(snapshot_dirs(engine_server.workdir)) == 2
    assert (engine_server.workdir / one.path / "m7" / "mod_77.py").read_bytes() == \
        edited.read_bytes()
    assert "1 compiled now" in engine_server.log()  # bytecode of the rest came from the cache
    # the previous snapshot is immutable
    assert b"EDITED" not in (engine_server.workdir / first.path / "m7" / "mod_77.py").read_bytes()

    # the one-shot zip of the same tree is the same snapshot: nothing new is written
    zipped = client.push_code_zip(build_zip(package_tree(repo), tmp_path / "code.zip"))
    assert zipped.snapshot_id == one.snapshot_id and zipped.reused
    assert len(snapshot_dirs(engine_server.workdir)) == 2


def test_blob_lost_before_commit_is_uploaded_again(
        tmp_path: Path, engine_server: Server, client: SwarmClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tree_repo(tmp_path / "repo", 3)
    pkg = package_tree(repo)
    victim = next(f.sha256 for f in pkg.files if f.path.endswith("mod_2.py"))
    lost: list[str] = []
    real_upload = client.upload_blob_batch

    def upload_then_lose_a_blob(records: bytes) -> BlobsUploaded:
        answer = real_upload(records)
        if not lost:  # a GC elsewhere removes a fresh blob
            (engine_server.workdir / "ajet_temp" / ".blobs" / victim[:2] / victim).unlink()
            lost.append(victim)
        return answer

    monkeypatch.setattr(client, "upload_blob_batch", upload_then_lose_a_blob)
    result = client.push_code(repo)
    assert lost and result.snapshot_id == pkg.snapshot_id and result.activated
    assert result.files == len({f.sha256 for f in pkg.files}) + 1
    assert (engine_server.workdir / result.path / "m2" / "mod_2.py").read_bytes() == \
        (repo / "ajet" / "m2" / "mod_2.py").read_bytes()


def test_zip_sync_creates_and_activates_a_snapshot(
        tmp_path: Path, engine_server: Server, client: SwarmClient) -> None:
    repo = tree_repo(tmp_path / "repo", 5)
    pkg = package_tree(repo)
    result = client.push_code_zip(build_zip(pkg, tmp_path / "code.zip"))
    assert result.snapshot_id == pkg.snapshot_id and result.activated and not result.reused
    assert result.files == 11 and SNAPSHOT_PATH.match(result.path)
    assert set(files_under(engine_server.workdir / result.path)) == {f.path for f in pkg.files}
    active = client.get_active_code()
    assert active is not None and active.provenance.source == "zip"


def test_syntax_error_is_refused_and_nothing_is_activated(
        tmp_path: Path, engine_server: Server, client: SwarmClient) -> None:
    repo = tree_repo(tmp_path / "repo", 3)
    good = client.push_code(repo)
    (repo / "ajet" / "m1" / "mod_1.py").write_text("def broken(:\n")
    # the broken file's blob is uploaded (200) before the commit is refused; blobs and the
    # bytecode cache are content-addressed caches, the snapshot folders must not change
    before = snapshot_folders_state(engine_server.workdir)
    with pytest.raises(SwarmValidationError) as info:
        client.push_code(repo)
    assert info.value.status == 422 and '"ajet/m1/mod_1.py", line 1' in str(info.value.detail)
    assert snapshot_folders_state(engine_server.workdir) == before
    assert client.get_active_code().snapshot_id == good.snapshot_id  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- rollback, GC


def test_activate_earlier_snapshot_and_server_code(
        tmp_path: Path, engine_server: Server, client: SwarmClient) -> None:
    repo = tree_repo(tmp_path / "repo", 4)
    a = client.push_code(repo)
    (repo / "ajet" / "__init__.py").write_text('"""v2"""\n')
    b = client.push_code(repo)
    dirs = snapshot_dirs(engine_server.workdir)
    page = client.list_snapshots()
    assert page.active == b.snapshot_id
    assert [s.snapshot_id for s in page.snapshots] == [b.snapshot_id, a.snapshot_id]

    back = client.activate_snapshot(a.snapshot_id[:10])  # a unique prefix
    assert back.snapshot_id == a.snapshot_id and back.path == a.path and back.reused
    assert client.get_active_code().snapshot_id == a.snapshot_id  # type: ignore[union-attr]
    assert snapshot_dirs(engine_server.workdir) == dirs  # no upload, no new folder

    server = client.activate_snapshot(SERVER_CODE)
    assert server.snapshot_id == SERVER_CODE
    assert client.get_active_code() is None
    assert client.engine_status().snapshot_id == SERVER_CODE
    # with the server's code active the engine imports the installed ajet
    client.submit_config(AgentJetJob())
    status = client.start_run(wait=True, wait_timeout=60)
    assert Path(status.ajet_file or "").resolve() == Path(client.version().ajet_file).resolve()
    with pytest.raises(EngineStateConflict):
        client.activate_snapshot(b.snapshot_id)
    swapped = client.activate_snapshot(b.snapshot_id, force_restart=True)
    assert swapped.restarted and swapped.run_id
    status = client.wait_for_state(EngineState.ROLLING, timeout=60)
    assert Path(status.ajet_file or "").resolve().is_relative_to(
        (engine_server.workdir / b.path).resolve())
    client.stop_run()

    with pytest.raises(SwarmNotFound):
        client.activate_snapshot("0" * 64)
    with pytest.raises(SwarmValidationError):
        client.activate_snapshot("zz")
    actions = [e.action for e in client.get_audit().entries if e.outcome == "ok"]
    assert actions.count("activate") == 3


def test_gc_keeps_newest_active_and_run_used(
        tmp_path: Path, engine_server: Server, client: SwarmClient) -> None:
    repo = tree_repo(tmp_path / "repo", 3)
    ids: list[str] = []
    unique_blob: dict[str, str] = {}
    for i in range(4):
        path = repo / "ajet" / "version.py"
        path.write_text(f"V = {i}\n")
        commit_all(repo)
        result = client.push_code(repo)
        ids.append(result.snapshot_id)
        unique_blob[result.snapshot_id] = hashlib.sha256(path.read_bytes()).hexdigest()
        if i == 0:  # a run uses the first snapshot
            client.submit_config(AgentJetJob())
            client.start_run(wait=True, wait_timeout=60)
            client.stop_run()
    activated = client.activate_snapshot(ids[2])  # active: the third
    assert activated.snapshot_id == ids[2]

    result = client.gc_snapshots(keep=1)
    assert result.removed_snapshots == [ids[1]]
    assert set(result.kept) == {ids[0], ids[2], ids[3]}
    assert [s.snapshot_id for s in client.list_snapshots().snapshots] == [ids[3], ids[2], ids[0]]
    assert len(snapshot_dirs(engine_server.workdir)) == 3
    # the removed snapshot's own blob survives the grace period ...
    assert client.get_blob(unique_blob[ids[1]]) == b"V = 1\n"
    # ... and goes once it is old enough
    old = time.time() - 2 * 3600
    for blob in (engine_server.workdir / "ajet_temp" / ".blobs").rglob("*"):
        if blob.is_file():
            os.utime(blob, (old, old))
    assert client.gc_snapshots(keep=1).removed_blobs == 1
    with pytest.raises(SwarmNotFound):
        client.get_blob(unique_blob[ids[1]])
    for kept in (ids[0], ids[2], ids[3]):
        assert client.get_blob(unique_blob[kept]) == \
            f"V = {ids.index(kept)}\n".encode()
    with pytest.raises(SwarmNotFound):
        client.activate_snapshot(ids[1])
    cached = {p.name.split(".")[0] for p in (engine_server.workdir / "ajet_temp" / ".pyc").glob("*/*")}
    assert unique_blob[ids[1]] not in cached and unique_blob[ids[0]] in cached
    gc_entries = [e for e in client.get_audit().entries if e.action == "gc"]
    assert len(gc_entries) == 2 and gc_entries[0].detail["removed"] == [ids[1]]


# ---------------------------------------------------------------------------- hostile input


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path_factory.mktemp("hostile") / "swarm",
                          env=server_env(**HOSTILE_LIMITS))
    repo = tree_repo(tmp_path_factory.mktemp("hostile_repo") / "repo", 3)
    with SwarmClient(handle.url) as c:
        c.push_code(repo)  # something that must stay as it is
    yield handle
    handle.stop()


def _state(handle: ServerHandle) -> tuple[dict[str, str], dict[str, str]]:
    return (tree_digest(handle.workdir / "ajet_temp"), tree_digest(handle.workdir / "ajet_temp" / ".blobs"))


def _assert_untouched(handle: ServerHandle, before: tuple[dict[str, str], dict[str, str]]
                      ) -> None:
    assert _state(handle) == before
    incoming = handle.workdir / "ajet_temp" / ".incoming"
    assert not incoming.exists() or not any(incoming.iterdir())


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_zip_gets_4xx_and_changes_nothing(hostile_server: ServerHandle,
                                                  case: str) -> None:
    build, status, reason = HOSTILE[case]
    before = _state(hostile_server)
    response = httpx.post(f"{hostile_server.url}/sync_train_code", content=build(),
                          headers={"Content-Type": "application/zip"}, timeout=30)
    assert response.status_code == status, response.text
    body = response.json()
    assert reason in str(body["detail"]) and body["hint"]
    _assert_untouched(hostile_server, before)


_entry = manifest_entry


HOSTILE_MANIFESTS: dict[str, tuple[list[dict[str, object]], int]] = {
    "zip_slip": ([_entry("ajet/../../etc/cron.d/x")], 400),
    "absolute": ([_entry("/ajet/x.py")], 400),
    "backslash": ([_entry("ajet\\x.py")], 400),
    "nul": ([_entry("ajet/x\0.py")], 400),
    "non_ajet": ([_entry("setup.py")], 400),
    "dot_git": ([_entry("ajet/.git/hooks/pre-commit")], 400),
    "duplicate": ([_entry(), _entry()], 400),
    "case_collision": ([_entry("ajet/A.py"), _entry("ajet/a.py")], 400),
    "file_and_folder": ([_entry("ajet/a"), _entry("ajet/a/b.py")], 400),
    "bad_mode": ([_entry(mode=0o4755)], 400),
    "empty": ([], 400),
    "too_many_files": ([_entry(f"ajet/f{i}.py", f"{i}".encode()) for i in range(21)], 413),
    "file_too_big": ([{**_entry(), "size": (1 << 20) + 1}], 413),
    "total_too_big": ([{**_entry(f"ajet/b{i}.bin"), "size": 900_000} for i in range(5)], 413),
    "sha_not_hex": ([{**_entry(), "sha256": "Z" * 64}], 422),
    "negative_size": ([{**_entry(), "size": -1}], 422),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
@pytest.mark.parametrize("route", ["/code/manifest", "/code/commit"])
def test_hostile_manifest_gets_4xx_and_changes_nothing(hostile_server: ServerHandle, case: str,
                                                       route: str) -> None:
    files, status = HOSTILE_MANIFESTS[case]
    body: dict[str, object] = {"files": files}
    if route == "/code/commit":
        body["snapshot_id"] = "0" * 64
    before = _state(hostile_server)
    response = httpx.post(hostile_server.url + route, json=body, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["hint"]
    _assert_untouched(hostile_server, before)


_blob_record = blob_record


HOSTILE_BLOB_BODIES: dict[str, tuple[bytes, int, str]] = {
    "bad_sha256": (_blob_record(b"evil", sha=hashlib.sha256(b"good").hexdigest()), 400,
                   "does not match"),
    "bad_sha_after_good": (_blob_record(b"fine = 1\n")
                           + _blob_record(b"evil", sha=hashlib.sha256(b"good").hexdigest()),
                           400, "does not match"),
    "truncated": (_blob_record(b"0123456789")[:-3], 400, "truncated"),
    "truncated_header": (b"abc", 400, "truncated"),
    "bad_header": (b"not-a-hash 10\n0123456789", 400, "bad blob header"),
    "no_newline": (b"a" * 200, 400, "no newline"),
    "uppercase_sha": (_blob_record(b"x")[:64].upper() + _blob_record(b"x")[64:], 400,
                      "bad blob header"),
    "blob_too_big": (_blob_record(b"\0" * ((1 << 20) + 1)), 413, "file limit"),
    "too_many_blobs": (b"".join(_blob_record(f"{i}".encode()) for i in range(21)), 413,
                       "more than 20 blobs"),
    "body_too_big": (b"\0" * ((8 << 20) + 1), 413, "limit"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_BLOB_BODIES))
def test_hostile_blob_upload_gets_4xx_and_stores_nothing(hostile_server: ServerHandle,
                                                         case: str) -> None:
    data, status, reason = HOSTILE_BLOB_BODIES[case]
    before = _state(hostile_server)
    response = httpx.post(f"{hostile_server.url}/code/blobs", content=data, timeout=30)
    assert response.status_code == status, response.text
    assert reason in str(response.json()["detail"])
    _assert_untouched(hostile_server, before)


def test_commit_refuses_wrong_id_and_missing_blobs(hostile_server: ServerHandle) -> None:
    files = [_entry("ajet/never_uploaded.py", b"NEVER = 1\n")]
    before = _state(hostile_server)
    wrong = httpx.post(f"{hostile_server.url}/code/commit",
                       json={"files": files, "snapshot_id": "0" * 64}, timeout=30)
    assert wrong.status_code == 400 and "does not match" in wrong.text
    sid = snapshot_id_of([FileEntry.model_validate(f) for f in files])
    missing = httpx.post(f"{hostile_server.url}/code/commit",
                         json={"files": files, "snapshot_id": sid}, timeout=30)
    assert missing.status_code == 400, missing.text
    assert missing.json()["detail"]["missing"] == [files[0]["sha256"]]
    assert "POST /code/blobs" in missing.json()["hint"]
    _assert_untouched(hostile_server, before)


def test_interrupted_upload_leaves_nothing(hostile_server: ServerHandle) -> None:
    before = _state(hostile_server)
    for route in ("/sync_train_code", "/code/blobs"):
        with socket.create_connection(("127.0.0.1", hostile_server.port), timeout=10) as s:
            s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                      "Content-Type: application/octet-stream\r\n\r\n".encode()
                      + _blob_record(b"partial" * 100)[:300])
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    incoming = hostile_server.workdir / "ajet_temp" / ".incoming"
    while time.monotonic() < deadline and incoming.exists() and any(incoming.iterdir()):
        time.sleep(0.05)
    _assert_untouched(hostile_server, before)


def test_auth_worker_token_cannot_touch_code(tmp_path: Path) -> None:
    handle = start_server(tmp_path / "swarm", env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                                                   "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN})
    try:
        for token, expected in ((None, 401), (WORKER_TOKEN, 403), ("wrong", 401)):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            for method, route in (("GET", "/code"), ("GET", "/code/snapshots"),
                                  ("POST", "/code/manifest"), ("POST", "/code/blobs"),
                                  ("POST", "/sync_train_code"), ("POST", "/code/gc"),
                                  ("POST", "/code/activate"), ("GET", "/code/blobs/" + "0" * 64)):
                r = httpx.request(method, handle.url + route, headers=headers, timeout=10)
                assert r.status_code == expected, (route, token, r.text)
        repo = tree_repo(tmp_path / "repo", 2)
        with SwarmClient(handle.url, token=CONTROL_TOKEN) as c:
            assert c.push_code(repo).activated
    finally:
        handle.stop()


def test_compile_with_another_interpreter(tmp_path: Path) -> None:
    """An engine_python that is not the server's own interpreter compiles in a subprocess."""
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    settings = Settings(workdir=tmp_path / "w", engine_python=str(wrapper))
    store = SnapshotStore(settings, Ledger(settings.ledger_path))
    good, bad = b"def f():\n    return 1\n", b"def f(:\n"
    for data in (good, bad):
        blob = store.blob_path(hashlib.sha256(data).hexdigest())
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
    entry = _entry("ajet/good.py", good)
    rec, reused, _ = store.materialise([FileEntry.model_validate(entry)], Provenance())
    (pyc,) = (store.folder(rec) / "__pycache__").glob("good.*.pyc")
    assert not reused and pyc.name == f"good.{sys.implementation.cache_tag}.pyc"
    before = tree_digest(store.snapshots_dir)
    with pytest.raises(SwarmHTTPError) as info:
        store.materialise([FileEntry.model_validate(_entry("ajet/bad.py", bad))], Provenance())
    assert info.value.status == 422 and '"ajet/bad.py", line 1' in str(info.value.detail)
    assert ".partial" not in str(info.value.detail)
    assert tree_digest(store.snapshots_dir) == before


def test_free_disk_is_checked_first(tmp_path: Path) -> None:
    with pytest.raises(SwarmHTTPError) as info:
        check_free_disk(tmp_path, needed=0, keep_free=1 << 62)
    assert info.value.status == 507 and "gc" in info.value.hint
