"""Package the git-tracked `ajet/` tree of a checkout: manifest, snapshot id, provenance, zip.

What is shipped is exactly `git ls-files -- ajet` run in the directory that holds `ajet/`,
with each file's *working-tree* content: modified tracked files are included, tracked
files deleted from the working tree are skipped, and untracked, ignored, `.git` and
outside-`ajet/` files never are. The untracked files under `ajet/` that were left out
are listed, so a user sees at once why a new module is missing ("git add it first").

Everything that cannot be shipped faithfully is a `PackagingError` before any upload:
not a git checkout, no `ajet/` folder, nothing tracked under it, a tracked symlink or
submodule, a file over the size cap, a name the server would refuse.

Canonical manifest (both sides compute it; the server recomputes and compares)::

    b"ajet-manifest-v1\\n" + b"".join(
        f"{mode:o} {sha256} {size} {path}\\n".encode("utf-8")
        for each file, sorted by the UTF-8 bytes of `path`)

`mode` is octal without prefix (`644` or `755`), `sha256` the lowercase hex digest of the
file's bytes, `size` its length in decimal, `path` the POSIX path starting with `ajet/`.
`snapshot_id = sha256(canonical manifest)` in lowercase hex. Path rules
(`member_path_problem`) exclude newlines, so the form is unambiguous.

Laptop side: runs on macOS and Linux; GitPython is imported only when a tree is packaged,
never torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import time
import unicodedata
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet.errors import PackagingError
from ajet.protocol import FileEntry, Provenance

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_FILES",
    "DEFAULT_MAX_TOTAL_BYTES",
    "DIFF_CAP_CHARS",
    "MANIFEST_HEADER",
    "Package",
    "PackagedFile",
    "UNTRACKED_LIST_CAP",
    "build_zip",
    "canonical_manifest",
    "file_kind_problem",
    "folder_snapshot_id",
    "is_extension_module",
    "member_path_problem",
    "package_tree",
    "snapshot_id_of",
    "tree_problems",
]

log = logging.getLogger(__name__)

#: First line of the canonical manifest; bump it if the form ever changes.
MANIFEST_HEADER = b"ajet-manifest-v1\n"
# Client-side caps mirror the server's defaults (swarm_server.settings), so an oversized
# tree fails here, before any byte is uploaded.
DEFAULT_MAX_FILE_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_FILES = 5000
DEFAULT_MAX_TOTAL_BYTES = 512 * 1024 * 1024
#: The diff in the provenance is for humans and the approval screen, not for replay.
DIFF_CAP_CHARS = 64 * 1024
#: Names of left-out untracked files carried in provenance and results.
UNTRACKED_LIST_CAP = 200

_MAX_PATH_CHARS = 1024
_MAX_COMPONENT_BYTES = 255
_CHUNK = 1024 * 1024
# Fixed zip timestamp, so the same tree always gives the same zip bytes.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


# ---------------------------------------------------------------------------- path rules


def member_path_problem(path: str) -> str | None:
    """Why `path` may not be a file of a snapshot, or None if it may.

    A file path is POSIX, relative, starts with `ajet/`, and has no empty, `.` or `..`
    component, no backslash, NUL or other control character, no component over 255 bytes.
    The server applies the same rules to manifests and zip members.
    """
    if not path:
        return "empty path"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "name is not valid UTF-8"
    if len(path) > _MAX_PATH_CHARS:
        return f"path longer than {_MAX_PATH_CHARS} characters"
    if "\\" in path:
        return "backslash in path"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "NUL or control character in path"
    if path.startswith("/"):
        return "absolute path"
    parts = path.split("/")
    if any(p == ".." for p in parts):
        return "'..' in path"
    if any(p in ("", ".") for p in parts):
        return "empty or '.' path component"
    if parts[0] != "ajet" or len(parts) < 2:
        return "not under ajet/"
    if any(len(p.encode("utf-8")) > _MAX_COMPONENT_BYTES for p in parts):
        return f"path component longer than {_MAX_COMPONENT_BYTES} bytes"
    if len(parts) >= 2 and parts[1] == ".git":
        return ".git is never shipped"
    return None


#: Suffixes of compiled extension modules the interpreter imports (no reviewable source).
EXTENSION_SUFFIXES = (".so", ".pyd")


def is_extension_module(path: str) -> bool:
    """True for a compiled extension module (`x.so`, `x.cpython-311-x86_64-linux-gnu.so`,
    `x.pyd`): code that runs on import and that no reviewer can read."""
    return path.rsplit("/", 1)[-1].endswith(EXTENSION_SUFFIXES)


def file_kind_problem(path: str, *, allow_extension_modules: bool = False) -> str | None:
    """Why a file of this kind may not be synced, or None if it may.

    Files the interpreter would run without reviewable source are never synced: bytecode
    (`.pyc`, `.pyo`), anything under `__pycache__/` (a sourceless `__init__.pyc` is
    imported in place of the `.py` beside it), and `.pth` files (executed by `site`).
    Extension modules are refused unless the server allows them
    (`AJET_SWARM_ALLOW_EXTENSION_MODULES`). The server applies the same rule to every
    manifest and zip; packaging applies it first, so nothing is uploaded.
    """
    parts = path.split("/")
    name = parts[-1]
    if "__pycache__" in parts[:-1] or name == "__pycache__":
        return "under __pycache__/: bytecode runs without reviewable source"
    if name.endswith((".pyc", ".pyo")):
        return "Python bytecode runs without reviewable source; sync the .py file"
    if name.endswith(".pth"):
        return ".pth files run code at interpreter start-up"
    if is_extension_module(path) and not allow_extension_modules:
        return ("compiled extension module (no reviewable source); the server refuses it "
                "unless AJET_SWARM_ALLOW_EXTENSION_MODULES=1")
    return None


def _fold(path: str) -> str:
    # Case-insensitive, normalisation-insensitive key (macOS file systems fold both).
    return unicodedata.normalize("NFC", path).casefold()


def tree_problems(paths: Iterable[str]) -> list[str]:
    """Problems of a set of file paths taken together, each naming the paths involved.

    Duplicates, names equal after case folding and Unicode normalisation (they collide on
    macOS and Windows), and a path that is both a file and a folder (`ajet/a` and
    `ajet/a/b.py`).
    """
    problems: list[str] = []
    files: dict[str, str] = {}
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            problems.append(f"{path}: duplicate entry")
            continue
        seen.add(path)
        key = _fold(path)
        other = files.get(key)
        if other is not None:
            problems.append(f"{path}: collides with {other} on a case-insensitive file system")
            continue
        files[key] = path
    dirs: dict[str, str] = {}
    for path in files.values():
        parts = path.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            key = _fold(prefix)
            other = dirs.setdefault(key, prefix)
            if other != prefix:
                problems.append(f"{path}: folder {prefix} collides with {other}")
    for key, path in files.items():
        if key in dirs:
            problems.append(f"{path}: is a file and also a folder of other entries")
    return problems


# ---------------------------------------------------------------------------- manifest


def canonical_manifest(entries: Iterable[FileEntry]) -> bytes:
    """The canonical bytes of a manifest (see the module docstring)."""
    rows = sorted(entries, key=lambda e: e.path.encode("utf-8"))
    body = b"".join(f"{e.mode:o} {e.sha256} {e.size} {e.path}\n".encode("utf-8") for e in rows)
    return MANIFEST_HEADER + body


def snapshot_id_of(entries: Iterable[FileEntry]) -> str:
    """`sha256(canonical_manifest(entries))`, lowercase hex."""
    return hashlib.sha256(canonical_manifest(entries)).hexdigest()


def folder_snapshot_id(package_dir: Path) -> str:
    """The snapshot id of the `ajet/` folder `package_dir` as it lies on disk.

    The manifest of every file under it except bytecode caches (`__pycache__/`, `*.pyc`),
    mode 755 where the owner may execute it, else 644 (the server keeps a snapshot's
    files owner-only): for a synced snapshot's folder this is its snapshot id, whatever
    the folder is called and wherever it lies. The engine reports it for the code it
    imported; an installed copy gives some other id.
    """
    entries = []
    for path in sorted(package_dir.rglob("*")):
        rel = path.relative_to(package_dir)
        if "__pycache__" in rel.parts or path.suffix == ".pyc" or not path.is_file():
            continue
        sha256, size = _hash_file(path, cap=DEFAULT_MAX_TOTAL_BYTES)
        mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
        entries.append(FileEntry(path=f"ajet/{rel.as_posix()}", sha256=sha256, size=size,
                                 mode=mode))
    return snapshot_id_of(entries)


# ---------------------------------------------------------------------------- packaging


@dataclass(frozen=True)
class PackagedFile:
    path: str  # POSIX, starts with "ajet/"
    sha256: str
    size: int
    mode: int  # 0o644 or 0o755
    source: Path  # absolute working-tree path

    def entry(self) -> FileEntry:
        return FileEntry(path=self.path, sha256=self.sha256, size=self.size, mode=self.mode)


@dataclass(frozen=True)
class Package:
    """A packaged tree: what will be shipped, its id, and where it came from."""

    root: Path
    files: tuple[PackagedFile, ...]
    snapshot_id: str
    provenance: Provenance
    untracked_left_out: tuple[str, ...] = ()
    deleted_skipped: tuple[str, ...] = ()
    by_sha: dict[str, Path] = field(default_factory=dict, compare=False, repr=False)

    def entries(self) -> list[FileEntry]:
        return [f.entry() for f in self.files]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def read_blob(self, sha256: str) -> bytes:
        """The bytes of the blob `sha256`, re-read and checked against the hash.

        Raises `PackagingError` if the file changed since it was packaged.
        """
        source = self.by_sha.get(sha256)
        if source is None:
            raise PackagingError(f"blob {sha256} is not part of this package")
        try:
            data = source.read_bytes()
        except OSError as exc:
            raise PackagingError(f"cannot read {source}: {exc}; sync again") from exc
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PackagingError(
                f"{source} changed while syncing (its hash no longer matches the manifest); "
                "sync again once edits are saved"
            )
        return data


def package_tree(
    path: str | os.PathLike[str],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    diff_cap_chars: int = DIFF_CAP_CHARS,
) -> Package:
    """Package the git-tracked files under `<path>/ajet` with their working-tree content.

    `path` is the folder that holds `ajet/`: the repository root, or a folder inside it.
    Raises `PackagingError` (nothing is uploaded) when the tree cannot be shipped as is.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PackagingError(f"{root} is not a directory; pass the folder that holds ajet/")
    root = root.resolve()
    ajet_dir = root / "ajet"
    if ajet_dir.is_symlink() or not ajet_dir.is_dir():
        raise PackagingError(
            f"no ajet/ folder in {root}; pass the folder that holds the ajet package"
        )
    git_mod = _import_git()
    try:
        repo = git_mod.Repo(str(root), search_parent_directories=True)
    except (git_mod.InvalidGitRepositoryError, git_mod.NoSuchPathError) as exc:
        raise PackagingError(
            f"{root} is not inside a git checkout; run `git init && git add ajet` there "
            "(only git-tracked files are synced)"
        ) from exc
    if repo.bare or repo.working_tree_dir is None:
        raise PackagingError(f"{root} is a bare git repository; use a checkout")
    cmd = git_mod.Git(str(root))  # runs git with cwd=root, so paths come out as ajet/...

    tracked = _tracked(cmd, git_mod)
    untracked = _split_z(_git(cmd, git_mod, "ls-files", "-z", "--others", "--exclude-standard",
                              "--", "ajet"))
    if not tracked:
        raise PackagingError(
            f"no git-tracked files under {ajet_dir}; `git add ajet` first "
            f"({len(untracked)} untracked file(s) there)"
        )

    ajet_real = ajet_dir.resolve()
    problems: list[str] = []
    files: list[PackagedFile] = []
    by_sha: dict[str, Path] = {}
    deleted: list[str] = []
    total = 0
    for rel, index_mode in tracked:
        bad = member_path_problem(rel) or file_kind_problem(rel, allow_extension_modules=True)
        if bad:
            problems.append(f"{rel}: {bad}")
            continue
        if is_extension_module(rel):
            log.warning("%s is a compiled extension module: a reviewer cannot read it, and "
                        "the server refuses it unless AJET_SWARM_ALLOW_EXTENSION_MODULES=1", rel)
        if index_mode == "120000":
            problems.append(f"{rel}: tracked symlink (only regular files are synced)")
            continue
        if index_mode == "160000":
            problems.append(f"{rel}: git submodule (only regular files are synced)")
            continue
        source = root / rel
        try:
            st = os.lstat(source)
        except FileNotFoundError:
            deleted.append(rel)  # deleted in the working tree: not shipped
            continue
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"{rel}: is a symlink in the working tree")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{rel}: not a regular file in the working tree")
            continue
        real = source.resolve()
        if not real.is_relative_to(ajet_real):
            problems.append(f"{rel}: resolves outside ajet/ (through a symlinked folder)")
            continue
        if st.st_size > max_file_bytes:
            problems.append(f"{rel}: {st.st_size} bytes, over the {max_file_bytes}-byte file cap")
            continue
        sha, size = _hash_file(source, max_file_bytes)
        if size > max_file_bytes:
            problems.append(f"{rel}: over the {max_file_bytes}-byte file cap")
            continue
        mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
        total += size
        files.append(PackagedFile(rel, sha, size, mode, source))
        by_sha.setdefault(sha, source)
    problems.extend(tree_problems(f.path for f in files))
    if len(files) > max_files:
        problems.append(f"{len(files)} files, over the {max_files}-file cap")
    if total > max_total_bytes:
        problems.append(f"{total} bytes in all, over the {max_total_bytes}-byte cap")
    if problems:
        shown = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise PackagingError(f"cannot package {ajet_dir}: {shown}{more}; nothing was uploaded")
    if not files:
        raise PackagingError(
            f"every git-tracked file under {ajet_dir} is deleted in the working tree; "
            "nothing to sync"
        )

    files.sort(key=lambda f: f.path.encode("utf-8"))
    entries = [f.entry() for f in files]
    provenance = _provenance(repo, cmd, git_mod, untracked, diff_cap_chars)
    if deleted:
        log.info("skipped %d tracked file(s) deleted in the working tree: %s",
                 len(deleted), ", ".join(deleted[:10]))
    return Package(
        root=root,
        files=tuple(files),
        snapshot_id=snapshot_id_of(entries),
        provenance=provenance,
        untracked_left_out=tuple(untracked),
        deleted_skipped=tuple(deleted),
        by_sha=by_sha,
    )


