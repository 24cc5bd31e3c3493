"""A run's checkpoints, listed, hashed and streamed as a tar that is the same every time.

The engine writes `checkpoints/step_<n>/` and `final/` in the run directory, each first
as `<name>.partial` (`ajet/engine/checkpoints.py`). This module reads them for the
server's routes:

- `list_checkpoints`: name, step, kind, size, file count, complete or not;
- `checkpoint_manifest`: every file's path, size and sha256 (cached beside the run's
  files, keyed by each file's size and mtime), what a download is verified against;
- `TarLayout`: the checkpoint as a tar, laid out before a byte is read: entries sorted,
  times 0, owner 0, modes 0644/0755, so the same checkpoint is the same bytes at every
  request, and a `Range` request (a resumed download) reads only the part it asks for.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_NAME", "CheckpointFile", "TarLayout", "checkpoint_dir",
           "checkpoint_manifest", "list_checkpoints"]

#: A checkpoint's name in a URL: `final`, `step_<n>`, or either with `.partial`.
CHECKPOINT_NAME = re.compile(r"(final|step_\d{1,9})(\.partial)?")
_BLOCK = tarfile.BLOCKSIZE
_READ = 1 << 20


@dataclass(frozen=True)
class CheckpointFile:
    path: str  # relative to the checkpoint folder, with "/"
    size: int
    mode: int


def checkpoint_dir(run_dir: Path, name: str) -> Path | None:
    """The folder of checkpoint `name` of a run, or None (no such name or folder)."""
    if not CHECKPOINT_NAME.fullmatch(name):
        return None
    folder = run_dir / name if name.startswith("final") else run_dir / "checkpoints" / name
    return folder if folder.is_dir() and not folder.is_symlink() else None


def _files(folder: Path) -> list[CheckpointFile]:
    """Regular files under `folder`, sorted; symlinks and other kinds are left out."""
    out = []
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        st = path.stat()
        out.append(CheckpointFile(path.relative_to(folder).as_posix(), st.st_size,
                                  0o755 if st.st_mode & 0o100 else 0o644))
    return out


def list_checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    """Every checkpoint folder of the run, oldest step first, `final` last."""
    folders = [p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()]
    folders += [p for p in run_dir.glob("final*") if p.is_dir()]
    found = []
    for folder in folders:
        name = folder.name
        if not CHECKPOINT_NAME.fullmatch(name):
            continue
        files = _files(folder)
        meta = _meta(folder)
        complete = not name.endswith(".partial") and meta is not None
        digits = re.findall(r"\d+", name)
        step = meta.get("step") if meta else (int(digits[0]) if digits else None)
        found.append({"name": name, "kind": "final" if name.startswith("final") else "step",
                      "step": step, "complete": complete, "files": len(files),
                      "bytes": sum(f.size for f in files),
                      "lora": bool(meta.get("lora")) if meta else None,
                      "merged": (folder / "merged").is_dir()})
    return sorted(found, key=lambda c: (c["kind"] == "final", c["step"] or 0, c["name"]))


def _meta(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / "ajet_checkpoint.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_manifest(folder: Path, cache_dir: Path) -> list[dict[str, Any]]:
    """Path, size and sha256 of every file, hashed once per (size, mtime) and cached."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache_path = cache_dir / f"{folder.name}.json"
    try:
        cached = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cached = {}
    entries, fresh = [], {}
    for f in _files(folder):
        stamp = f"{f.size}:{(folder / f.path).stat().st_mtime_ns}"
        known = cached.get(f.path)
        digest = known["sha256"] if known and known.get("stamp") == stamp else _sha256(folder / f.path)
        fresh[f.path] = {"stamp": stamp, "sha256": digest}
        entries.append({"path": f.path, "size": f.size, "sha256": digest})
    cache_path.write_text(json.dumps(fresh))
    return entries


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


class TarLayout:
    """The checkpoint folder `folder` as a tar whose members live under `<prefix>/`."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder = folder
        #: (offset, length, header bytes or a file to read)
        self.segments: list[tuple[int, int, bytes | Path]] = []
        at = 0
        for f in _files(folder):
            header = _header(f"{prefix}/{f.path}", f.size, f.mode)
            self.segments.append((at, len(header), header))
            at += len(header)
            self.segments.append((at, f.size, folder / f.path))
            at += f.size
            pad = -f.size % _BLOCK
            if pad:
                self.segments.append((at, pad, b"\0" * pad))
                at += pad
        self.segments.append((at, 2 * _BLOCK, b"\0" * (2 * _BLOCK)))  # end of archive
        self.size = at + 2 * _BLOCK

    def read(self, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The bytes `start` to `end` (exclusive; default: to the end), in pieces."""
        end = self.size if end is None else min(end, self.size)
        for offset, length, source in self.segments:
            lo, hi = max(start, offset), min(end, offset + length)
            if lo >= hi:
                continue
            if isinstance(source, bytes):
                yield source[lo - offset:hi - offset]
                continue
            with open(source, "rb") as f:
                f.seek(lo - offset)
                left = hi - lo
                while left > 0:
                    chunk = f.read(min(_READ, left))
                    if not chunk:  # the file shrank after the layout: fail, never pad
                        raise OSError(f"{source} changed while it was being sent")
                    left -= len(chunk)
                    yield chunk


def _header(name: str, size: int, mode: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")
