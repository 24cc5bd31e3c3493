"""What a human reviews before code runs: the change set between two manifests and its diff.

One function builds the review for everyone who shows it: the swarm server's approval
routes, `ajet-swarm approvals show`, the web console, and the MCP bridge (its
elicitation text and laptop-side approvals). Each side only supplies the two manifests
and a way to read a file's bytes by its entry; on the server both sides come from its own
stored files.

What the review guarantees, whatever the files hold:

- **Every file that will run is covered**: added, changed (content or mode), removed, and
  renamed (a removed and an added file with the same content hash).
- **Nothing is cut.** Every line of every text file is in `Review.lines`; callers page
  through them (`Review.page`). A file too long to align line by line is shown whole, as
  removed and added lines, and flagged.
- **What you see is what runs.** Text is split on `\\n` only (CRLF counts as one break);
  every other control character, escape sequence, bidirectional override, zero-width or
  unusual space is shown as a visible escape (`\\x1b`, `\\u202e`) by `escape_text`, so a
  line such as `ESC[2K ESC[1G` can never hide the code before it. `DiffLine.text` keeps the
  raw text for renderers that mark escapes themselves (the console); `escaped()` is the
  safe form for terminals and JSON.
- **Python source is decoded the way the interpreter decodes it** (PEP 263 coding cookie,
  `tokenize.detect_encoding`); a file that is not UTF-8 is shown decoded and flagged with its
  encoding. A file that cannot be shown as text is listed and flagged as binary.
- **Identifiers as Python runs them.** A non-ASCII identifier is flagged with the NFKC form
  Python looks up (`𝐨𝐬` runs as `os`), and its line is followed by a note showing the line
  as it runs; strings holding characters confusable with Latin ones (Unicode TR39) are
  flagged (`ajet.review_unicode`).

Pure functions: no I/O but the two readers; one small third-party import (the Unicode
confusables data, `confusable_homoglyphs`), a core dependency, as the laptop side uses it.
"""

from __future__ import annotations

import difflib
import enum
import io
import tokenize
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ajet.protocol import FileEntry
from ajet.review_unicode import python_unicode

__all__ = [
    "ChangeKind",
    "DiffLine",
    "FileChange",
    "FileReview",
    "Review",
    "build_review",
    "compare_manifests",
    "escape_char",
    "escape_text",
    "has_control",
    "is_unsafe",
    "summarize_changes",
]

#: Above this many lines on either side a file is shown whole instead of aligned (difflib's
#: matching is quadratic in the worst case; the server computes reviews on request).
MAX_ALIGNED_LINES = 20_000
#: Display lines longer than this are split into continuation lines (so a page stays small).
MAX_LINE_CHARS = 1000
_CONTEXT = 3

Reader = Callable[[FileEntry], bytes]


class ChangeKind(str, enum.Enum):
    ADDED = "added"
    CHANGED = "changed"
    REMOVED = "removed"
    RENAMED = "renamed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FileChange:
    """One file that differs between the new manifest and the old (running) one."""

    path: str
    kind: ChangeKind
    new: FileEntry | None  # None when removed
    old: FileEntry | None  # None when added
    old_path: str | None = None  # set when renamed

    @property
    def mode_changed(self) -> bool:
        return self.new is not None and self.old is not None and self.new.mode != self.old.mode


def compare_manifests(new: Sequence[FileEntry], old: Sequence[FileEntry]) -> list[FileChange]:
    """Files added, changed (content or mode), removed and renamed, sorted by path.

    A rename is a removed and an added path with the same content hash (paired one to
    one); a file renamed *and* edited shows as removed plus added, every line still shown.
    """
    before = {f.path: f for f in old}
    after = {f.path: f for f in new}
    added = [after[p] for p in sorted(after.keys() - before.keys())]
    removed = {p: before[p] for p in sorted(before.keys() - after.keys())}
    gone_by_sha: dict[str, list[str]] = {}
    for path, entry in removed.items():
        gone_by_sha.setdefault(entry.sha256, []).append(path)
    changes: list[FileChange] = []
    for entry in added:
        sources = gone_by_sha.get(entry.sha256)
        if sources:
            source = sources.pop(0)
            changes.append(FileChange(entry.path, ChangeKind.RENAMED, entry, removed.pop(source),
                                      old_path=source))
        else:
            changes.append(FileChange(entry.path, ChangeKind.ADDED, entry, None))
    changes += [FileChange(p, ChangeKind.REMOVED, None, e) for p, e in removed.items()]
    for path in sorted(before.keys() & after.keys()):
        a, b = before[path], after[path]
        if a.sha256 != b.sha256 or a.mode != b.mode:
            changes.append(FileChange(path, ChangeKind.CHANGED, b, a))
    return sorted(changes, key=lambda c: c.path.encode("utf-8"))


