"""Generated hostile uploads against a real server: each one gets a 4xx and leaves the
snapshot store, the blob store and the rest of the workdir exactly as they were.

The named corpus (tests/swarm_server/test_safe_zip.py, test_code_sync.py) pins one case
per rule; here hypothesis combines attacks with random honest content, positions and
sizes. Every value is hostile by construction (tests/support/strategies.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ajet.packaging import snapshot_id_of
from ajet.protocol import FileEntry
from tests.support import CONTROL_TOKEN
from tests.support.factory import Server, ServerFactory
from tests.support.hostile import HOSTILE_LIMITS, blob_record, make_zip, tree_digest, tree_repo
from tests.support.strategies import hostile_blob_streams, hostile_manifests, hostile_zips

CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
#: Blobs the server holds before the attacks (manifests may name them).
STORED = [b"alpha = 1\n", b"beta = 2\n" * 50, b""]
#: Files of the workdir that legitimately change on every request (audit log, logs).
_MUTABLE = ("swarm.sqlite3", "server-")

HYPOTHESIS = settings(max_examples=100, deadline=None, database=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Server:
    handle = server_factory(env={"AJET_SWARM_TOKEN": CONTROL_TOKEN, **HOSTILE_LIMITS},
                            process=True)
    repo = tree_repo(tmp_path_factory.mktemp("repo") / "repo", 3)
    with handle.client(CONTROL_TOKEN) as client:
        client.push_code(repo)  # a snapshot that must stay as it is
    body = b"".join(blob_record(b) for b in STORED)
    assert handle.http.post("/code/blobs", content=body, headers=CTL).status_code == 200
    return handle


def workdir_state(workdir: Path) -> dict[str, str]:
    """Every file and folder of the workdir (snapshots, blobs, bytecode, temp files) byte
    for byte, but the ledger and logs."""
    return {k: v for k, v in tree_digest(workdir).items() if not k.startswith(_MUTABLE)}


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    """One connection pool for all examples (a new client per call costs ~10-40 ms)."""
    with httpx.Client(base_url=srv.url, headers=CTL, timeout=60) as client:
        yield client


def snapshot_ids(http: httpx.Client) -> list[str]:
    page = http.get("/code/snapshots").json()
    return [s["snapshot_id"] for s in page["snapshots"]] + [page["active"]]


def assert_refused_and_untouched(srv: Server, http: httpx.Client,
                                 response: httpx.Response, before: dict[str, str],
                                 ids: list[str], attack: str) -> None:
    assert 400 <= response.status_code < 500, (attack, response.status_code, response.text)
    body = response.json()
    assert body["detail"] and body["hint"], (attack, body)
    assert workdir_state(srv.workdir) == before, attack
    assert snapshot_ids(http) == ids, attack


@HYPOTHESIS
@given(case=hostile_zips())
def test_generated_hostile_zip_is_refused_and_changes_nothing(
        srv: Server, http: httpx.Client, case: tuple[str, bytes]) -> None:
    attack, data = case
    before, ids = workdir_state(srv.workdir), snapshot_ids(http)
    response = http.post("/sync_train_code", content=data,
                         headers={"Content-Type": "application/zip"})
    assert_refused_and_untouched(srv, http, response, before, ids, attack)


def _snapshot_id(files: list[dict[str, Any]]) -> str:
    try:
        return snapshot_id_of([FileEntry.model_validate(f) for f in files])
    except Exception:  # noqa: BLE001 - not a valid entry at all: any id will do
        return "0" * 64


@HYPOTHESIS
@given(case=hostile_manifests(stored=STORED), force_restart=st.booleans())
def test_generated_hostile_manifest_commit_is_refused_and_changes_nothing(
        srv: Server, http: httpx.Client, case: tuple[str, list[dict[str, Any]]],
        force_restart: bool) -> None:
    attack, files = case
    before, ids = workdir_state(srv.workdir), snapshot_ids(http)
    response = http.post("/code/commit", json={
        "files": files, "snapshot_id": _snapshot_id(files), "force_restart": force_restart})
    assert_refused_and_untouched(srv, http, response, before, ids, attack)


@HYPOTHESIS
@given(case=hostile_manifests(stored=STORED))
def test_generated_hostile_manifest_question_writes_nothing(
        srv: Server, http: httpx.Client, case: tuple[str, list[dict[str, Any]]]) -> None:
    attack, files = case
    before, ids = workdir_state(srv.workdir), snapshot_ids(http)
    response = http.post("/code/manifest", json={"files": files})
    if attack in ("unknown_hash", "lying_size"):
        # a question about blobs: answered, and the commit is where it is refused
        assert response.status_code == 200, response.text
        missing = response.json()["missing"]
        assert (attack == "unknown_hash") == bool(missing)
        assert workdir_state(srv.workdir) == before and snapshot_ids(http) == ids
    else:
        assert_refused_and_untouched(srv, http, response, before, ids, attack)


@HYPOTHESIS
@given(case=hostile_blob_streams())
def test_generated_hostile_blob_stream_stores_nothing(srv: Server, http: httpx.Client,
                                                      case: tuple[str, bytes]) -> None:
    attack, data = case
    before, ids = workdir_state(srv.workdir), snapshot_ids(http)
    response = http.post("/code/blobs", content=data)
    assert_refused_and_untouched(srv, http, response, before, ids, attack)


def test_a_manifest_that_lies_about_sizes_cannot_pass_the_unpacked_cap(
        srv: Server, http: httpx.Client) -> None:
    # Eight 900 KB blobs, each under the 1 MiB file cap, 7 MB in all against a 4 MiB cap;
    # the manifest claims 1 byte each so that its declared total passes.
    blobs = [hashlib.sha256(b"%d" % i).digest() * (900_000 // 32) for i in range(8)]
    for blob in blobs:
        assert http.post("/code/blobs", content=blob_record(blob)).status_code == 200
    files = [{"path": f"ajet/big{i}.bin", "sha256": hashlib.sha256(b).hexdigest(), "size": 1,
              "mode": 0o644} for i, b in enumerate(blobs)]
    before, ids = workdir_state(srv.workdir), snapshot_ids(http)
    response = http.post("/code/commit",
                         json={"files": files, "snapshot_id": _snapshot_id(files)})
    assert_refused_and_untouched(srv, http, response, before, ids, "lying sizes")
    assert "differs from the uploaded content" in response.json()["detail"]


def test_a_zip_of_code_that_does_not_compile_adds_no_blob(srv: Server,
                                                          http: httpx.Client) -> None:
    data = make_zip([("ajet/__init__.py", b""), ("ajet/evil.py", b"def broken(:\n"),
                     ("ajet/nul.py", b"x = 1\0\n")])
    before, ids = workdir_state(srv.workdir), snapshot_ids(http)
    response = http.post("/sync_train_code", content=data,
                         headers={"Content-Type": "application/zip"})
    assert response.status_code == 422, response.text
    assert_refused_and_untouched(srv, http, response, before, ids, "does not compile")
