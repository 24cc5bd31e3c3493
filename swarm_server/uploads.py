"""Upload bodies: streamed to disk with limits checked as bytes arrive, never held whole.

Two shapes arrive here:

- a zip for `POST /sync_train_code`, spooled to a temp file by `spool_body` (zip's
  central directory sits at the end, so the archive must be on disk before it can be
  read safely; `swarm_server.safe_zip` takes it from there);
- a blob stream for `POST /code/blobs`, parsed on the fly by `BlobStreamParser`.

Blob stream format (the body of `POST /code/blobs`, `application/octet-stream`): zero or
more records, each an ASCII header line `<sha256 as 64 lowercase hex> <size in
decimal>\\n` followed by exactly `size` raw bytes. Each blob is hashed while it is
written to a temp file and refused (400) if its bytes do not match its sha256; the
whole request is refused if the body ends inside a record.

Temp files live under `ajet_temp/.incoming/` (a folder made at start, holding nothing
between requests) and are removed when the request ends, accepted or not.
"""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ajet.errors import PayloadTooLarge, SwarmHTTPError, SwarmValidationError

__all__ = [
    "BlobStreamParser",
    "StagedBlob",
    "check_free_disk",
    "declared_length",
    "disk_full_is_507",
    "spool_body",
]

_HEADER = re.compile(rb"^([0-9a-f]{64}) (0|[1-9][0-9]{0,11})$")
_MAX_HEADER = 80  # 64 hex + space + 12 digits + slack


def declared_length(content_length: str | None, *, limit: int) -> int | None:
    """The request's Content-Length, refused up front when it passes `limit`."""
    if content_length is None:
        return None
    try:
        n = int(content_length)
    except ValueError as exc:
        raise SwarmValidationError(400, f"bad Content-Length {content_length!r}") from exc
    if n < 0:
        raise SwarmValidationError(400, f"bad Content-Length {content_length!r}")
    if n > limit:
        raise PayloadTooLarge(
            413, f"upload of {n} bytes is over the server's {limit}-byte limit",
            "sync fewer or smaller files, or raise AJET_SWARM_MAX_UPLOAD_BYTES on the server",
        )
    return n


def check_free_disk(where: Path, *, needed: int, keep_free: int) -> None:
    """Refuse (507) when writing `needed` bytes under `where` would leave under `keep_free`."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free - needed < keep_free:
        raise SwarmHTTPError(  # 507: the server's disk, not the client's fault
            507, f"not enough free disk on the server: {free} bytes free, {needed} needed, "
            f"{keep_free} kept in reserve",
            "free disk on the server (POST /code/gc removes old snapshots) and sync again",
        )


@contextmanager
def disk_full_is_507() -> Iterator[None]:
    """Turn a write that found the disk full (ENOSPC, EDQUOT) into a 507, not a 500.

    The free-disk check runs first, but another writer (or a body with no declared
    size) can still fill the disk mid-write; the caller's temp folder is removed either way.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise SwarmHTTPError(
            507, f"the server's disk filled up while writing ({exc.strerror})",
            "free disk on the server (POST /code/gc removes old snapshots) and sync again",
        ) from exc


async def spool_body(chunks: AsyncIterator[bytes], dest: Path, *, limit: int) -> int:
    """Write a request body to `dest`, refusing (413) as soon as it passes `limit` bytes."""
    received = 0
    with open(dest, "wb") as fh:
        async for chunk in chunks:
            received += len(chunk)
            if received > limit:
                raise PayloadTooLarge(
                    413, f"upload passed the server's {limit}-byte limit",
                    "sync fewer or smaller files, or raise AJET_SWARM_MAX_UPLOAD_BYTES",
                )
            fh.write(chunk)
    return received


@dataclass(frozen=True)
class StagedBlob:
    sha256: str
    size: int
    path: Path  # verified temp file, to be adopted into the blob store


class BlobStreamParser:
    """Incremental parser of the blob stream format (see the module docstring).

    Feed it the body chunk by chunk; `finish()` returns the verified blobs. A blob the
    store already holds (`have(sha)`) is read past without being written.
    """

    def __init__(self, staging: Path, *, max_blob_bytes: int, max_blobs: int,
                 have: Callable[[str], bool]) -> None:
        self._staging = staging
        self._max_blob_bytes = max_blob_bytes
        self._max_blobs = max_blobs
        self._have = have
        self._header = bytearray()
        self._sha: str | None = None
        self._left = 0
        self._digest = hashlib.sha256()
        self._out: BinaryIO | None = None
        self._out_path: Path | None = None
        self._count = 0
        self.staged: dict[str, StagedBlob] = {}
        self.already_present: list[str] = []

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._sha is None:
                view = self._feed_header(view)
            else:
                take = min(self._left, len(view))
                self._digest.update(view[:take])
                if self._out is not None:
                    self._out.write(view[:take])
                self._left -= take
                view = view[take:]
                if self._left == 0:
                    self._end_blob()

    def finish(self) -> list[StagedBlob]:
        if self._sha is not None or self._header:
            self._close_out()
            raise SwarmValidationError(
                400, "blob stream ended inside a record (truncated upload)",
                "send each blob as '<sha256> <size>\\n' followed by exactly <size> bytes",
            )
        return list(self.staged.values())

    def close(self) -> None:
        """Release the open temp file, if any (the caller removes the staging folder)."""
        self._close_out()

    # ------------------------------------------------------------------ private

    def _feed_header(self, view: memoryview) -> memoryview:
        end = bytes(view[: _MAX_HEADER + 1]).find(b"\n")
        if end < 0:
            self._header += view
            if len(self._header) > _MAX_HEADER:
                raise SwarmValidationError(400, "bad blob header: no newline within 80 bytes",
                                           "each record starts with '<sha256> <size>\\n'")
            return view[len(view):]
        self._header += view[:end]
        rest = view[end + 1:]
        match = _HEADER.match(bytes(self._header))
        self._header.clear()
        if match is None:
            raise SwarmValidationError(400, "bad blob header; expected '<64 lowercase hex> <size>'",
                                       "each record starts with '<sha256> <size>\\n'")
        sha, size = match.group(1).decode(), int(match.group(2))
        if size > self._max_blob_bytes:
            raise PayloadTooLarge(
                413, f"blob {sha} is {size} bytes, over the {self._max_blob_bytes}-byte file limit",
                "keep large files out of ajet/ or raise AJET_SWARM_MAX_FILE_BYTES",
            )
        self._count += 1
        if self._count > self._max_blobs:
            raise PayloadTooLarge(413, f"more than {self._max_blobs} blobs in one upload",
                                  "upload in several requests")
        self._sha, self._left, self._digest = sha, size, hashlib.sha256()
        if sha not in self.staged and not self._have(sha):
            self._out_path = self._staging / f"{self._count}.blob"
            self._out = open(self._out_path, "wb")
        if size == 0:
            self._end_blob()
        return rest

    def _end_blob(self) -> None:
        sha, self._sha = self._sha, None
        if sha is None:  # not inside a record: nothing to close
            return
        path = self._out_path
        self._close_out()
        if self._digest.hexdigest() != sha:
            raise SwarmValidationError(
                400, f"blob content does not match its sha256 {sha}",
                "hash the exact bytes you send; re-run the sync if the file changed meanwhile",
            )
        if path is not None:
            size = path.stat().st_size
            self.staged[sha] = StagedBlob(sha, size, path)
        elif sha not in self.staged:
            self.already_present.append(sha)

    def _close_out(self) -> None:
        if self._out is not None:
            self._out.close()
        self._out = None
        self._out_path = None
