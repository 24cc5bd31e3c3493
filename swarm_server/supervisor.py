"""Engine process supervision: spawn in its own process group, signal the group, wait.

The `Spawner` protocol is the seam between the engine state machine
(`swarm_server.engine`) and the operating system, as supervisor's `options` and httpx's
transports are: `PosixSpawner` does the real work, `FakeSpawner` lets the state machine
be tested without spawning anything. `EngineProbe` is the same kind of seam for the
engine's private channel (`GET /status` on its Unix socket).

Stopping follows supervisor's `kill()`: SIGTERM to the whole group, a grace period, then
SIGKILL; "no such process" (ESRCH) means the group is already gone, not an error.
A process is identified by pid *and* start time, so a recycled pid is never signalled.
"""

from __future__ import annotations

import http.client
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psutil
from pydantic import ValidationError

from ajet.errors import EngineStateConflict
from ajet.protocol import EngineReport
from swarm_server.engine_channel import TcpEndpoint
from swarm_server.settings import SECRET_ENV_PREFIXES, Settings

if TYPE_CHECKING:
    from swarm_server.engine_user import EngineUser

__all__ = [
    "EngineProbe",
    "FakeProcess",
    "PlacementRefused",
    "FakeSpawner",
    "PosixSpawner",
    "ProbeFactory",
    "ProcessHandle",
    "SocketProbe",
    "TcpProbe",
    "CHILD_ENV_NAMES",
    "CHILD_ENV_PREFIXES",
    "SpawnSpec",
    "Spawner",
    "child_env",
    "engine_env",
    "process_start_time",
    "snapshot_env",
    "stop_group",
]

log = logging.getLogger(__name__)

#: What a child that runs synced code gets from the server's environment: an allow-list,
#: never the server's environment minus a deny-list, so a secret the server holds under a
#: name nobody thought of (a tokens file path, a cloud key) stays out. These run Python,
#: torch, CUDA, NCCL and Hugging Face; anything else goes through `--engine-env`.
CHILD_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE",
    "TMPDIR", "TMP", "TEMP", "PYTHONPATH", "PYTHONIOENCODING", "PYTHONUTF8",
    "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "XDG_CACHE_HOME",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
})
#: Prefixes of the same: locale, devices, collective libraries, thread pools, the hub,
#: and the engine's own settings (`AJET_ENGINE_*`).
CHILD_ENV_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "PYTORCH_", "TORCH_",
                      "TORCHINDUCTOR_", "TRITON_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                      "HIP_", "ROCR_", "GLOO_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
                      "AJET_ENGINE_")
#: Two start times closer than this belong to the same process (psutil rounds to ticks).
_START_TIME_TOLERANCE_S = 0.05


@dataclass
class SpawnSpec:
    """Everything needed to start one engine process."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]
    log_path: Path  # stdout and stderr are appended here


@dataclass
class ProcessHandle:
    """One spawned (or adopted) process group leader; the group id equals `pid`."""

    pid: int
    start_time: float | None  # psutil create_time: pid + start time identify the process
    returncode: int | None = None  # negative = killed by that signal; None = unknown
    exited: bool = False
    native: Any = field(default=None, repr=False)  # Popen, FakeProcess, or None if adopted
    #: the launcher's word on how it ended (which node and rank), where it has one
    detail: str | None = None


class PlacementRefused(EngineStateConflict):
    """409 from `Spawner.start`: the launcher cannot place the run now (a Ray cluster
    whose free resources do not hold it). `never`: nor could it with everything free, as
    the cluster stands. The run pool queues a run refused for now and retries it."""

    def __init__(self, detail: str, hint: str, *, never: bool = False) -> None:
        super().__init__(409, detail, hint)
        self.never = never


class Spawner(Protocol):
    """How the engine controller starts, signals and waits for engine processes."""

    def start(self, spec: SpawnSpec) -> ProcessHandle:
        """Start `spec.argv` as the leader of a new session and process group
        (`PlacementRefused` when the launcher cannot place it)."""
        ...

    def signal_group(self, handle: ProcessHandle, sig: int) -> bool:
        """Send `sig` to the whole group; False if the group is already gone (ESRCH)."""
        ...

    def wait(self, handle: ProcessHandle, timeout: float | None) -> bool:
        """Wait for the leader to exit (sets `returncode`); False if still running."""
        ...

    def group_alive(self, handle: ProcessHandle) -> bool:
        """True while any process of the group (zombies aside) still exists."""
        ...

    def adopt(self, pid: int, start_time: float) -> ProcessHandle | None:
        """A handle on a process left by an earlier server, if pid and start time match."""
        ...


class EngineProbe(Protocol):
    """Reads the engine's report over its private channel."""

    def get_report(self) -> EngineReport | None:
        """The engine's `GET /status`, or None while it does not answer."""
        ...

    def close(self) -> None: ...


