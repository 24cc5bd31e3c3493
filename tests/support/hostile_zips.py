"""A corpus of hostile zip archives: each builder, the status it must get, and the reason.

`HOSTILE` is checked against `swarm_server.safe_zip` directly (test_safe_zip.py) and through
the real upload route (test_code_sync.py). The limits it assumes: max_files=20 and the
sizes of `tests.support.hostile.HOSTILE_LIMITS`.
"""

from __future__ import annotations

import io
import stat
import zipfile
from collections.abc import Callable

import pytest

from tests.support.hostile import central_entries, make_zip, patch, with_raw_name

__all__ = ["HOSTILE", "bomb_zip"]


def symlink_zip() -> bytes:
    return make_zip([("ajet/link", b"/etc/passwd")], mode=stat.S_IFLNK | 0o777)


def fifo_zip() -> bytes:
    return make_zip([("ajet/pipe", b"")], mode=stat.S_IFIFO | 0o644)


def duplicate_zip() -> bytes:
    buf = io.BytesIO()
    with pytest.warns(UserWarning), zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ajet/a.py", "a = 1\n")
        zf.writestr("ajet/a.py", "a = 2\n")
    return buf.getvalue()


def bomb_zip() -> bytes:
    return make_zip([("ajet/bomb.txt", b"\0" * (900 * 1024))])


def many_small_bombs_zip() -> bytes:
    # each file below the per-file ratio floor, but 3 MB of zeros in all
    return make_zip([(f"ajet/z{i}.txt", b"\0" * 60_000) for i in range(19)]
                    + [("ajet/pad.txt", b"\0" * 60_000)])


def too_many_files_zip() -> bytes:
    return make_zip([(f"ajet/m{i}.py", b"x = 1\n") for i in range(21)])


def declares_many_entries_zip() -> bytes:
    data = make_zip([("ajet/a.py", b"x = 1\n")])
    eocd = data.rfind(b"PK\x05\x06")
    data = patch(data, eocd + 8, "<H", 60000)
    return patch(data, eocd + 10, "<H", 60000)


def too_big_file_zip() -> bytes:
    return make_zip([("ajet/big.bin", bytes(range(256)) * 4200)], method=zipfile.ZIP_STORED)


def too_big_total_zip() -> bytes:
    blob = bytes(range(256)) * 3000  # 768 KB, incompressible enough
    return make_zip([(f"ajet/b{i}.bin", blob) for i in range(6)], method=zipfile.ZIP_STORED)


def truncated_zip() -> bytes:
    data = make_zip([("ajet/a.py", b"x = 1\n" * 100), ("ajet/b.py", b"y = 2\n")])
    return data[: len(data) // 2]


def corrupt_data_zip() -> bytes:
    data = bytearray(make_zip([("ajet/a.py", b"print('hello world')\n" * 50)]))
    data[40] ^= 0xFF  # inside the first member's compressed bytes
    return bytes(data)


def lying_size_zip() -> bytes:
    data = make_zip([("ajet/a.py", b"0123456789")], method=zipfile.ZIP_STORED)
    return patch(data, central_entries(data)[0] + 24, "<I", 4)  # declared size 4, real 10


def encrypted_zip() -> bytes:
    data = make_zip([("ajet/a.py", b"x = 1\n")])
    return patch(data, central_entries(data)[0] + 8, "<H", 0x1)


def overlapping_zip() -> bytes:
    data = make_zip([("ajet/a.py", b"x = 1\n")], method=zipfile.ZIP_STORED)
    at = central_entries(data)[0]
    data = patch(data, at + 20, "<I", 10_000)  # compressed size larger than the archive
    return data


def not_a_zip() -> bytes:
    return b"this is not a zip archive at all" * 10


HOSTILE: dict[str, tuple[Callable[[], bytes], int, str]] = {
    "zip_slip": (lambda: make_zip([("ajet/../../evil.py", b"x")]), 400, "'..'"),
    "zip_slip_top": (lambda: make_zip([("../evil.py", b"x")]), 400, "'..'"),
    "absolute": (lambda: make_zip([("/ajet/evil.py", b"x")]), 400, "absolute"),
    "backslash": (lambda: make_zip([("ajet\\..\\evil.py", b"x")]), 400, "backslash"),
    "nul_name": (lambda: with_raw_name("ajet/a.pyXevil", b"a.pyXevil", b"a.py\0evil"), 400,
                 "NUL"),
    "control_char": (lambda: with_raw_name("ajet/a.pyXb", b"a.pyXb", b"a.py\x1bb"), 400,
                     "control"),
    "non_ajet": (lambda: make_zip([("other/x.py", b"x")]), 400, "not under ajet/"),
    "ajet_file": (lambda: make_zip([("ajet", b"x")]), 400, "not under ajet/"),
    "dot_git": (lambda: make_zip([("ajet/.git/config", b"x")]), 400, ".git"),
    "symlink": (symlink_zip, 400, "symlink"),
    "fifo": (fifo_zip, 400, "special entry"),
    "duplicate": (duplicate_zip, 400, "duplicate"),
    "case_collision": (lambda: make_zip([("ajet/A.py", b"1"), ("ajet/a.py", b"2")]), 400,
                       "case-insensitive"),
    "file_and_folder": (lambda: make_zip([("ajet/a", b"1"), ("ajet/a/b.py", b"2")]), 400,
                        "file and also a folder"),
    "bomb": (bomb_zip, 413, "compression ratio"),
    "many_small_bombs": (many_small_bombs_zip, 413, "compression ratio"),
    "too_many_files": (too_many_files_zip, 413, "limit is 20"),
    "declares_many_entries": (declares_many_entries_zip, 413, "declares 60000 entries"),
    "file_too_big": (too_big_file_zip, 413, "file limit"),
    "total_too_big": (too_big_total_zip, 413, "unpacks to"),
    "truncated": (truncated_zip, 400, "zip"),
    "corrupt_data": (corrupt_data_zip, 400, "corrupt or truncated"),
    "lying_size": (lying_size_zip, 400, "corrupt or truncated"),
    "encrypted": (encrypted_zip, 400, "encrypted"),
    "bzip2": (lambda: make_zip([("ajet/a.py", b"x")], method=zipfile.ZIP_BZIP2), 400,
              "compression method"),
    "overlapping": (overlapping_zip, 400, "overlap"),
    "not_a_zip": (not_a_zip, 400, "not a zip"),
    "empty_zip": (lambda: make_zip([]), 400, "no files"),
    "only_folders": (lambda: make_zip([("ajet/", b""), ("ajet/sub/", b"")],
                                      mode=stat.S_IFDIR | 0o755), 400, "no files"),
}
