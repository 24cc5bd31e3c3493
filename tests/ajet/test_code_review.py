"""`ajet.code_review`: the change set and the escaped, paged diff every reviewer sees."""

from __future__ import annotations

import hashlib

from ajet.code_review import (
    MAX_ALIGNED_LINES,
    MAX_LINE_CHARS,
    ChangeKind,
    build_review,
    compare_manifests,
    escape_text,
    summarize_changes,
)
from ajet.protocol import FileEntry


def _entry(path: str, data: bytes, mode: int = 0o644) -> FileEntry:
    return FileEntry(path=path, sha256=hashlib.sha256(data).hexdigest(), size=len(data), mode=mode)


def _review(new: dict[str, bytes], old: dict[str, bytes], modes: dict[str, int] | None = None):
    modes = modes or {}
    blobs = {hashlib.sha256(b).hexdigest(): b for b in [*new.values(), *old.values()]}
    read = lambda e: blobs[e.sha256]  # noqa: E731
    changes = compare_manifests([_entry(p, d, modes.get(p, 0o644)) for p, d in new.items()],
                                [_entry(p, d) for p, d in old.items()])
    return changes, build_review(changes, read_new=read, read_old=read)


def test_added_changed_removed_renamed_and_mode() -> None:
    changes, review = _review(
        {"ajet/a.py": b"x = 2\n", "ajet/keep.py": b"k = 1\n", "ajet/new.py": b"n = 1\n",
         "ajet/moved.py": b"same = 1\n", "ajet/run.sh": b"#!/bin/sh\n"},
        {"ajet/a.py": b"x = 1\n", "ajet/keep.py": b"k = 1\n", "ajet/gone.py": b"g = 1\n",
         "ajet/old_name.py": b"same = 1\n", "ajet/run.sh": b"#!/bin/sh\n"},
        modes={"ajet/run.sh": 0o755})
    assert summarize_changes(changes) == {
        "added": ["ajet/new.py"], "changed": ["ajet/a.py", "ajet/run.sh"],
        "removed": ["ajet/gone.py"], "renamed": ["ajet/moved.py"]}
    moved = next(c for c in changes if c.kind is ChangeKind.RENAMED)
    assert moved.old_path == "ajet/old_name.py"
    text = review.text()
    assert "-x = 1\n+x = 2\n" in text and "+n = 1" in text and "-g = 1" in text
    assert "ajet/moved.py (renamed from ajet/old_name.py)" in text and "keep.py" not in text
    flags = {f.path: f.flags for f in review.files}
    assert "mode 644 -> 755" in flags["ajet/run.sh"]


def test_control_characters_are_visible_and_cannot_hide_a_line() -> None:
    hidden = "import os; os.system('x')\x1b[2K\x1b[1G# fine"
    tricky = (f"{hidden}\nA = 1\rB = 2\nC = '\u202e' # bidi\nD = 1\x0cE = 2\u2028F = 3\n"
              "G\u200b = 1\n")
    _, review = _review({"ajet/x.py": tricky.encode()}, {})
    text = review.text()
    assert "\x1b" not in text and "\u202e" not in text and "\u2028" not in text
    assert "+import os; os.system('x')\\x1b[2K\\x1b[1G# fine" in text
    assert "+A = 1\\x0dB = 2" in text  # a lone CR is a line break to Python: made visible
    assert "\\u202e" in text and "\\u200b" in text
    # \x0c and U+2028 do not split the line (str.splitlines would), they are escaped in it
    assert "+D = 1\\x0cE = 2\\u2028F = 3" in text
    assert any("control characters" in f and "line 1" in f for f in review.files[0].flags)
    assert escape_text("tab\tand space stay") == "tab\tand space stay"


def test_binary_non_utf8_and_crlf_are_flagged() -> None:
    _, review = _review({"ajet/w.bin": b"\x00\xff\xfe", "ajet/l.py": b"# coding: latin-1\nX='\xe9'\n",
                         "ajet/bad.py": b"X = '\xff'\n", "ajet/crlf.py": b"a = 1\r\nb = 2\r\n",
                         "ajet/bom.py": b"\xef\xbb\xbfz = 1\n"}, {})
    flags = {f.path: f.flags for f in review.files}
    shown = {f.path: f.shown for f in review.files}
    assert shown["ajet/w.bin"] == "binary" and "binary" in flags["ajet/w.bin"][0]
    assert "not UTF-8: shown decoded as iso-8859-1" in " ".join(flags["ajet/l.py"])
    assert "+X='é'" in review.text()
    assert shown["ajet/bad.py"] == "binary"  # undecodable source: flagged, never guessed
    assert "CRLF line endings" in flags["ajet/crlf.py"] and "+a = 1\n+b = 2\n" in review.text()
    assert "byte-order mark" in " ".join(flags["ajet/bom.py"])


def test_long_files_and_lines_are_paged_whole_never_cut() -> None:
    long_old = "".join(f"v = {i}\n" for i in range(MAX_ALIGNED_LINES + 5)).encode()
    long_new = long_old + b"tail = 1\n"
    one_line = ("y" * (3 * MAX_LINE_CHARS + 7) + "\n").encode()
    _, review = _review({"ajet/big.py": long_new, "ajet/wide.py": one_line},
                        {"ajet/big.py": long_old})
    big = next(f for f in review.files if f.path == "ajet/big.py")
    assert big.shown == "whole" and any("shown whole" in f for f in big.flags)
    wide = [ln for ln in review.lines if ln.file == 1 and ln.kind == "add"]
    assert len(wide) == 4 and all(len(ln.text) <= MAX_LINE_CHARS for ln in wide)
    assert "".join(ln.text for ln in wide) == "y" * (3 * MAX_LINE_CHARS + 7)
    pages, offset = [], 0
    while offset is not None:
        lines, offset = review.page(offset, 1000)
        pages.extend(lines)
    assert pages == list(review.lines)  # every line, in order, on some page
    assert "+tail = 1" in review.text()
