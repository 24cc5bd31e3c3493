"""Safe extraction of an uploaded zip (`POST /sync_train_code`) into verified blobs.

The archive is already on disk (spooled with a byte cap by `swarm_server.uploads`).
`SafeZip.open` then judges it from its central directory alone, before inflating
anything:

- the entry count in the end-of-central-directory record is capped before Python's
  `zipfile` parses the directory;
- every member is a regular file under `ajet/` (folder entries under `ajet/` are allowed
  and ignored); names follow `ajet.packaging.member_path_problem` (no absolute path,
  `..`, backslash, NUL or control character) and, taken together,
  `ajet.packaging.tree_problems` (no duplicates, no names that collide once case-folded,
  no path that is both file and folder); symlinks, devices, FIFOs, encrypted members and
  compression methods other than stored/deflate are refused;
- declared sizes are capped (files, bytes per file, bytes in all, compression ratio per
  file and overall), and the members' compressed sizes must fit in the archive
  (overlapping-member bombs).

`SafeZip.extract` then inflates member by member, in chunks, into temp files named by
nothing the archive controls, hashing as it goes and re-checking the caps on the bytes
actually produced, so a lying header cannot make it write more than the caps allow.

Errors are `SwarmValidationError` (400: malformed or forbidden content) or
`PayloadTooLarge` (413: a cap was passed); the caller removes the staging folder either way.
"""

from __future__ import annotations

import hashlib
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ajet.packaging import member_path_problem, tree_problems
from ajet.errors import PayloadTooLarge, SwarmValidationError
from swarm_server.settings import Settings

__all__ = ["SafeZip", "ZipLimits", "ZipMember"]

_CHUNK = 64 * 1024
#: Below this many bytes a high compression ratio is normal (short, repetitive files).
_RATIO_FLOOR_BYTES = 64 * 1024
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_EOCD_SIG = b"PK\x06\x06"
_ALLOWED_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_HINT = "zip only regular files under ajet/ (ajet.packaging.build_zip makes such a zip)"
_LIMIT_HINT = "sync fewer or smaller files, or raise the server's AJET_SWARM_MAX_* limits"


@dataclass(frozen=True)
class ZipLimits:
    max_files: int
    max_file_bytes: int
    max_unpacked_bytes: int
    max_compression_ratio: float

    @classmethod
    def from_settings(cls, settings: Settings) -> ZipLimits:
        return cls(settings.max_files, settings.max_file_bytes, settings.max_unpacked_bytes,
                   settings.max_compression_ratio)


@dataclass(frozen=True)
class ZipMember:
    path: str
    sha256: str
    size: int
    mode: int  # 0o644 or 0o755
    staged: Path  # verified temp file holding the member's bytes


class SafeZip:
    """A zip archive judged safe from its central directory; extract with `extract()`."""

    def __init__(self, zf: zipfile.ZipFile, files: list[zipfile.ZipInfo], limits: ZipLimits
                 ) -> None:
        self._zf = zf
        self._files = files
        self._limits = limits

    @classmethod
    def open(cls, path: Path, limits: ZipLimits) -> SafeZip:
        archive_size = path.stat().st_size
        entries = _declared_entry_count(path, archive_size)
        # Folder entries are allowed too, hence the slack over max_files.
        if entries > 2 * limits.max_files + 16:
            raise PayloadTooLarge(413, f"zip declares {entries} entries; the limit is "
                                  f"{limits.max_files} files", _LIMIT_HINT)
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError) as exc:
            raise SwarmValidationError(400, f"not a readable zip archive: {exc}", _HINT) from exc
        try:
            files = _judge(zf.infolist(), limits, archive_size)
        except BaseException:
            zf.close()
            raise
        return cls(zf, files, limits)

    @property
    def total_bytes(self) -> int:
        """Declared unpacked size of all files (already within the caps)."""
        return sum(i.file_size for i in self._files)

    @property
    def file_count(self) -> int:
        return len(self._files)

    def close(self) -> None:
        self._zf.close()

    def __enter__(self) -> SafeZip:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def extract(self, staging: Path) -> list[ZipMember]:
        """Inflate every file into `staging/<n>.blob`, hashing and re-checking caps."""
        staging.mkdir(parents=True, exist_ok=True)
        members: list[ZipMember] = []
        total = 0
        for n, info in enumerate(self._files):
            dest = staging / f"{n}.blob"
            size, sha = self._inflate(info, dest, total)
            total += size
            members.append(ZipMember(info.orig_filename, sha, size, _mode(info), dest))
        return members

    def _inflate(self, info: zipfile.ZipInfo, dest: Path, total_before: int) -> tuple[int, str]:
        lim = self._limits
        name = info.orig_filename
        digest = hashlib.sha256()
        produced = 0
        try:
            with self._zf.open(info) as src, open(dest, "wb") as out:
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    produced += len(chunk)
                    # Caps re-checked on real output: a header may lie about sizes.
                    if produced > info.file_size:
                        raise SwarmValidationError(
                            400, f"{name}: inflates past its declared size", _HINT)
                    if produced > lim.max_file_bytes:
                        raise PayloadTooLarge(413, f"{name}: over the {lim.max_file_bytes}-byte "
                                              "file limit", _LIMIT_HINT)
                    if total_before + produced > lim.max_unpacked_bytes:
                        raise PayloadTooLarge(413, f"zip unpacks to over {lim.max_unpacked_bytes} "
                                              "bytes", _LIMIT_HINT)
                    if (produced > _RATIO_FLOOR_BYTES
                            and produced / max(info.compress_size, 1) > lim.max_compression_ratio):
                        raise PayloadTooLarge(413, f"{name}: compression ratio over "
                                              f"{lim.max_compression_ratio:g}", _LIMIT_HINT)
                    digest.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, EOFError, zlib.error, ValueError, NotImplementedError,
                RuntimeError) as exc:
            raise SwarmValidationError(
                400, f"{name}: corrupt or truncated member ({exc})", _HINT) from exc
        if produced != info.file_size:
            raise SwarmValidationError(400, f"{name}: {produced} bytes, but the archive declares "
                                       f"{info.file_size}", _HINT)
        return produced, digest.hexdigest()


