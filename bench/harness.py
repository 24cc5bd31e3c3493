"""Real processes for the benchmarks: swarm servers on loopback, engines, resident memory.

Everything a benchmark measures runs for real, as a user would run it: `python -m
swarm_server start` subprocesses with tokens on free loopback ports, the engine those
servers spawn, `SwarmClient` over HTTP. `LocalServer` is a context manager that stops
its server (and, through it, the engine) on exit, whatever happened.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState, EngineStatus

__all__ = [
    "CONTROL_TOKEN",
    "PROJECT_ROOT",
    "STANDBY_OFF",
    "STANDBY_ON",
    "WORKER_TOKEN",
    "LocalServer",
    "child_env",
    "free_port",
    "rss_mb",
    "tiny_job",
    "wait_rolling_on",
]

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONTROL_TOKEN = "bench-control-token"
WORKER_TOKEN = "bench-worker-token"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MiB, or None if it is gone."""
    if pid is None:
        return None
    try:
        return float(psutil.Process(pid).memory_info().rss) / (1024 * 1024)
    except psutil.Error:
        return None


#: The server's warm standby (swarm_server/standby_keeper.py), off and on.
STANDBY_OFF = {"AJET_SWARM_WARM_STANDBY": "0"}
STANDBY_ON = {"AJET_SWARM_WARM_STANDBY": "1"}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any `AJET_SWARM_*` setting, the project first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def tiny_job(**overrides: Any) -> AgentJetJob:
    """The embedded default job (ajet-tiny on CPU), with `overrides`."""
    return AgentJetJob(model="ajet-tiny", experiment_name="bench", **overrides)


@dataclass
class LocalServer:
    """A `python -m swarm_server start` subprocess with a control and a worker token.

    The warm standby is off unless `env` turns it on (`STANDBY_ON`): a standby imports
    torch in the background as soon as an engine serves, which would take CPU from the
    figure being measured; the restart module measures it on purpose.
    """

    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 60.0
    port: int = 0
    #: the module run as `python -m MODULE start ...` (a profiling wrapper, for one)
    module: str = "swarm_server"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def client(self, *, token: str = CONTROL_TOKEN, timeout: float = 120.0) -> SwarmClient:
        return SwarmClient(self.url, token=token, timeout=timeout)

    def start(self) -> LocalServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        env = child_env({"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                         "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN, **STANDBY_OFF, **self.env})
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "start", f"--swarm-port={self.port}",
                 "--host", "127.0.0.1", "--workdir", str(self.workdir),
                 "--log-level", "warning"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.workdir)
        deadline = time.monotonic() + self.start_timeout_s
        with self.client() as probe:
            while not probe.health():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text("utf-8", errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"swarm server did not start; its log:\n{tail}")
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop the engine through the API, then the server (TERM, then KILL)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            with SwarmClient(self.url, token=CONTROL_TOKEN, timeout=60) as c:
                c.stop_run(reason="benchmark finished")
        except Exception as exc:  # noqa: BLE001 (the server stops the engine itself on TERM)
            log.debug("stop_engine before shutdown failed: %s", exc)
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def wait_rolling_on(client: SwarmClient, snapshot_id: str | None, *, previous_run: str | None,
                    timeout: float = 300.0, poll_s: float = 0.02) -> EngineStatus:
    """Poll until the engine is ROLLING on `snapshot_id` in a run other than `previous_run`.

    Raises `RuntimeError` with the engine's last error if it falls back to OFFLINE.
    """
    deadline = time.monotonic() + timeout
    while True:
        status = client.engine_status()
        if (status.state == EngineState.ROLLING and status.run_id != previous_run
                and (snapshot_id is None or status.snapshot_id == snapshot_id)):
            return status
        if status.state == EngineState.OFFLINE and status.last_error is not None:
            err = status.last_error
            raise RuntimeError(f"engine went OFFLINE: {err.reason}\n" + "\n".join(err.log_tail))
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine still {status.state} after {timeout:.0f} s "
                               f"(waiting for ROLLING on {snapshot_id})")
        time.sleep(poll_s)