def summarize_changes(changes: Sequence[FileChange]) -> dict[str, list[str]]:
    """`{"added": [...], "changed": [...], "removed": [...], "renamed": [...]}` of paths."""
    out: dict[str, list[str]] = {k.value: [] for k in ChangeKind}
    for change in changes:
        out[change.kind.value].append(change.path)
    return out


# ---------------------------------------------------------------------------- escaping


def is_unsafe(ch: str) -> bool:
    """True for a character `escape_text` shows as an escape."""
    if ch == "\t" or ch == " ":
        return False
    code = ord(ch)
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return True
    if code < 0x7F:
        return False
    # Format characters (bidi overrides, zero-width joiners, BOM, soft hyphen), line and
    # paragraph separators, unusual spaces, private use and unassigned code points.
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Zs", "Co", "Cn", "Cs")


def has_control(text: str) -> bool:
    """True if `escape_text` would change `text`."""
    return any(is_unsafe(ch) for ch in text)


def escape_text(text: str) -> str:
    """`text` with every control, format or invisible character as a visible escape."""
    if not has_control(text):
        return text
    return "".join(escape_char(ch) if is_unsafe(ch) else ch for ch in text)


def escape_char(ch: str) -> str:
    """The visible escape of one character: `\\x1b`, `\\u202e`, `\\U000e0001`."""
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


# ---------------------------------------------------------------------------- review


@dataclass(frozen=True)
class DiffLine:
    """One display line. `kind`: file (a file's title), meta (---/+++), hunk (@@), add,
    del, ctx, note. `text` is raw (may hold control characters): render it escaped."""

    kind: str
    text: str
    file: int  # index into Review.files
    continued: bool = False  # a continuation of a line longer than MAX_LINE_CHARS

    @property
    def prefix(self) -> str:
        return {"add": "+", "del": "-", "ctx": " "}.get(self.kind, "")

    def escaped(self) -> str:
        """The line as safe text, with its diff prefix (`+`, `-`, ` `)."""
        body = escape_text(self.text)
        return f"{self.prefix}{'... ' if self.continued else ''}{body}"


@dataclass(frozen=True)
class FileReview:
    """One changed file as the reviewer sees it; `flags` are what deserves a second look."""

    path: str
    kind: ChangeKind
    old_path: str | None
    old_mode: int | None
    new_mode: int | None
    new_sha256: str | None
    old_sha256: str | None
    size: int
    shown: str  # "text", "whole" (too long to align), "binary"
    flags: tuple[str, ...]
    first_line: int  # index of its title in Review.lines
    added: int = 0
    removed: int = 0


@dataclass(frozen=True)
class Review:
    """Every changed file and every display line of the diff, in path order."""

    files: tuple[FileReview, ...]
    lines: tuple[DiffLine, ...]
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def flagged(self) -> tuple[FileReview, ...]:
        return tuple(f for f in self.files if f.flags)

    def page(self, offset: int = 0, limit: int = 500) -> tuple[tuple[DiffLine, ...], int | None]:
        """Lines `offset`..`offset+limit` and the next offset (None at the end)."""
        offset = max(0, offset)
        end = offset + max(1, limit)
        return self.lines[offset:end], (end if end < len(self.lines) else None)

    def text(self, offset: int = 0, limit: int | None = None) -> str:
        """Escaped diff text of lines `offset`.. (all of them without `limit`)."""
        lines = self.lines[offset:] if limit is None else self.lines[offset:offset + limit]
        return "".join(line.escaped() + "\n" for line in lines)

    def summary(self) -> str:
        c = self.counts
        text = (f"{c.get('added', 0)} added, {c.get('changed', 0)} changed, "
                f"{c.get('removed', 0)} removed, {c.get('renamed', 0)} renamed")
        if self.flagged:
            text += f"; {len(self.flagged)} flagged file(s)"
        return text


