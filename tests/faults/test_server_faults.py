"""The server killed (SIGKILL) in the middle of a code upload and of a snapshot's
materialisation; caps and a full disk reached while writing.

After a restart on the same workdir nothing half-written is visible: no `*.partial`
snapshot, no upload temp files, no new snapshot or blob, the previous code still active,
and the next sync and engine start work.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import SwarmError
from ajet.packaging import snapshot_id_of
from ajet.protocol import FileEntry
from tests.support import ServerHandle, start_server
from tests.support.fake_engine import server_env
from tests.support.hostile import HOSTILE_LIMITS, blob_record, snapshot_dirs, store_state, tree_repo
from tests.support.invariants import assert_consistent, assert_store_whole

SLOW_FLAG = "slow_compile"


def kill_hard(server: ServerHandle) -> None:
    """SIGKILL the server and everything it spawned, as an OOM kill of its cgroup would."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    server.kill(signal.SIGKILL)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def wait_for(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def incoming_files(workdir: Path, name: str) -> list[Path]:
    incoming = workdir / "ajet_temp" / ".incoming"
    return [p for p in incoming.rglob(name) if p.stat().st_size > 0] if incoming.is_dir() else []


def send_partial(port: int, path: str, head: bytes, declared: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n"
              "Content-Type: application/octet-stream\r\n\r\n".encode() + head)
    return s


@pytest.fixture
def seeded(tmp_path: Path) -> Iterator[tuple[Path, Path, str]]:
    """A workdir holding one active snapshot; (workdir, repo, snapshot id)."""
    workdir = tmp_path / "swarm"
    repo = tree_repo(tmp_path / "repo", 3)
    server = start_server(workdir, env=server_env())
    try:
        with SwarmClient(server.url) as client:
            snapshot = client.push_code(repo).snapshot_id
            client.submit_config(AgentJetJob(experiment_name="faults"))
    finally:
        server.stop()
    yield workdir, repo, snapshot


def check_recovered(workdir: Path, before: object, snapshot: str, repo: Path) -> None:
    """Restart on the workdir: store as before, old code active, sync and start work."""
    server = start_server(workdir, env=server_env())
    try:
        assert store_state(workdir) == before
        assert_consistent(server.url, workdir)
        with SwarmClient(server.url) as client:
            assert client.engine_status().snapshot_id == snapshot
            (repo / "ajet" / "after_fault.py").write_text("RECOVERED = True\n")
            subprocess.run(["git", "-C", str(repo), "add", "ajet"], check=True)
            synced = client.push_code(repo)
            assert synced.activated and synced.snapshot_id != snapshot
            status = client.start_run(wait=True, wait_timeout=60)
            assert status.snapshot_id == synced.snapshot_id
            client.stop_run()
        assert_store_whole(server.url, workdir)
    finally:
        server.stop()


# ---------------------------------------------------------------------------- uploads


@pytest.mark.parametrize("route", ["/sync_train_code", "/code/blobs"])
def test_server_sigkilled_during_an_upload(seeded: tuple[Path, Path, str], route: str) -> None:
    workdir, repo, snapshot = seeded
    before = store_state(workdir)
    server = start_server(workdir, env=server_env())
    data = os.urandom(1 << 20)
    if route == "/code/blobs":  # one 2 MiB blob, half of it sent
        head = f"{hashlib.sha256(data * 2).hexdigest()} {2 << 20}\n".encode() + data
        temp_name = "*.blob"
    else:
        head, temp_name = data, "upload.zip"
    conn = send_partial(server.port, route, head, declared=4 << 20)
    try:
        wait_for(lambda: incoming_files(workdir, temp_name), "the upload's temp file")
        kill_hard(server)
    finally:
        conn.close()
    assert incoming_files(workdir, temp_name), "the kill did not land mid-upload"
    check_recovered(workdir, before, snapshot, repo)