def build_zip(package: Package, dest: str | os.PathLike[str]) -> Path:
    """Write the package as a zip for the one-shot `POST /sync_train_code`.

    Members are the package's files only (no folder entries), in manifest order, with a
    fixed timestamp and their mode, so one tree always gives the same bytes. Each file is
    re-checked against its hash while being written.
    """
    out = Path(dest)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for f in package.files:
                info = zipfile.ZipInfo(f.path, date_time=_ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.create_system = 3  # unix, so external_attr carries the mode
                info.external_attr = (stat.S_IFREG | f.mode) << 16
                zf.writestr(info, package.read_blob(f.sha256))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------- git helpers


def _import_git() -> Any:
    try:
        import git  # GitPython; imported here so `import ajet` stays light
    except ImportError as exc:  # GitPython raises ImportError when no git binary works
        raise PackagingError(
            f"GitPython cannot run git ({exc}); install git and `pip install gitpython`"
        ) from exc
    return git


def _git(cmd: Any, git_mod: Any, *args: str) -> str:
    try:
        exe = git_mod.Git.GIT_PYTHON_GIT_EXECUTABLE or "git"
        return str(cmd.execute([exe, *args], strip_newline_in_stdout=False))
    except git_mod.GitCommandError as exc:
        raise PackagingError(f"`git {' '.join(args)}` failed: {exc.stderr or exc}") from exc


def _split_z(out: str) -> list[str]:
    return [p for p in out.split("\0") if p]


def _tracked(cmd: Any, git_mod: Any) -> list[tuple[str, str]]:
    """(path, index mode) of every tracked file under ajet/, each path once."""
    seen: dict[str, str] = {}
    for record in _split_z(_git(cmd, git_mod, "ls-files", "-z", "-s", "--", "ajet")):
        meta, _, rel = record.partition("\t")
        index_mode = meta.split(" ", 1)[0]
        seen.setdefault(rel, index_mode)  # merge conflicts list a path once per stage
    return list(seen.items())


def _hash_file(path: Path, cap: int) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                size += len(chunk)
                if size > cap:
                    break
                digest.update(chunk)
    except OSError as exc:
        raise PackagingError(f"cannot read {path}: {exc}") from exc
    return digest.hexdigest(), size


def _provenance(repo: Any, cmd: Any, git_mod: Any, untracked: list[str], diff_cap: int
                ) -> Provenance:
    head: str | None
    try:
        head = str(repo.head.commit.hexsha)
    except ValueError:  # no commit yet
        head = None
    try:
        branch: str | None = str(repo.active_branch.name)
    except (TypeError, ValueError):  # detached HEAD, or unborn branch
        branch = None
    diff = ""
    dirty = head is None
    if head is not None:
        # --text/--no-textconv: a `.gitattributes` line (`ajet/** -diff`) cannot turn the
        # claimed diff into "Binary files differ" (it is still only the client's claim)
        diff = _git(cmd, git_mod, "diff", "HEAD", "--no-color", "--no-ext-diff", "--text",
                    "--no-textconv", "--", "ajet")
        dirty = bool(diff)
        if len(diff) > diff_cap:
            diff = diff[:diff_cap] + f"\n... diff truncated ({len(diff)} characters in all)\n"
    shown = untracked[:UNTRACKED_LIST_CAP]
    if len(untracked) > UNTRACKED_LIST_CAP:
        shown.append(f"... and {len(untracked) - UNTRACKED_LIST_CAP} more")
    return Provenance(
        git_head=head,
        branch=branch,
        dirty=dirty,
        diff=diff,
        untracked_left_out=shown,
        host=socket.gethostname(),
        created_at=time.time(),
        source="manifest",
    )