def build_review(changes: Sequence[FileChange], *, read_new: Reader, read_old: Reader,
                 context_lines: int = _CONTEXT) -> Review:
    """The review of `changes`: `read_new`/`read_old` return a file's bytes by its entry."""
    files: list[FileReview] = []
    lines: list[DiffLine] = []
    for index, change in enumerate(changes):
        review, body = _file_review(index, change, len(lines), read_new=read_new,
                                    read_old=read_old, context_lines=context_lines)
        files.append(review)
        lines.extend(body)
    counts = {k.value: 0 for k in ChangeKind}
    for change in changes:
        counts[change.kind.value] += 1
    return Review(files=tuple(files), lines=tuple(lines), counts=counts)


def _file_review(index: int, change: FileChange, first_line: int, *, read_new: Reader,
                 read_old: Reader, context_lines: int) -> tuple[FileReview, list[DiffLine]]:
    flags: list[str] = []
    new_text = old_text = None
    new_bytes = read_new(change.new) if change.new is not None else None
    old_bytes = read_old(change.old) if change.old is not None else None
    binary = False
    for side, data, entry in (("new", new_bytes, change.new), ("old", old_bytes, change.old)):
        if data is None or entry is None:
            continue
        text, notes = decode_for_review(entry.path, data)
        if side == "new":
            new_text = text
            flags += notes
        else:
            old_text = text
            flags += [f"old version: {n}" for n in notes if not n.startswith("control")]
        if text is None:
            binary = True
    if change.mode_changed and change.old is not None and change.new is not None:
        flags.append(f"mode {change.old.mode:o} -> {change.new.mode:o}")
    elif change.kind is ChangeKind.ADDED and change.new is not None and change.new.mode == 0o755:
        flags.append("executable (mode 755)")
    if change.kind is ChangeKind.RENAMED:
        flags.append(f"renamed from {escape_text(change.old_path or '')}")
    if change.new is not None and _is_extension_module(change.new.path):
        flags.append("extension module: compiled code that cannot be reviewed here")

    title = f"{escape_text(change.path)} ({change.kind.value}"
    if change.kind is ChangeKind.RENAMED:
        title += f" from {escape_text(change.old_path or '')}"
    if change.mode_changed and change.old is not None and change.new is not None:
        title += f", mode {change.old.mode:o} -> {change.new.mode:o}"
    title += ")"
    body = [DiffLine("file", title, index)]
    shown = "text"
    added = removed = 0
    if binary:
        shown = "binary"
        size = len(new_bytes if new_bytes is not None else old_bytes or b"")
        sha = (change.new or change.old).sha256  # type: ignore[union-attr]
        flags.insert(0, "binary: cannot be shown as text")
        body.append(DiffLine("note", f"binary file, {size} bytes, sha256 {sha}: its content "
                                     "cannot be shown as text", index))
    elif change.kind is ChangeKind.RENAMED and new_bytes == old_bytes:
        body.append(DiffLine("note", "content unchanged", index))
    else:
        old_lines = _lines(old_text) if old_text is not None else []
        new_lines = _lines(new_text) if new_text is not None else []
        as_run: dict[int, str] = {}
        if new_text is not None and change.new is not None and change.new.path.endswith(".py"):
            # Python runs identifiers in NFKC form: flag them, and show each such line
            # as it runs, next to the text (so a search of the diff finds `os.system`)
            findings = python_unicode(new_text)
            flags += findings.flags()
            as_run = findings.as_run
        a_name = f"a/{escape_text((change.old_path or change.path))}" if change.old else "/dev/null"
        b_name = f"b/{escape_text(change.path)}" if change.new else "/dev/null"
        body += [DiffLine("meta", f"--- {a_name}", index), DiffLine("meta", f"+++ {b_name}", index)]
        if max(len(old_lines), len(new_lines)) > MAX_ALIGNED_LINES and old_lines and new_lines:
            shown = "whole"
            flags.append(f"long: shown whole ({len(old_lines)} -> {len(new_lines)} lines), "
                         "not aligned line by line")
            body.append(DiffLine("hunk", f"@@ -1,{len(old_lines)} +1,{len(new_lines)} @@", index))
            body += _split("del", old_lines, index)
            for n, line in enumerate(new_lines, start=1):
                body += _split("add", [line], index) + _as_run(as_run, n, index)
            added, removed = len(new_lines), len(old_lines)
        else:
            new_no = 0  # the new side's line number, for what Python reads there
            for raw in difflib.unified_diff(old_lines, new_lines, n=context_lines, lineterm=""):
                if raw.startswith(("---", "+++")):
                    continue
                if raw.startswith("@@"):
                    body.append(DiffLine("hunk", raw, index))
                    new_no = int(raw.split("+", 1)[1].split(",")[0].split(" ")[0]) - 1
                elif raw.startswith("+"):
                    body += _split("add", [raw[1:]], index)
                    added += 1
                    new_no += 1
                    body += _as_run(as_run, new_no, index)
                elif raw.startswith("-"):
                    body += _split("del", [raw[1:]], index)
                    removed += 1
                else:
                    body += _split("ctx", [raw[1:]], index)
                    new_no += 1
                    body += _as_run(as_run, new_no, index)
            if change.new is not None and new_text and not new_text.endswith("\n"):
                body.append(DiffLine("note", "\\ No newline at end of file", index))
        if new_text is not None and any(has_control(ln) for ln in new_lines):
            rows = [str(i + 1) for i, ln in enumerate(new_lines) if has_control(ln)]
            shown_rows = ", ".join(rows[:20]) + (" ..." if len(rows) > 20 else "")
            flags.append(f"control characters shown as escapes (line {shown_rows})")
    size = change.new.size if change.new is not None else 0
    review = FileReview(
        path=change.path, kind=change.kind, old_path=change.old_path,
        old_mode=change.old.mode if change.old else None,
        new_mode=change.new.mode if change.new else None,
        new_sha256=change.new.sha256 if change.new else None,
        old_sha256=change.old.sha256 if change.old else None,
        size=size, shown=shown, flags=tuple(dict.fromkeys(flags)), first_line=first_line,
        added=added, removed=removed,
    )
    return review, body


