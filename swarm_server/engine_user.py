"""`EngineUser`: the engine under its own OS user (`--engine-user NAME`).

Approved code still runs with its user's rights. Under the server's own user it could
read `/proc/<server>/environ` (every token), the ledger and the approvers' tokens file.
With an engine user, every engine rank, the warm standby and the config validator run as
that user (`popen_kwargs`: `user`, `group`, no supplementary groups, umask 027), so:

- the server's own files (the ledger and its side files, the standby log, the pid file;
  tokens files are the operator's) stay owner-only, owned by the server's user, and
  `/proc/<server>/environ` is another user's;
- what the engine must read or write is shared through the engine user's primary group
  (`share_workdir`, at start and for every new snapshot and run): the work directory and
  `ajet_temp/` can be entered (0710 / 0750, never listed beyond that), snapshot folders are
  0750 / 0640, the folder of the run in progress and `models/` 0770; a finished run's
  folder goes back to the server's user, read-only to the group (`seal_run_dir`), so a
  later engine cannot rewrite its record; blobs, uploads in progress and the bytecode
  cache stay the server's alone;
- when a run ends, every process of that user but the warm standby is stopped
  (`stop_strays`: a daemon the engine started outside its process group does not
  outlive its run, nor a revocation), so the user must be a dedicated one per server;
- at start `check` runs the engine's interpreter as that user, reads a file placed where
  snapshots live and writes one where runs live, and refuses to start otherwise, with the
  reason (an interpreter under a 0700 home directory, such as root's pyenv, is the usual
  one).

Switching users needs a server that may do it: root (or CAP_SETUID and CAP_SETGID).
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from swarm_server.errors import StartupRefused
from swarm_server.settings import Settings

__all__ = ["ENGINE_UMASK", "EngineUser", "resolve_engine_user"]

log = logging.getLogger(__name__)

#: The engine's umask: its files readable by the server's group share, by nobody else.
ENGINE_UMASK = 0o027
_PROBE = ".engine-user-probe"
_CHECK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EngineUser:
    name: str
    uid: int
    gid: int  # the primary group: the share with the server
    home: str

    def popen_kwargs(self) -> dict[str, Any]:
        """What `subprocess.Popen` needs to start a child as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "umask": ENGINE_UMASK}

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this user's identity: its own home (caches), name and login."""
        return {**env, "HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    # ------------------------------------------------------------------ sharing

    def share(self, path: Path, mode: int) -> None:
        """Give `path` to the engine's group with `mode`; a symlink is never followed."""
        _set_owner(None, str(path), -1, self.gid, mode)

    def share_tree(self, root: Path, *, dir_mode: int, file_mode: int,
                   uid: int = -1) -> None:
        """`share` on `root` and everything under it (executables keep their x bits).

        Walked by directory descriptors (`os.fwalk`) and opened with `O_NOFOLLOW`, so an
        engine that swaps a file or a folder for a symlink meanwhile cannot make the
        server change the mode of anything outside `root`.
        """
        if not root.is_dir() or root.is_symlink():
            return
        for _, _, files, dir_fd in os.fwalk(root, follow_symlinks=False):
            _set_fd(dir_fd, uid, self.gid, dir_mode)
            for name in files:
                _set_owner(dir_fd, name, uid, self.gid, file_mode, keep_exec=True)

    def share_snapshot(self, folder: Path) -> None:
        """A snapshot's folder (`ajet_temp/<name>`): the engine reads, never writes."""
        self.share_tree(folder, dir_mode=0o750, file_mode=0o640)

    def share_run_dir(self, run_dir: Path) -> None:
        """A run's folder: the engine writes its metrics, checkpoints and socket there;
        it reads `job.yaml` and appends to `engine.log` (a warm standby opens it itself)."""
        self.share(run_dir, 0o770)
        for path in run_dir.iterdir():
            if path.is_file() and not path.is_symlink():
                self.share(path, 0o660 if path.name == "engine.log" else 0o640)

    def seal_run_dir(self, run_dir: Path) -> None:
        """A finished run's folder back to the server's user, read-only to the group:
        the engines of later runs must not rewrite the record of this one."""
        try:
            self.share_tree(run_dir, dir_mode=0o750, file_mode=0o640, uid=os.geteuid())
        except OSError as exc:
            log.warning("could not seal %s after its run: %s", run_dir, exc)

    def stop_strays(self, *, keep: set[int]) -> list[int]:
        """SIGKILL every process of this user but `keep` (the warm standby): what the
        engine started outside its process group (a daemon, `setsid`) must not outlive
        its run, nor a revocation. One engine user per server: this stops all of its."""
        stopped = []
        for proc in psutil.process_iter(["pid", "uids"]):
            uids = proc.info.get("uids")
            if uids is None or proc.info["pid"] in keep:
                continue
            if self.uid in (uids.real, uids.effective):
                try:
                    proc.kill()
                    stopped.append(proc.info["pid"])
                except psutil.Error:
                    continue
        if stopped:
            log.warning("stopped %d process(es) of engine user %s left after its run: %s",
                        len(stopped), self.name, stopped)
        return stopped

    def share_workdir(self, settings: Settings) -> None:
        """The folders the engine needs, at start (after the start-up tightening)."""
        workdir = settings.workdir
        self.share(workdir, 0o710)  # enter, not list
        ajet_temp = settings.ajet_temp
        ajet_temp.mkdir(parents=True, exist_ok=True)
        self.share(ajet_temp, 0o750)
        for entry in ajet_temp.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):  # blobs, .pyc stay private
                self.share_snapshot(entry)
        settings.runs_dir.mkdir(parents=True, exist_ok=True)
        # the runs in it keep their modes: finished ones were sealed, and an engine an
        # earlier server left running still writes into its own
        self.share(settings.runs_dir, 0o770)
        models = workdir / "models"
        models.mkdir(exist_ok=True)
        self.share_tree(models, dir_mode=0o770, file_mode=0o660)

    # ------------------------------------------------------------------ check

    def check(self, settings: Settings) -> None:
        """Refuse to start unless this user can run the engine's interpreter, read a
        file where snapshots live and write one where runs live, and cannot read the
        approvers' tokens file."""
        tokens = settings.approver_tokens_file
        if tokens is not None:
            st = tokens.stat()
            if st.st_mode & 0o004 or (st.st_mode & 0o040 and st.st_gid == self.gid) \
                    or st.st_uid == self.uid:
                raise StartupRefused(
                    f"--engine-user {self.name}: the approvers' tokens file {tokens} is "
                    f"readable by that user (mode {stat.S_IMODE(st.st_mode):04o}); "
                    f"chmod 600 {tokens} and keep it owned by the server's user")
        probe_dir = settings.ajet_temp / _PROBE
        probe_dir.mkdir(exist_ok=True)
        probe = probe_dir / "read-me"
        probe.write_text("ok\n")
        self.share_snapshot(probe_dir)
        written = settings.runs_dir / _PROBE
        code = ("import sys; open(sys.argv[1]).read(); "
                "open(sys.argv[2], 'w').write('ok'); print(sys.version_info[0])")
        try:
            proc = subprocess.run([settings.engine_python, "-c", code, str(probe), str(written)],
                                  cwd="/", env=self.env({"PATH": os.environ.get("PATH", "")}),
                                  capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S,
                                  check=False, **self.popen_kwargs())
            ok, why = proc.returncode == 0, (proc.stderr.strip().splitlines() or [""])[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            ok, why = False, str(exc)
        finally:
            probe.unlink(missing_ok=True)
            probe_dir.rmdir()
        written.unlink(missing_ok=True)
        if not ok:
            raise StartupRefused(
                f"--engine-user {self.name}: that user cannot run the engine: {why[:300]}. "
                f"It must be able to execute {settings.engine_python} (an interpreter under "
                "a 0700 home directory, such as /root/.pyenv, is the usual cause: install "
                "one the user can reach, e.g. a venv from the system python3, and point "
                f"AJET_SWARM_ENGINE_PYTHON at it), and to enter {settings.workdir} and every "
                "folder above it")
        log.info("engine processes run as user %s (uid %d, group %d)", self.name, self.uid,
                 self.gid)


def _set_owner(dir_fd: int | None, name: str, uid: int, gid: int, mode: int, *,
               keep_exec: bool = False) -> None:
    """chown/chmod one regular file or folder through a descriptor opened without
    following a symlink (relative to `dir_fd`); a symlink, socket or FIFO is left alone."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            return
        raise
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return
        if keep_exec and stat.S_ISREG(st.st_mode) and st.st_mode & 0o100:
            mode |= 0o110
        _set_fd(fd, uid, gid, mode, st)
    finally:
        os.close(fd)


def _set_fd(fd: int, uid: int, gid: int, mode: int, st: os.stat_result | None = None) -> None:
    st = st or os.fstat(fd)
    if st.st_gid != gid or (uid != -1 and st.st_uid != uid):
        os.fchown(fd, uid, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


def resolve_engine_user(settings: Settings) -> EngineUser | None:
    """The engine user of `settings`, checked; None when the engine runs as the server."""
    name = settings.engine_user
    if name is None:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError as exc:
        raise StartupRefused(f"--engine-user {name}: no such user; create it first "
                             f"(useradd --system {name})") from exc
    if os.geteuid() != 0:
        raise StartupRefused(f"--engine-user {name}: this server runs as uid {os.geteuid()} "
                             "and cannot switch users; start it as root (it keeps its own "
                             "files private and runs only the engine as that user)")
    if entry.pw_uid == os.geteuid() or entry.pw_uid == 0:
        raise StartupRefused(f"--engine-user {name}: the engine user must differ from the "
                             "server's user and from root, or it can read the server's "
                             "environment and files")
    try:
        grp.getgrgid(entry.pw_gid)
    except KeyError as exc:
        raise StartupRefused(f"--engine-user {name}: its group {entry.pw_gid} does not "
                             "exist") from exc
    return EngineUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)