def _mode(info: zipfile.ZipInfo) -> int:
    unix = info.external_attr >> 16 if info.create_system == 3 else 0
    return 0o755 if unix & stat.S_IXUSR else 0o644


def _judge(infos: list[zipfile.ZipInfo], limits: ZipLimits, archive_size: int
           ) -> list[zipfile.ZipInfo]:
    """The file members, once every entry passed every rule (else 400/413)."""
    files: list[zipfile.ZipInfo] = []
    folders: list[str] = []
    problems: list[str] = []
    compressed = 0
    for info in infos:
        name = info.orig_filename  # before zipfile cuts it at a NUL byte
        unix = info.external_attr >> 16 if info.create_system == 3 else 0
        kind = stat.S_IFMT(unix)
        is_folder = name.endswith("/")
        plain = name[:-1] if is_folder else name
        bad = None if plain == "ajet" and is_folder else member_path_problem(plain)
        if bad:
            problems.append(f"{name!r}: {bad}")
            continue
        if info.flag_bits & 0x1:
            problems.append(f"{name}: encrypted member")
            continue
        if is_folder:
            if kind not in (0, stat.S_IFDIR) or info.file_size:
                problems.append(f"{name}: folder entry with content or a special type")
            else:
                folders.append(plain)
            continue
        if kind == stat.S_IFLNK:
            problems.append(f"{name}: symlink (only regular files are accepted)")
            continue
        if kind not in (0, stat.S_IFREG) or info.external_attr & 0x10:  # 0x10: MS-DOS folder
            problems.append(f"{name}: special entry (only regular files are accepted)")
            continue
        if info.compress_type not in _ALLOWED_METHODS:
            problems.append(f"{name}: compression method {info.compress_type} "
                            "(only stored and deflate)")
            continue
        files.append(info)
        compressed += info.compress_size
    names = [i.orig_filename for i in files]
    problems.extend(tree_problems(names))
    file_keys = {n.casefold() for n in names}
    problems.extend(f"{d}/: folder entry names a file" for d in folders
                    if d.casefold() in file_keys)
    if problems:
        shown = "; ".join(problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise SwarmValidationError(400, f"zip refused: {shown}{more}", _HINT)
    if not files:
        raise SwarmValidationError(400, "zip holds no files under ajet/", _HINT)
    if len(files) > limits.max_files:
        raise PayloadTooLarge(413, f"zip holds {len(files)} files; the limit is {limits.max_files}",
                              _LIMIT_HINT)
    if compressed > archive_size:
        raise SwarmValidationError(
            400, "zip members overlap (their compressed sizes exceed the archive)",
            _HINT)
    total = 0
    for info in files:
        if info.file_size > limits.max_file_bytes:
            raise PayloadTooLarge(413, f"{info.orig_filename}: {info.file_size} bytes, over the "
                                  f"{limits.max_file_bytes}-byte file limit", _LIMIT_HINT)
        if (info.file_size > _RATIO_FLOOR_BYTES
                and info.file_size / max(info.compress_size, 1) > limits.max_compression_ratio):
            raise PayloadTooLarge(413, f"{info.orig_filename}: compression ratio over "
                                  f"{limits.max_compression_ratio:g} (zip bomb?)", _LIMIT_HINT)
        total += info.file_size
    if total > limits.max_unpacked_bytes:
        raise PayloadTooLarge(413, f"zip unpacks to {total} bytes; the limit is "
                              f"{limits.max_unpacked_bytes}", _LIMIT_HINT)
    if total > _RATIO_FLOOR_BYTES and total / max(compressed, 1) > limits.max_compression_ratio:
        raise PayloadTooLarge(413, f"zip compression ratio over {limits.max_compression_ratio:g} "
                              "(zip bomb?)", _LIMIT_HINT)
    return files


def _declared_entry_count(path: Path, archive_size: int) -> int:
    """Entry count from the end-of-central-directory record (zip64 aware).

    Read before `zipfile` parses the directory, so a body that declares millions of
    entries is refused without building millions of objects.
    """
    tail_len = min(archive_size, 22 + 65535 + 20)
    with open(path, "rb") as fh:
        fh.seek(archive_size - tail_len)
        tail = fh.read(tail_len)
        at = tail.rfind(_EOCD_SIG)
        if at < 0 or len(tail) - at < 22:
            raise SwarmValidationError(
                400, "not a zip archive (no end-of-central-directory record; "
                "truncated upload?)", _HINT)
        count = struct.unpack("<H", tail[at + 10: at + 12])[0]
        if count != 0xFFFF or at < 20 or tail[at - 20: at - 16] != _ZIP64_LOCATOR_SIG:
            return int(count)
        offset = struct.unpack("<Q", tail[at - 12: at - 4])[0]
        if offset + 56 > archive_size:
            raise SwarmValidationError(400, "corrupt zip64 end-of-central-directory locator", _HINT)
        fh.seek(offset)
        record = fh.read(56)
    if record[:4] != _ZIP64_EOCD_SIG:
        raise SwarmValidationError(400, "corrupt zip64 end-of-central-directory record", _HINT)
    return int(struct.unpack("<Q", record[32:40])[0])

