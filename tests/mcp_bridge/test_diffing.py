"""Change sets and unified diffs between the local manifest and the running snapshot."""

from __future__ import annotations

import hashlib

from ajet.protocol import FileEntry
from mcp_bridge.diffing import ChangeKind, compare_manifests, render_diff, summarize_changes


def _entry(path: str, data: bytes, mode: int = 0o644) -> FileEntry:
    return FileEntry(path=path, sha256=hashlib.sha256(data).hexdigest(), size=len(data), mode=mode)


def _reader(*blobs: bytes):
    by_sha = {hashlib.sha256(b).hexdigest(): b for b in blobs}
    return lambda entry: by_sha[entry.sha256]


OLD_A = b"def reward(x):\n    return x\n"
NEW_A = b"def reward(x):\n    return 2 * x\n"
KEEP = b"KEEP = 1\n"
GONE = b"old = True\n"
ADDED = b"new = True\n"


def _manifests():
    running = [_entry("ajet/a.py", OLD_A), _entry("ajet/keep.py", KEEP),
               _entry("ajet/gone.py", GONE)]
    local = [_entry("ajet/a.py", NEW_A), _entry("ajet/keep.py", KEEP), _entry("ajet/new.py", ADDED)]
    return local, running


def test_added_changed_removed_sorted_by_path() -> None:
    local, running = _manifests()
    changes = compare_manifests(local, running)
    assert [(c.path, c.kind) for c in changes] == [
        ("ajet/a.py", ChangeKind.CHANGED), ("ajet/gone.py", ChangeKind.REMOVED),
        ("ajet/new.py", ChangeKind.ADDED)]
    assert summarize_changes(changes) == {"added": ["ajet/new.py"], "changed": ["ajet/a.py"],
                                          "removed": ["ajet/gone.py"]}


def test_unknown_running_code_makes_everything_added() -> None:
    local, _ = _manifests()
    assert {c.kind for c in compare_manifests(local, None)} == {ChangeKind.ADDED}


def test_unified_diff_shows_the_edit_and_both_ends() -> None:
    local, running = _manifests()
    text = render_diff(compare_manifests(local, running),
                       read_new=_reader(NEW_A, ADDED), read_old=_reader(OLD_A, GONE))
    assert "--- a/ajet/a.py\n+++ b/ajet/a.py\n" in text
    assert "-    return x\n+    return 2 * x\n" in text
    assert "+++ b/ajet/new.py" in text and "+new = True" in text
    assert "--- a/ajet/gone.py" in text and "-old = True" in text
    assert "keep.py" not in text


def test_mode_only_binary_and_missing_newline() -> None:
    script = b"#!/bin/sh\n"
    binary = b"\x00\x01\x02"
    running = [_entry("ajet/run.sh", script), _entry("ajet/w.bin", b"\x00old")]
    local = [_entry("ajet/run.sh", script, 0o755), _entry("ajet/w.bin", binary),
             _entry("ajet/tail.py", b"x = 1")]
    text = render_diff(compare_manifests(local, running),
                       read_new=_reader(script, binary, b"x = 1"),
                       read_old=_reader(script, b"\x00old"))
    assert "mode 0o644 -> 0o755" in text
    assert "(binary file: not diffed)" in text
    assert "\\ No newline at end of file" in text


def test_cap_stops_at_a_file_boundary_and_says_how_many_are_left() -> None:
    files = [(f"ajet/m{i}.py", f"value = {i}\n".encode() * 20) for i in range(5)]
    local = [_entry(p, d) for p, d in files]
    reader = _reader(*(d for _, d in files))
    full = render_diff(compare_manifests(local, None), read_new=reader, read_old=reader)
    capped = render_diff(compare_manifests(local, None), read_new=reader, read_old=reader,
                         max_chars=len(full) // 2)
    assert len(capped) < len(full)
    assert capped.rstrip().endswith("more changed file(s) not diffed here")
    tiny = render_diff(compare_manifests(local, None), read_new=reader, read_old=reader,
                       max_chars=50)
    assert "(cut)" in tiny and "4 more changed file(s)" in tiny
