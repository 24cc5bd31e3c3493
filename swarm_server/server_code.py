"""`ServerCode`: the server's own installed `ajet/` as a manifest (snapshot id `server`).

The server's own code is what runs when no snapshot is active, and what a first sync (or
a sync after rolling back to `server`) replaces; so it is the other side of that sync's
review. Its files are listed like a snapshot's (`ajet/...` paths, sha256, size, mode),
leaving out bytecode caches, and served by hash to the control and approver roles
(`GET /code/server`, `GET /code/server/blobs/{sha256}`).

Hashes are cached per file by (size, mtime): an editable install can change under a
running server, and the manifest then follows it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from pathlib import Path

from ajet.protocol import FileEntry

__all__ = ["ServerCode"]

log = logging.getLogger(__name__)

_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


class ServerCode:
    """The files of one installed `ajet` package folder."""

    def __init__(self, ajet_dir: Path) -> None:
        self.ajet_dir = ajet_dir.resolve()
        self._lock = threading.Lock()
        self._hashes: dict[str, tuple[int, int, str]] = {}  # rel -> (size, mtime_ns, sha)

    def manifest(self) -> list[FileEntry]:
        """Every regular file under the folder (no bytecode, no symlinks), sorted by path."""
        entries: list[FileEntry] = []
        with self._lock:
            seen: set[str] = set()
            for folder, dirs, files in os.walk(self.ajet_dir):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
                for name in files:
                    if name.endswith(_SKIP_SUFFIXES):
                        continue
                    path = Path(folder) / name
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    rel = "ajet/" + path.relative_to(self.ajet_dir).as_posix()
                    seen.add(rel)
                    cached = self._hashes.get(rel)
                    if cached is None or cached[:2] != (st.st_size, st.st_mtime_ns):
                        cached = (st.st_size, st.st_mtime_ns, _sha256(path))
                        self._hashes[rel] = cached
                    mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
                    entries.append(FileEntry(path=rel, sha256=cached[2], size=cached[0],
                                             mode=mode))
            for gone in set(self._hashes) - seen:
                del self._hashes[gone]
        return sorted(entries, key=lambda e: e.path.encode("utf-8"))

    def path_of(self, sha256: str) -> Path | None:
        """A file of the server's code with this content, or None."""
        for entry in self.manifest():
            if entry.sha256 == sha256:
                return self.ajet_dir / entry.path.removeprefix("ajet/")
        return None

    def read(self, entry: FileEntry) -> bytes:
        """The bytes of one manifest entry (checked against its hash)."""
        data = (self.ajet_dir / entry.path.removeprefix("ajet/")).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            log.warning("%s changed while being read", entry.path)
        return data


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()