ProbeFactory = Callable[[Path], EngineProbe]


# ---------------------------------------------------------------------------- helpers


def process_start_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), or None if it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def child_env(environ: Mapping[str, str], *, extra: Sequence[str] = (),
              secrets: Sequence[str] = ()) -> dict[str, str]:
    """The allow-listed part of `environ` (`CHILD_ENV_NAMES`, `CHILD_ENV_PREFIXES`, `extra`).

    Never an `AJET_SWARM_*` or `AJET_MCP_*` variable, whatever `extra` says, and never a
    variable whose value holds one of `secrets` (a token copied under another name).
    """
    wanted = set(extra)
    env: dict[str, str] = {}
    for name, value in environ.items():
        if name.upper().startswith(SECRET_ENV_PREFIXES):
            continue
        if not (name in CHILD_ENV_NAMES or name.startswith(CHILD_ENV_PREFIXES)
                or name in wanted):
            continue
        if any(secret and secret in value for secret in secrets):
            log.warning("not passing %s to the engine: its value holds a server token", name)
            continue
        env[name] = value
    return env


def snapshot_env(base_dir: Path | None, environ: Mapping[str, str] | None = None, *,
                 extra: Sequence[str] = (), secrets: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a child that runs code from a snapshot (docs/internals.md).

    The allow-listed part of the server's environment (`child_env`): the child runs code
    a researcher synced, so no token, approver list or path to a tokens file reaches it.
    With a snapshot, `ISOLATED_AGENTJET_BASE_DIR` names it and it comes first on
    `PYTHONPATH`, so `import ajet` finds the synced code before anything installed.
    """
    env = child_env(os.environ if environ is None else environ, extra=extra, secrets=secrets)
    if base_dir is not None:
        env["ISOLATED_AGENTJET_BASE_DIR"] = str(base_dir)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(base_dir) + (os.pathsep + old if old else "")
    env["PYTHONUNBUFFERED"] = "1"  # so engine.log has each line when it is written
    return env


def engine_env(settings: Settings, base_dir: Path | None, *,
               user: EngineUser | None = None) -> dict[str, str]:
    """`snapshot_env` with the server's `--engine-env` names, and its tokens and the path
    of the approvers' tokens file to keep out; under an engine user, that user's home and
    name."""
    secrets = settings.secret_values()
    if settings.approver_tokens_file is not None:  # no path to a secret either
        secrets.append(str(settings.approver_tokens_file))
    env = snapshot_env(base_dir, extra=settings.engine_env, secrets=secrets)
    return user.env(env) if user is not None else env


def stop_group(spawner: Spawner, handle: ProcessHandle, *, grace_s: float,
               kill_wait_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> bool:
    """Stop a whole process group: SIGTERM, up to `grace_s` to exit, then SIGKILL.

    Returns True if a signal reached the group (something was running). Returns once
    no process of the group is left, or after `kill_wait_s` more if even SIGKILL did not
    clear it (a process stuck in the kernel); that is logged.
    """
    if not spawner.signal_group(handle, signal.SIGTERM):
        spawner.wait(handle, 0)  # reap a leader that exited just before
        return False
    if _wait_group_gone(spawner, handle, clock() + grace_s, clock):
        return True
    log.warning("process group %s still alive %.1fs after SIGTERM; sending SIGKILL",
                handle.pid, grace_s)
    spawner.signal_group(handle, signal.SIGKILL)
    if not _wait_group_gone(spawner, handle, clock() + kill_wait_s, clock):
        log.error("process group %s survived SIGKILL for %.1fs", handle.pid, kill_wait_s)
    return True


def _wait_group_gone(spawner: Spawner, handle: ProcessHandle, deadline: float,
                     clock: Callable[[], float]) -> bool:
    spawner.wait(handle, max(0.0, deadline - clock()))
    delay = 0.005
    while True:
        if handle.exited and not spawner.group_alive(handle):
            return True
        remaining = deadline - clock()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)
        if not handle.exited:
            spawner.wait(handle, 0)


# ---------------------------------------------------------------------------- real


class PosixSpawner:
    """Real processes: `subprocess.Popen(start_new_session=True)` and `os.killpg`.

    With `as_user` every process starts as that user (`--engine-user`).
    """

    def __init__(self, as_user: EngineUser | None = None) -> None:
        self.as_user = as_user

    def start(self, spec: SpawnSpec) -> ProcessHandle:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        user = self.as_user.popen_kwargs() if self.as_user is not None else {}
        with open(spec.log_path, "ab") as log_file:
            proc = subprocess.Popen(
                spec.argv, cwd=spec.cwd, env=spec.env, stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True, **user,
            )
        return ProcessHandle(pid=proc.pid, start_time=process_start_time(proc.pid), native=proc)

    def signal_group(self, handle: ProcessHandle, sig: int) -> bool:
        try:
            os.killpg(handle.pid, sig)
        except ProcessLookupError:  # ESRCH: the whole group is gone already
            return False
        except PermissionError:
            # EPERM: the pgid now belongs to someone else's processes; never ours to touch
            log.warning("not allowed to signal process group %s; treating it as gone", handle.pid)
            return False
        return True

    def wait(self, handle: ProcessHandle, timeout: float | None) -> bool:
        if handle.exited:
            return True
        proc = handle.native
        if isinstance(proc, subprocess.Popen):
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            handle.returncode = proc.returncode
            handle.exited = True
            return True
        return self._wait_adopted(handle, timeout)

    def group_alive(self, handle: ProcessHandle) -> bool:
        try:
            os.killpg(handle.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        # kill(0) also succeeds while only zombies are left (orphans whose reaper is
        # slow or absent); those hold no resources and cannot be signalled away.
        for proc in psutil.process_iter(["status"]):
            try:
                if (os.getpgid(proc.pid) == handle.pid
                        and proc.info["status"] != psutil.STATUS_ZOMBIE):
                    return True
            except (ProcessLookupError, psutil.Error):
                continue
        return False

    def adopt(self, pid: int, start_time: float) -> ProcessHandle | None:
        actual = process_start_time(pid)
        if actual is None or abs(actual - start_time) > _START_TIME_TOLERANCE_S:
            return None  # gone, or the pid was recycled by an unrelated process
        try:
            if os.getpgid(pid) != pid:  # engines lead their own group; anything else is not ours
                return None
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return None
        except (ProcessLookupError, psutil.Error):
            return None
        return ProcessHandle(pid=pid, start_time=actual)

    def _wait_adopted(self, handle: ProcessHandle, timeout: float | None) -> bool:
        # Not our child: we cannot waitpid() it, so poll until it is gone or a zombie.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                proc = psutil.Process(handle.pid)
                gone = (proc.status() == psutil.STATUS_ZOMBIE
                        or abs(proc.create_time() - (handle.start_time or 0.0))
                        > _START_TIME_TOLERANCE_S)
            except psutil.NoSuchProcess:
                gone = True
            except psutil.Error:
                gone = False
            if gone:
                handle.exited = True
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


class SocketProbe:
    """`GET /status` over the engine's Unix socket, one keep-alive connection per run.

    The stdlib's `http.client` rather than httpx: the probe runs every `status_poll_s`
    (0.1 s) in a thread of the server, and httpx's client (URL merging, cookies, hooks, a
    connection pool) cost about 1.3 ms of CPU per poll, time the GIL was taken from the
    episode plane's event loop.
    """

    def __init__(self, socket_path: Path, *, timeout: float = 2.0) -> None:
        self._conn = _UnixHTTPConnection(str(socket_path), timeout=timeout)

    def get_report(self) -> EngineReport | None:
        try:
            self._conn.request("GET", "/status", headers={"Host": "engine"})
            response = self._conn.getresponse()
            content = response.read()
        except (OSError, http.client.HTTPException):
            self._conn.close()  # reconnects on the next poll
            return None  # not listening yet, or busy: the caller keeps the last state
        if response.status != 200:
            return None
        try:
            return EngineReport.model_validate_json(content)
        except ValidationError as exc:
            log.warning("engine answered /status with an invalid report: %s", exc)
            return None

    def close(self) -> None:
        self._conn.close()


class TcpProbe(SocketProbe):
    """`GET /status` on rank 0's TCP channel (another machine), with the run's bearer token."""

    def __init__(self, endpoint: TcpEndpoint, *, timeout: float = 2.0) -> None:
        self._conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
        self._headers = {"Host": "engine", "Authorization": f"Bearer {endpoint.token}"}

    def get_report(self) -> EngineReport | None:
        try:
            self._conn.request("GET", "/status", headers=self._headers)
            response = self._conn.getresponse()
            content = response.read()
        except (OSError, http.client.HTTPException):
            self._conn.close()
            return None
        if response.status != 200:
            if response.status == 401:
                log.warning("the engine's TCP channel refused the run's token")
            return None
        try:
            return EngineReport.model_validate_json(content)
        except ValidationError as exc:
            log.warning("engine answered /status with an invalid report: %s", exc)
            return None


class _UnixHTTPConnection(http.client.HTTPConnection):
    """`http.client.HTTPConnection` to a Unix socket (the path stands for the host)."""

    def __init__(self, socket_path: str, *, timeout: float) -> None:
        super().__init__("engine", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


# ---------------------------------------------------------------------------- fake


@dataclass
class FakeProcess:
    """A process that exists only in memory; tests drive it.

    `report` is what its socket answers (None = not listening yet). `term_exit_code`
    is the code it exits with on SIGTERM; None means it ignores SIGTERM.
    """

    pid: int
    spec: SpawnSpec
    report: EngineReport | None = None
    term_exit_code: int | None = 0
    signals: list[int] = field(default_factory=list)
    returncode: int | None = None
    _exited: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def socket_path(self) -> Path:
        return Path(self.spec.argv[self.spec.argv.index("--socket") + 1])

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    def exit(self, code: int, log_lines: list[str] | None = None) -> None:
        """End the process with `code`, first appending `log_lines` to its log."""
        if log_lines:
            with open(self.spec.log_path, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in log_lines))
        if self.alive:
            self.returncode = code
            self._exited.set()


class FakeSpawner:
    """In-memory `Spawner` plus `ProbeFactory` for state-machine tests.

    Started processes are in `processes` (oldest first); `orphans` are what `adopt`
    finds, keyed by pid, as if an earlier server had left them running.
    """

    def __init__(self) -> None:
        self.processes: list[FakeProcess] = []
        self.orphans: dict[int, FakeProcess] = {}
        self._next_pid = 40_000
        self._lock = threading.Lock()

    def start(self, spec: SpawnSpec) -> ProcessHandle:
        with self._lock:
            self._next_pid += 1
            proc = FakeProcess(pid=self._next_pid, spec=spec)
            self.processes.append(proc)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        spec.log_path.touch()
        return ProcessHandle(pid=proc.pid, start_time=1000.0 + proc.pid, native=proc)

    def signal_group(self, handle: ProcessHandle, sig: int) -> bool:
        proc: FakeProcess = handle.native
        if not proc.alive:
            return False
        proc.signals.append(sig)
        if sig == signal.SIGKILL:
            proc.exit(-signal.SIGKILL)
        elif sig == signal.SIGTERM and proc.term_exit_code is not None:
            proc.exit(proc.term_exit_code)
        return True

    def wait(self, handle: ProcessHandle, timeout: float | None) -> bool:
        proc: FakeProcess = handle.native
        if not proc._exited.wait(timeout):
            return False
        handle.returncode = proc.returncode
        handle.exited = True
        return True

    def group_alive(self, handle: ProcessHandle) -> bool:
        proc: FakeProcess = handle.native
        return proc.alive

    def adopt(self, pid: int, start_time: float) -> ProcessHandle | None:
        proc = self.orphans.get(pid)
        if proc is None or not proc.alive or abs(start_time - (1000.0 + pid)) > 1e-6:
            return None
        return ProcessHandle(pid=pid, start_time=start_time, native=proc)

    def probe(self, socket_path: Path) -> EngineProbe:
        """`ProbeFactory`: answers with the report of the live process on that socket."""
        return _FakeProbe(self, socket_path)

    def latest(self) -> FakeProcess:
        """The most recently started process."""
        with self._lock:
            return self.processes[-1]


class _FakeProbe:
    def __init__(self, spawner: FakeSpawner, socket_path: Path) -> None:
        self._spawner = spawner
        self._socket_path = socket_path

    def get_report(self) -> EngineReport | None:
        for proc in self._spawner.processes:
            if proc.alive and proc.socket_path == self._socket_path:
                return proc.report
        return None

    def close(self) -> None:
        pass
