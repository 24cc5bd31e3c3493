"""The server's work directory: what it creates there is private to the server's user.

The work directory holds the ledger (`swarm.sqlite3`: configs, provenance diffs, the
audit log), the code snapshots and blobs (`ajet_temp/`), the runs (`runs/`: configs,
engine logs, metrics, checkpoints, sockets), the built `models/` and the logs of the
warm standby. Under the default umask (022) all of it was world-readable. At start,
`prepare_workdir`:

- sets the process umask to 077, so every file and folder the server, its engine, the
  engine's ranks and the warm standby create from then on is owner-only (children
  inherit the umask); the few places that set a mode explicitly (snapshot files, blobs,
  the engine socket) mask it to the owner themselves;
- tightens what an earlier server left (`SERVER_OWNED`, recursively, symlinks not
  followed) to owner-only, without touching anything else in the folder: by default the
  work directory is wherever `ajet-swarm start` ran, often a home directory;
- warns, once, if the work directory itself can be listed or entered by other users.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

__all__ = ["PRIVATE_IN_SHARED", "PRIVATE_UMASK", "SERVER_OWNED", "SHARED_WITH_ENGINE",
           "owner_only", "prepare_workdir"]

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
#: What the server (and the engines and standbys it starts) create in the work directory.
SERVER_OWNED = ("swarm.sqlite3", "swarm.sqlite3-wal", "swarm.sqlite3-shm",
                "swarm.sqlite3-journal", "ajet_temp", "runs", "models", "standby.log",
                "swarm_server.pid")


def owner_only(mode: int) -> int:
    """`mode` with every group and other bit cleared (0o755 -> 0o700, 0o444 -> 0o400)."""
    return mode & ~0o077 & 0o7777


#: Under an engine user these are shared with its group (`swarm_server.engine_user`), so
#: the start-up tightening leaves them alone but for what inside stays the server's own.
SHARED_WITH_ENGINE = ("ajet_temp", "runs", "models")
PRIVATE_IN_SHARED = ("ajet_temp/.blobs", "ajet_temp/.incoming", "ajet_temp/.pyc")


def prepare_workdir(workdir: Path, *, shared: bool = False) -> None:
    """Set the umask, tighten what the server owns in `workdir`, warn if it is open.

    `shared` (an engine user): `SHARED_WITH_ENGINE` is left to `EngineUser.share_workdir`
    and only `PRIVATE_IN_SHARED` is tightened inside it.
    """
    os.umask(PRIVATE_UMASK)
    workdir.mkdir(parents=True, exist_ok=True)
    if shared:
        names = [n for n in SERVER_OWNED if n not in SHARED_WITH_ENGINE]
        names += PRIVATE_IN_SHARED
    else:
        names = list(SERVER_OWNED)
    tightened = sum(_tighten(workdir / name) for name in names)
    if tightened:
        log.warning("made %d file(s) and folder(s) under %s private to their owner "
                    "(they were readable by other users)", tightened, workdir)
    mode = stat.S_IMODE(workdir.stat().st_mode)
    if (workdir / ".git").exists():
        # a checkout is meant to be readable; advising chmod 700 on it would be wrong
        log.warning("the work directory %s is a git checkout: the server's ledger, "
                    "snapshots and runs go into it (git-ignored, mode 0700/0600); start with "
                    "--workdir DIR to keep them elsewhere", workdir)
    elif mode & 0o077 and not shared:
        log.warning("the work directory %s has mode %04o: other users can list it; its "
                    "contents are private (mode 0700/0600), but consider "
                    "'chmod 700 %s'", workdir, mode, workdir)


def _tighten(path: Path) -> int:
    """chmod go-rwx on `path` and everything under it; how many entries changed."""
    changed = 0
    try:
        top = path.lstat()
    except FileNotFoundError:
        return 0
    if stat.S_ISLNK(top.st_mode):
        return 0
    changed += _chmod(path, top.st_mode)
    if stat.S_ISDIR(top.st_mode):
        for root, dirs, files in os.walk(path):  # os.walk does not follow symlinks
            for name in (*dirs, *files):
                entry = Path(root) / name
                try:
                    st = entry.lstat()
                except FileNotFoundError:
                    continue  # an engine removed it meanwhile
                if not stat.S_ISLNK(st.st_mode):
                    changed += _chmod(entry, st.st_mode)
    return changed


def _chmod(path: Path, mode: int) -> int:
    if not mode & 0o077:
        return 0
    try:
        os.chmod(path, owner_only(stat.S_IMODE(mode)))
    except OSError as exc:  # not ours (another user's file): say so, do not fail the start
        log.warning("could not make %s private: %s", path, exc)
        return 0
    return 1
