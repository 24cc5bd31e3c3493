"""`StandbyKeeper`: keeps one warm engine interpreter ready and hands it the next start.

A cold engine start spends most of its time in a fresh interpreter importing torch and
transformers. The keeper starts `swarm_server/standby.py` ahead of time under
`settings.engine_python`, which preloads those modules (`settings.standby_preload`) and
waits on its stdin. On a single-process engine start (`<python> -m <engine module> ...`;
torchrun launches stay cold) the controller offers the spawn to `take()`: if the standby
lives, runs that interpreter and has the environment the engine would get (apart from
`PYTHONPATH` and `ISOLATED_AGENTJET_BASE_DIR`, which the standby applies itself), the
keeper writes the launch order to its stdin and returns its handle. From then on it is
the engine process: same `ProcessHandle` (a `Popen`), same process group, so stop, kill,
crash detection and recovery work as for a cold spawn. Otherwise the controller spawns
cold, as before. The controller calls `ensure()` when a config is accepted (or at server
start if one is stored: a server that never trains never pays for a standby) and once an
engine serves or has ended, so the next standby does not compete with a booting engine
for the CPU.

The standby is started exactly like an engine (own session and process group, stdin a
pipe, output appended to `<workdir>/standby.log`), and recorded as pid + start time in
ledger meta `standby_process`, so `recover()` stops one a killed server left behind
(never by name). It also exits by itself when the server's end of the pipe closes.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from swarm_server.engine_user import EngineUser
from swarm_server.ledger import Ledger
from swarm_server.settings import Settings
from swarm_server.supervisor import (
    ProcessHandle,
    Spawner,
    SpawnSpec,
    engine_env,
    process_start_time,
    stop_group,
)

__all__ = ["STANDBY_META_KEY", "STANDBY_SCRIPT", "StandbyKeeper"]

log = logging.getLogger(__name__)

#: Ledger meta key: JSON {"pid", "start_time"} of the last standby this server started.
STANDBY_META_KEY = "standby_process"
#: The program the standby runs (standard library only, so any engine interpreter runs it).
STANDBY_SCRIPT = Path(__file__).resolve().with_name("standby.py")
#: Set per start from the order, not at interpreter start: the standby applies them itself.
#: The run's device slots are among them: importing torch does not initialise CUDA, which
#: reads CUDA_VISIBLE_DEVICES only when the engine first touches a GPU.
_PER_START_ENV = frozenset({"PYTHONPATH", "ISOLATED_AGENTJET_BASE_DIR",
                            "CUDA_VISIBLE_DEVICES", "AJET_ENGINE_DEVICE_SLOTS"})
#: An idle standby dies at once on SIGTERM; this only bounds a standby caught mid-import.
_STOP_GRACE_S = 2.0


@dataclass
class _Standby:
    handle: ProcessHandle  # native: the Popen, so PosixSpawner.wait reaps it like an engine
    proc: subprocess.Popen[bytes]
    python: str
    env: dict[str, str]


def _fixed_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _PER_START_ENV}


class StandbyKeeper:
    """One warm standby at most; thread-safe. Needs a spawner whose handles are `Popen`s
    (`supervisor.PosixSpawner`): the engine controller builds a keeper only with that."""

    def __init__(self, settings: Settings, ledger: Ledger, spawner: Spawner, *,
                 engine_user: EngineUser | None = None) -> None:
        self.settings = settings
        self.ledger = ledger
        self.spawner = spawner
        self.engine_user = engine_user  # the standby runs as the engine would
        self._lock = threading.Lock()
        self._standby: _Standby | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The waiting standby's pid, or None."""
        with self._lock:
            return self._standby.handle.pid if self._standby is not None else None

    def ensure(self) -> None:
        """Start a standby unless one lives (or the keeper is closed). Never raises."""
        with self._lock:
            if self._closed or not self.settings.warm_standby:
                return
            current = self._standby
            if current is not None:
                if current.proc.poll() is None:
                    return
                log.warning("warm standby pid %s exited (code %s); starting a new one",
                            current.handle.pid, current.proc.returncode)
                self._standby = None
            try:
                self._standby = self._spawn()
            except OSError as exc:
                log.warning("could not start a warm standby (%s); engine starts stay cold", exc)
                return
            pid, start_time = self._standby.handle.pid, self._standby.handle.start_time
        log.info("warm standby pid %s started (%s)", pid, self.settings.engine_python)
        if start_time is not None:
            self.ledger.set_meta(STANDBY_META_KEY,
                                 json.dumps({"pid": pid, "start_time": start_time}))

    def take(self, spec: SpawnSpec) -> ProcessHandle | None:
        """Hand `spec` to the standby and return it as the engine's handle; None = spawn cold.

        Takes only a single-process start of `settings.engine_module` under the standby's
        interpreter, with the standby's environment apart from the per-start variables.
        """
        argv = spec.argv
        if len(argv) < 3 or argv[1] != "-m" or argv[2] != self.settings.engine_module:
            return None
        with self._lock:
            standby, self._standby = self._standby, None
        if standby is None:
            return None
        if standby.proc.poll() is not None:
            log.warning("warm standby pid %s had exited (code %s); starting the engine cold",
                        standby.handle.pid, standby.proc.returncode)
            return None
        if argv[0] != standby.python or _fixed_env(spec.env) != _fixed_env(standby.env):
            log.info("warm standby pid %s was started with another interpreter or "
                     "environment; starting the engine cold", standby.handle.pid)
            self._discard(standby)
            return None
        order = {"argv": argv, "env": spec.env, "cwd": str(spec.cwd),
                 "log_path": str(spec.log_path)}
        try:
            if standby.proc.stdin is None:  # cannot happen with Popen(stdin=PIPE)
                raise BrokenPipeError("the standby has no stdin pipe")
            standby.proc.stdin.write(json.dumps(order).encode() + b"\n")
            standby.proc.stdin.close()
        except OSError as exc:  # BrokenPipeError: it died just now
            log.warning("warm standby pid %s did not take the launch order (%s); starting "
                        "the engine cold", standby.handle.pid, exc)
            self._discard(standby)
            return None
        return standby.handle

    def recover(self) -> None:
        """Stop a standby an earlier server left running (pid and start time must match)."""
        raw = self.ledger.get_meta(STANDBY_META_KEY)
        if raw is None:
            return
        try:
            record = json.loads(raw)
            pid, start_time = int(record["pid"]), float(record["start_time"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable %s record: %r", STANDBY_META_KEY, raw)
        else:
            handle = self.spawner.adopt(pid, start_time)
            if handle is not None:
                log.warning("stopping warm standby pid %s left by a previous server", pid)
                stop_group(self.spawner, handle, grace_s=_STOP_GRACE_S)
        self.ledger.set_meta(STANDBY_META_KEY, None)

    def close(self) -> None:
        """Stop the standby and start no other (server shutdown)."""
        with self._lock:
            self._closed = True
            standby, self._standby = self._standby, None
        if standby is not None:
            self._discard(standby)
        self.ledger.set_meta(STANDBY_META_KEY, None)

    # ------------------------------------------------------------------ internals

    def _spawn(self) -> _Standby:
        settings = self.settings
        # The engine's environment without a snapshot, minus PYTHONPATH: the standby's
        # sys.path must be the interpreter's own, so that it can put the order's
        # PYTHONPATH in front exactly as a fresh interpreter would (standby.py).
        env = engine_env(settings, None, user=self.engine_user)
        env.pop("PYTHONPATH", None)
        argv = [settings.engine_python, str(STANDBY_SCRIPT)]
        if settings.standby_preload:
            argv += ["--preload", ",".join(settings.standby_preload)]
        settings.workdir.mkdir(parents=True, exist_ok=True)
        with open(settings.workdir / "standby.log", "ab") as out:
            proc = subprocess.Popen(
                argv, cwd=settings.workdir, env=env, stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                **(self.engine_user.popen_kwargs() if self.engine_user is not None else {}),
            )
        handle = ProcessHandle(pid=proc.pid, start_time=process_start_time(proc.pid),
                               native=proc)
        return _Standby(handle=handle, proc=proc, python=settings.engine_python, env=env)

    def _discard(self, standby: _Standby) -> None:
        if standby.proc.stdin is not None:
            try:
                standby.proc.stdin.close()
            except OSError:
                pass
        stop_group(self.spawner, standby.handle, grace_s=_STOP_GRACE_S)