def decode_for_review(path: str, data: bytes) -> tuple[str | None, list[str]]:
    """The text of a file as the reviewer sees it, or None if it cannot be text; and notes.

    `.py` files are decoded as the interpreter decodes them (coding cookie, BOM); other
    files as UTF-8. Not UTF-8, a BOM, or CRLF line ends are noted.
    """
    notes: list[str] = []
    if path.endswith(".py"):
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
            text = data.decode(encoding)
        except (SyntaxError, LookupError, UnicodeDecodeError):
            return None, ["Python source that cannot be decoded (the interpreter refuses it)"]
        if encoding == "utf-8-sig":
            text = text.removeprefix("\ufeff")
            notes.append("starts with a UTF-8 byte-order mark")
        elif encoding != "utf-8":
            notes.append(f"not UTF-8: shown decoded as {encoding} (its coding cookie)")
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None, []
    if "\r\n" in text:
        notes.append("CRLF line endings")
    return text, notes


def _as_run(as_run: dict[int, str], line_no: int, index: int) -> list[DiffLine]:
    """The note under a line whose identifiers Python reads in another (NFKC) form."""
    if line_no not in as_run:
        return []
    return [DiffLine("note", f"Python runs line {line_no} as: {as_run[line_no]}", index)]


def _lines(text: str) -> list[str]:
    # Split on "\n" (and CRLF) only: str.splitlines() would also break at \x0b, \x0c,
    # \x1c-\x1e, \x85, U+2028/9, and so hide what sits on the "same" line from escaping.
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def _split(kind: str, lines: Sequence[str], index: int) -> list[DiffLine]:
    out: list[DiffLine] = []
    for line in lines:
        if len(line) <= MAX_LINE_CHARS:
            out.append(DiffLine(kind, line, index))
            continue
        for start in range(0, len(line), MAX_LINE_CHARS):
            out.append(DiffLine(kind, line[start:start + MAX_LINE_CHARS], index,
                                continued=start > 0))
    return out


def _is_extension_module(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith((".so", ".pyd", ".dylib", ".dll"))
