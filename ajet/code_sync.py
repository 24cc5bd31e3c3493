"""`push_tree`: incremental, content-addressed code sync from a laptop to the swarm server.

    package (git ls-files -- ajet)  ->  POST /code/manifest  ->  POST /code/blobs
    (only the blobs the server lacks)  ->  POST /code/commit

An unchanged tree that is already the active code costs the manifest round trip only:
nothing is uploaded and nothing is committed. A one-file edit uploads that file. The
result reports what was uploaded, the untracked files left out ("git add them"), and
per-phase timings, so an agent sees at once what reached the cluster.

Blob upload body (see `swarm_server.uploads`): records of `<sha256> <size>\\n` followed
by exactly `size` bytes, batched up to `batch_bytes` per request. Each file is re-read
and re-hashed just before it is sent; a file edited since packaging raises
`PackagingError` rather than shipping content the manifest does not describe.

The calls go through the client's public typed methods (`check_manifest`,
`upload_blob_batch`, `commit_snapshot`), named by the `CodeSyncClient` protocol, so this
module does not import the client (which calls `push_tree` from `push_code`).

Laptop side: macOS and Linux, no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ajet.errors import SwarmValidationError
from ajet.packaging import Package, package_tree
from ajet.protocol import (
    BlobsUploaded,
    CodeSyncResult,
    CommitRequest,
    FileEntry,
    ManifestResponse,
    Provenance,
)

__all__ = ["DEFAULT_BATCH_BYTES", "CodeSyncClient", "push_package", "push_tree", "upload_blobs"]

log = logging.getLogger(__name__)

#: Bytes of blob data per `POST /code/blobs` request (well under the server's body cap).
DEFAULT_BATCH_BYTES = 16 * 1024 * 1024


class CodeSyncClient(Protocol):
    """The calls a sync needs; `ajet.client.SwarmClient` has them."""

    def check_manifest(self, files: list[FileEntry],
                       provenance: Provenance | None = None) -> ManifestResponse: ...

    def upload_blob_batch(self, records: bytes) -> BlobsUploaded: ...

    def commit_snapshot(self, request: CommitRequest) -> CodeSyncResult: ...


def push_tree(client: CodeSyncClient, path: str | Path, force_restart: bool = False, *,
              approved_by: str | None = None) -> CodeSyncResult:
    """Package `<path>/ajet` (git-tracked files) and sync it; see `push_package`."""
    t0 = time.perf_counter()
    package = package_tree(path)
    t1 = time.perf_counter()
    result = push_package(client, package, force_restart=force_restart, approved_by=approved_by)
    result.timings = {"package_s": round(t1 - t0, 4), **result.timings,
                      "total_s": round(time.perf_counter() - t0, 4)}
    return result


def push_package(client: CodeSyncClient, package: Package, *, force_restart: bool = False,
                 approved_by: str | None = None, activate: bool = True,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> CodeSyncResult:
    """Sync an already packaged tree (the MCP bridge packages first to show and approve it).

    With `force_restart` a running engine is stopped, the new code activated and the
    engine restarted with its last config; without it a running engine makes the server
    answer 409 (`EngineStateConflict`). Code that is already active is never restarted.
    On a server that enforces approvals, unapproved content is stored and then refused
    activation (`ApprovalPending`, a 409); `activate=False` only stores it (for review).
    """
    entries = package.entries()
    provenance = package.provenance
    timings: dict[str, float] = {}

    t = time.perf_counter()
    plan = client.check_manifest(entries, provenance)
    timings["manifest_s"] = round(time.perf_counter() - t, 4)
    if plan.snapshot_id != package.snapshot_id:
        log.warning("server computed snapshot id %s, the client %s; the server's wins",
                    plan.snapshot_id, package.snapshot_id)
    untracked = list(package.provenance.untracked_left_out)
    _warn_untracked(untracked)

    if plan.exists and plan.active and plan.state is not None:
        # Already the running code: nothing to upload, nothing to activate or restart.
        timings["client_total_s"] = timings["manifest_s"]
        return CodeSyncResult(
            snapshot_id=plan.snapshot_id, path=plan.path or "", reused=True, activated=True,
            restarted=False, state=plan.state, files=0, bytes_uploaded=0,
            untracked_left_out=untracked, timings=timings,
        )

    t = time.perf_counter()
    files_up, bytes_up = upload_blobs(client, package, plan.missing, batch_bytes=batch_bytes)
    timings["upload_s"] = round(time.perf_counter() - t, 4)

    t = time.perf_counter()
    commit = CommitRequest(snapshot_id=plan.snapshot_id, files=entries, provenance=provenance,
                           force_restart=force_restart, approved_by=approved_by,
                           activate=activate)
    try:
        result = client.commit_snapshot(commit)
    except SwarmValidationError as exc:
        # Blobs can vanish between manifest and commit (GC on a busy server): ask again
        # which are missing, upload those, and commit once more.
        if not (isinstance(exc.detail, dict) and exc.detail.get("missing")):
            raise
        again = client.check_manifest(entries, provenance)
        log.info("the server lost %d blob(s) before the commit; uploading them again",
                 len(again.missing))
        more_files, more_bytes = upload_blobs(client, package, again.missing,
                                              batch_bytes=batch_bytes)
        files_up, bytes_up = files_up + more_files, bytes_up + more_bytes
        result = client.commit_snapshot(commit)
    timings["commit_s"] = round(time.perf_counter() - t, 4)
    timings["client_total_s"] = round(sum(timings.values()), 4)
    result.files = files_up
    result.bytes_uploaded = bytes_up
    result.untracked_left_out = untracked
    result.timings = {**timings, **{f"server_{k}": v for k, v in result.timings.items()}}
    log.info("synced snapshot %s to ./%s: %d file(s), %d byte(s) uploaded%s",
             result.snapshot_id[:12], result.path, files_up, bytes_up,
             ", engine restarted" if result.restarted else "")
    return result


def upload_blobs(client: CodeSyncClient, package: Package, missing: Sequence[str], *,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> tuple[int, int]:
    """Upload the blobs `missing` from `package`; returns (blobs sent, blob bytes sent)."""
    files = bytes_sent = 0
    for batch in _batches(package, missing, batch_bytes):
        body = b"".join(part for sha, data in batch
                        for part in (f"{sha} {len(data)}\n".encode("ascii"), data))
        answer = client.upload_blob_batch(body)
        files += len(batch)
        bytes_sent += sum(len(data) for _, data in batch)
        log.debug("uploaded %d blob(s), %d new on the server", len(batch), len(answer.stored))
    return files, bytes_sent


def _batches(package: Package, missing: Sequence[str], batch_bytes: int
             ) -> Iterator[list[tuple[str, bytes]]]:
    """Groups of (sha, verified bytes) of at most `batch_bytes` (or one larger blob)."""
    batch: list[tuple[str, bytes]] = []
    size = 0
    for sha in dict.fromkeys(missing):
        data = package.read_blob(sha)  # raises PackagingError if the file changed
        if batch and size + len(data) > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append((sha, data))
        size += len(data)
    if batch:
        yield batch


def _warn_untracked(untracked: list[str]) -> None:
    if untracked:
        shown = ", ".join(untracked[:5]) + (" ..." if len(untracked) > 5 else "")
        log.warning("%d untracked file(s) under ajet/ were not synced (git add them): %s",
                    len(untracked), shown)
