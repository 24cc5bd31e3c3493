"""Builders shared by the code-sync and security tests: zips, manifests, blob streams,
git repos, and a byte-for-byte digest of the server's snapshot store.

`tests/swarm_server/test_safe_zip.py` keeps the named corpus of hostile archives built
from these; `tests/security/` generates more with hypothesis from the same builders.
"""

from __future__ import annotations

import hashlib
import io
import stat
import struct
import subprocess
import zipfile
from pathlib import Path

__all__ = [
    "GIT",
    "HOSTILE_LIMITS",
    "blob_record",
    "central_entries",
    "commit_all",
    "git",
    "make_zip",
    "manifest_entry",
    "patch",
    "snapshot_dirs",
    "store_state",
    "tree_digest",
    "tree_repo",
    "with_raw_name",
]

GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=test"]

#: Server limits for hostile-input servers; the zip corpus is sized against them
#: (test_safe_zip.LIMITS holds the same numbers).
HOSTILE_LIMITS = {
    "AJET_SWARM_MAX_FILES": "20",
    "AJET_SWARM_MAX_FILE_BYTES": str(1 << 20),
    "AJET_SWARM_MAX_UNPACKED_BYTES": str(4 << 20),
    "AJET_SWARM_MAX_COMPRESSION_RATIO": "100",
    "AJET_SWARM_MAX_UPLOAD_BYTES": str(8 << 20),
}


# ---------------------------------------------------------------------------- zips


def make_zip(members: list[tuple[str, bytes]], *, mode: int = stat.S_IFREG | 0o644,
             method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = mode << 16
            info.compress_type = method
            zf.writestr(info, data)
    return buf.getvalue()


def central_entries(data: bytes) -> list[int]:
    """Offsets of the central-directory headers."""
    out, at = [], 0
    while (at := data.find(b"PK\x01\x02", at)) >= 0:
        out.append(at)
        at += 4
    return out


def patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    raw = bytearray(data)
    struct.pack_into(fmt, raw, offset, value)
    return bytes(raw)


def with_raw_name(name_template: str, replace: bytes, by: bytes) -> bytes:
    # zipfile cuts names at NUL when writing; write a placeholder and patch both headers
    data = make_zip([(name_template, b"x = 1\n")])
    return data.replace(replace, by)


# ---------------------------------------------------------------------------- manifests, blobs


def manifest_entry(path: str = "ajet/x.py", data: bytes = b"x = 1\n", mode: int = 0o644
                   ) -> dict[str, object]:
    return {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
            "mode": mode}


def blob_record(data: bytes, sha: str | None = None, size: int | None = None) -> bytes:
    """One record of the `POST /code/blobs` stream: '<sha256> <size>\\n' + bytes."""
    sha = sha or hashlib.sha256(data).hexdigest()
    return f"{sha} {len(data) if size is None else size}\n".encode() + data


# ---------------------------------------------------------------------------- repos


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def commit_all(repo: Path) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "change")


def tree_repo(root: Path, n_files: int, file_bytes: int = 64) -> Path:
    """A git repo whose ajet/ holds `n_files` distinct small modules."""
    pkg = root / "ajet"
    for i in range(n_files):
        sub = pkg / f"m{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "__init__.py").write_text("")
        # hex noise compresses like real source (a few times), not like a zip bomb
        noise = "".join(hashlib.sha256(f"{i}-{j}".encode()).hexdigest() + "\n"
                        for j in range(max(0, file_bytes - 20) // 65))
        body = f"VALUE_{i} = {i}\n" + "".join(f"# {line}\n" for line in noise.split())
        (sub / f"mod_{i}.py").write_text(body)
    (pkg / "__init__.py").write_text('"""synthetic ajet"""\n')
    subprocess.run(["git", "init", "-q", "-b", "main", str(root)], check=True)
    commit_all(root)
    return root


# ---------------------------------------------------------------------------- server state


def snapshot_dirs(workdir: Path) -> list[str]:
    """Snapshot folders (and `.partial` ones) under ajet_temp/, not the store's dot-folders."""
    root = workdir / "ajet_temp"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) \
        if root.is_dir() else []


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under `root` with its type, mode and content hash: byte-for-byte state."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = path.relative_to(root).as_posix()
        if stat.S_ISDIR(st.st_mode):
            out[rel] = f"dir {st.st_mode:o}"
        else:
            out[rel] = f"{st.st_mode:o} {hashlib.sha256(path.read_bytes()).hexdigest()}"
    return out


def snapshot_folders_state(workdir: Path) -> dict[str, str]:
    """The snapshot folders under ajet_temp/ byte for byte, without the store's caches."""
    return {k: v for k, v in tree_digest(workdir / "ajet_temp").items()
            if not k.startswith((".blobs", ".pyc"))}


def store_state(workdir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Snapshot folders and blob store of a server's workdir, byte for byte."""
    return snapshot_folders_state(workdir), tree_digest(workdir / "ajet_temp" / ".blobs")
