"""swarm_server.safe_zip against a corpus of hostile archives, and a few honest ones.

The same corpus goes through the real HTTP server in test_code_sync.py; here each case
checks the exact refusal (status and reason) without a server in the way.
"""

from __future__ import annotations

import hashlib
import io
import stat
import zipfile
from pathlib import Path

import pytest

from ajet.errors import SwarmHTTPError
from swarm_server.safe_zip import SafeZip, ZipLimits
from tests.support.hostile_zips import HOSTILE, bomb_zip

LIMITS = ZipLimits(max_files=20, max_file_bytes=1 << 20, max_unpacked_bytes=4 << 20,
                   max_compression_ratio=100.0)




def judge_and_extract(data: bytes, tmp: Path, limits: ZipLimits = LIMITS) -> list:
    path = tmp / "upload.zip"
    path.write_bytes(data)
    with SafeZip.open(path, limits) as archive:
        return archive.extract(tmp / "staging")


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_zip_is_refused(case: str, tmp_path: Path) -> None:
    build, status, reason = HOSTILE[case]
    with pytest.raises(SwarmHTTPError) as info:
        judge_and_extract(build(), tmp_path)
    assert info.value.status == status, info.value.detail
    assert reason in str(info.value.detail)
    assert info.value.hint


def test_refusal_before_inflating_anything(tmp_path: Path) -> None:
    # a bomb is refused from the central directory: nothing is written to staging
    with pytest.raises(SwarmHTTPError):
        judge_and_extract(bomb_zip(), tmp_path)
    assert not (tmp_path / "staging").exists()


def test_honest_zip_extracts_with_hashes_and_modes(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("ajet/", b"")  # folder entries are allowed and ignored
        zf.writestr("ajet/sub/", b"")
        zf.writestr("ajet/__init__.py", b"")
        zf.writestr("ajet/sub/mod.py", b"def f():\n    return 1\n" * 100)
        info = zipfile.ZipInfo("ajet/run.sh")
        info.create_system = 3
        info.external_attr = (stat.S_IFREG | 0o755) << 16
        zf.writestr(info, b"#!/bin/sh\n")
        zf.writestr("ajet/copy.py", b"def f():\n    return 1\n" * 100)
    members = judge_and_extract(buf.getvalue(), tmp_path)
    by_path = {m.path: m for m in members}
    assert sorted(by_path) == ["ajet/__init__.py", "ajet/copy.py", "ajet/run.sh",
                               "ajet/sub/mod.py"]
    assert by_path["ajet/run.sh"].mode == 0o755 and by_path["ajet/sub/mod.py"].mode == 0o644
    for m in members:
        data = m.staged.read_bytes()
        assert hashlib.sha256(data).hexdigest() == m.sha256 and len(data) == m.size
    assert by_path["ajet/copy.py"].sha256 == by_path["ajet/sub/mod.py"].sha256
    # staged files are named by index, never by anything the archive chose
    assert {m.staged.parent for m in members} == {tmp_path / "staging"}


def test_windows_made_zip_without_unix_modes(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("ajet/a.py")
        info.create_system = 0
        info.external_attr = 0x20  # MS-DOS archive bit only
        zf.writestr(info, b"x = 1\n")
    (member,) = judge_and_extract(buf.getvalue(), tmp_path)
    assert member.mode == 0o644
