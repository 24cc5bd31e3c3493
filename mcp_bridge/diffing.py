"""What a sync would change on the cluster: files added, changed, removed, and their diff.

The local side is the manifest of the git-tracked files under `ajet/` (built by
`ajet.packaging`); the cluster side is the manifest of the snapshot the engine runs
(`GET /code`), whose old file contents come from `GET /code/blobs/{sha256}`. Pure
functions here; `mcp_bridge.sync` feeds them real manifests and blobs.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ajet.protocol import FileEntry

__all__ = [
    "ChangeKind",
    "FileChange",
    "compare_manifests",
    "render_diff",
    "summarize_changes",
]

#: Files larger than this are listed but not diffed line by line.
MAX_DIFF_FILE_BYTES = 512 * 1024


class ChangeKind(str, enum.Enum):
    ADDED = "added"
    CHANGED = "changed"
    REMOVED = "removed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FileChange:
    """One file that differs between the local tree and the running snapshot."""

    path: str
    kind: ChangeKind
    new: FileEntry | None  # None when removed
    old: FileEntry | None  # None when added


def compare_manifests(local: Sequence[FileEntry],
                      running: Sequence[FileEntry] | None) -> list[FileChange]:
    """Files added, changed (content or mode) and removed, sorted by path.

    `running=None` means the cluster's file list is unknown (it runs the server's own
    installed code): every local file then counts as added.
    """
    old = {f.path: f for f in running or ()}
    new = {f.path: f for f in local}
    changes: list[FileChange] = []
    for path in sorted(old.keys() | new.keys()):
        a, b = old.get(path), new.get(path)
        if a is None and b is not None:
            changes.append(FileChange(path, ChangeKind.ADDED, b, None))
        elif b is None and a is not None:
            changes.append(FileChange(path, ChangeKind.REMOVED, None, a))
        elif a is not None and b is not None and (a.sha256 != b.sha256 or a.mode != b.mode):
            changes.append(FileChange(path, ChangeKind.CHANGED, b, a))
    return changes


def summarize_changes(changes: Sequence[FileChange]) -> dict[str, list[str]]:
    """`{"added": [...], "changed": [...], "removed": [...]}` of paths."""
    out: dict[str, list[str]] = {k.value: [] for k in ChangeKind}
    for change in changes:
        out[change.kind.value].append(change.path)
    return out


def render_diff(changes: Sequence[FileChange], *, read_new: Callable[[FileEntry], bytes],
                read_old: Callable[[FileEntry], bytes], context_lines: int = 3,
                max_chars: int | None = None) -> str:
    """A unified diff (`a/` = running snapshot, `b/` = local tree) of every change.

    Binary or very large files get a one-line note instead of lines. With `max_chars`,
    the text stops at a file boundary once the cap is passed (at least one file is
    always shown, cut at the cap) and ends with a line naming the files left out.
    """
    parts: list[str] = []
    used = 0
    for index, change in enumerate(changes):
        text = _file_diff(change, read_new=read_new, read_old=read_old,
                          context_lines=context_lines)
        if max_chars is not None and used + len(text) > max_chars:
            shown = index
            if not parts:  # always show something: the first file, cut at the cap
                parts.append(text[:max_chars].rstrip("\n") + "\n... (cut)\n")
                shown = 1
            if len(changes) > shown:
                parts.append(f"... {len(changes) - shown} more changed file(s) not diffed here\n")
            break
        parts.append(text)
        used += len(text)
    return "".join(parts)


def _file_diff(change: FileChange, *, read_new: Callable[[FileEntry], bytes],
               read_old: Callable[[FileEntry], bytes], context_lines: int) -> str:
    a_name = f"a/{change.path}" if change.old else "/dev/null"
    b_name = f"b/{change.path}" if change.new else "/dev/null"
    header = f"diff --ajet {a_name} {b_name} ({change.kind})\n"
    if change.kind is ChangeKind.CHANGED and change.old and change.new \
            and change.old.sha256 == change.new.sha256:
        return header + f"mode {oct(change.old.mode)} -> {oct(change.new.mode)}\n"
    sizes = [e.size for e in (change.old, change.new) if e is not None]
    if max(sizes, default=0) > MAX_DIFF_FILE_BYTES:
        return header + f"(file over {MAX_DIFF_FILE_BYTES // 1024} KiB: not diffed)\n"
    old_text = _decode(read_old(change.old)) if change.old else ""
    new_text = _decode(read_new(change.new)) if change.new else ""
    if old_text is None or new_text is None:
        return header + "(binary file: not diffed)\n"
    lines = difflib.unified_diff(
        old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
        fromfile=a_name, tofile=b_name, n=context_lines,
    )
    body = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in lines)
    return header + body


def _decode(data: bytes) -> str | None:
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