def test_server_sigkilled_during_snapshot_materialisation(seeded: tuple[Path, Path, str],
                                                         tmp_path: Path) -> None:
    workdir, repo, snapshot = seeded
    # The engine interpreter compiles each new snapshot; this one stalls while a flag file
    # exists, holding the server inside materialise() with its `.partial` folder written.
    flag = tmp_path / SLOW_FLAG
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *compileall*) [ -e "{flag}" ] && sleep 60;; '
                       f'esac\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = server_env(AJET_SWARM_ENGINE_PYTHON=str(wrapper))
    (repo / "ajet" / "new_module.py").write_text("NEW = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "ajet"], check=True)
    before = store_state(workdir)
    flag.touch()
    server = start_server(workdir, env=env)
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            with SwarmClient(server.url, timeout=120) as client:
                client.push_code(repo)
        except (SwarmError, httpx.HTTPError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=sync)
    thread.start()
    partials = lambda: list((workdir / "ajet_temp").glob("*.partial"))  # noqa: E731
    wait_for(partials, "a snapshot being materialised")
    kill_hard(server)
    thread.join(60)
    assert errors, "the sync finished before the kill"
    assert partials(), "the kill did not land during materialisation"
    flag.unlink()
    # blobs uploaded before the commit may stay (the store is content-addressed and
    # GC sweeps unreferenced ones); snapshot folders must be exactly as before
    new_before = (before[0], store_state(workdir)[1])
    check_recovered(workdir, new_before, snapshot, repo)


# ---------------------------------------------------------------------------- caps, disk


def test_unpacked_cap_reached_while_materialising_a_lying_manifest(tmp_path: Path) -> None:
    # Eight 900 KB blobs, each under the 1 MiB file cap but 7 MB in all against a 4 MiB
    # cap; the manifest claims 1 byte each so that its declared total passes the check.
    workdir = tmp_path / "swarm"
    server = start_server(workdir, env=server_env(**HOSTILE_LIMITS))
    try:
        blobs = [hashlib.sha256(b"%d" % i).digest() * (900_000 // 32) for i in range(8)]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for blob in blobs:
                assert http.post("/code/blobs", content=blob_record(blob)).status_code == 200
            files = [{"path": f"ajet/big{i}.bin", "sha256": hashlib.sha256(b).hexdigest(),
                      "size": 1, "mode": 0o644} for i, b in enumerate(blobs)]
            sid = snapshot_id_of([FileEntry.model_validate(f) for f in files])
            assert http.post("/code/manifest", json={"files": files}).json()["missing"] == []
            before = store_state(workdir)
            response = http.post("/code/commit", json={"files": files, "snapshot_id": sid})
        assert response.status_code == 400, response.text
        assert "differs from the uploaded content" in response.json()["detail"]
        assert store_state(workdir) == before
        assert snapshot_dirs(workdir) == []
        assert_consistent(server.url, workdir)
    finally:
        server.stop()


def test_disk_filling_up_during_an_upload_is_507_and_leaves_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    incoming = workdir / "ajet_temp" / ".incoming"
    incoming.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(incoming)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"needs a 1 MiB tmpfs (root): {mount.stderr.strip()}")
    try:
        # no reserve, so the only thing stopping the writes is the full disk itself
        server = start_server(workdir, env=server_env(AJET_SWARM_MIN_FREE_DISK_BYTES="0"))
        try:
            def chunks() -> Iterator[bytes]:  # chunked: no size declared up front
                for _ in range(8):
                    yield os.urandom(256 * 1024)

            for route in ("/sync_train_code", "/code/blobs"):
                body = chunks() if route == "/sync_train_code" else iter(
                    [f"{'0' * 64} {2 << 20}\n".encode(), *chunks()])
                r = httpx.post(server.url + route, content=body, timeout=60)
                assert r.status_code == 507, (route, r.text)
                assert "disk" in r.json()["detail"] and "gc" in r.json()["hint"]
                assert not any(incoming.iterdir())
            assert_consistent(server.url, workdir)
        finally:
            server.stop()
    finally:
        subprocess.run(["umount", str(incoming)], check=False)

