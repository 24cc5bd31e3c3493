"""Download a run's checkpoint: resumable, verified against the server's hashes.

    path = download_checkpoint(client, run_id, Path("out"))         # the latest complete
    path = download_checkpoint(client, run_id, Path("out"), name="step_40")

The archive is a tar that the server builds the same way every time, so an interrupted
download is resumed with a `Range` request (guarded by the manifest's ETag: if the
checkpoint changed, it starts over). It lands in `<dest>/.<run>-<name>.tar.part`, is
unpacked into a hidden staging folder with tarfile's `data` filter (no absolute paths,
links or devices), every file is checked against the manifest's size and sha256, and
only then is the folder renamed to `<dest>/<name>`: a failed download leaves nothing
that looks finished.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tarfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import httpx

from ajet.errors import SwarmError
from ajet.protocol import CheckpointManifest, CheckpointsPage

__all__ = ["CheckpointSource", "download_checkpoint", "latest_complete"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


class CheckpointSource(Protocol):
    """The three calls a download needs; `ajet.client.SwarmClient` has them (this module
    does not import it, as `SwarmClient.download_checkpoint` calls this one)."""

    def list_checkpoints(self, run_id: str = "current") -> CheckpointsPage: ...

    def checkpoint_manifest(self, run_id: str, name: str) -> CheckpointManifest: ...

    def open_checkpoint_archive(self, run_id: str, name: str, *, start: int = 0,
                                if_range: str | None = None
                                ) -> AbstractContextManager[httpx.Response]: ...


class DownloadError(SwarmError):
    """The download did not arrive whole, or a file does not match the server's hash."""


def latest_complete(page: CheckpointsPage) -> str:
    """`final` when it is complete, else the complete checkpoint of the highest step."""
    complete = [c for c in page.checkpoints if c.complete]
    if not complete:
        raise DownloadError(f"run {page.run_id} has no complete checkpoint yet; list them with "
                            "list_checkpoints (a run saves every save_every steps and at stop)")
    final = [c for c in complete if c.kind == "final"]
    return (final or sorted(complete, key=lambda c: c.step or 0))[-1].name


def download_checkpoint(client: CheckpointSource, run_id: str, dest: Path, *,
                        name: str | None = None) -> Path:
    """See the module docstring; returns `<dest>/<name>`."""
    page = client.list_checkpoints(run_id)
    name = name or latest_complete(page)
    target = dest / name
    if target.exists():
        raise FileExistsError(f"{target} exists already; remove it or choose another folder")
    manifest = client.checkpoint_manifest(page.run_id, name)
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / f".{page.run_id}-{name}.tar.part"
    tag = dest / f".{page.run_id}-{name}.etag"
    resumable = part.is_file() and tag.is_file() and tag.read_text() == manifest.etag
    start = part.stat().st_size if resumable else 0
    if start > manifest.archive_bytes:  # not this archive's bytes: start over
        start = 0
    tag.write_text(manifest.etag)
    if start < manifest.archive_bytes:  # else all arrived before; only the checks are left
        _fetch(client, page.run_id, name, part, start=start, etag=manifest.etag)
    got = part.stat().st_size
    if got != manifest.archive_bytes:
        raise DownloadError(f"{got} of {manifest.archive_bytes} bytes arrived; run the download "
                            "again to resume")
    staging = dest / f".{page.run_id}-{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        try:
            with tarfile.open(part) as tar:
                tar.extractall(staging, filter="data")
            _verify(staging / name, manifest)
        except (tarfile.TarError, DownloadError) as exc:
            # bad bytes are not resumed: the next call downloads the archive again
            part.unlink(missing_ok=True)
            tag.unlink(missing_ok=True)
            raise DownloadError(f"checkpoint {name} of run {page.run_id}: {exc}") from exc
        (staging / name).rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    part.unlink()
    tag.unlink(missing_ok=True)
    log.info("checkpoint %s of run %s: %d files in %s", name, page.run_id,
             len(manifest.files), target)
    return target


def _fetch(client: CheckpointSource, run_id: str, name: str, part: Path, *, start: int,
           etag: str) -> None:
    with client.open_checkpoint_archive(run_id, name, start=start, if_range=etag) as response:
        mode = "ab" if response.status_code == 206 else "wb"
        if start and mode == "ab":
            log.info("resuming %s at byte %d", name, start)
        with open(part, mode) as f:
            for chunk in response.iter_bytes(_CHUNK):
                f.write(chunk)


def _verify(folder: Path, manifest: CheckpointManifest) -> None:
    expected = {f.path: f for f in manifest.files}
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if found != set(expected):
        extra, lost = sorted(found - set(expected)), sorted(set(expected) - found)
        raise DownloadError(f"the archive does not match the manifest: extra {extra[:5]}, "
                            f"missing {lost[:5]}; download again")
    for rel, entry in expected.items():
        path = folder / rel
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        if path.stat().st_size != entry.size or digest.hexdigest() != entry.sha256:
            raise DownloadError(f"{rel} does not match the server's sha256; download again")
