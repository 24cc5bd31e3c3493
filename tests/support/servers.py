"""Real swarm server subprocesses on free loopback ports, real git repos in temp dirs.

`start_server` runs `python -m swarm_server start` and stops it (its whole process group)
when the test is done with it: for tests about the process (the command line, signals,
crashes, real sockets and their limits, clients in other processes). Tests that only call
routes use the app in process (`tests.support.app`); both handles offer `http` (an
`httpx.Client` on the server) and `client(token)` (a `SwarmClient`), so a test reads the
same on either. Tests get both through the `server_factory` fixture (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState, EngineStatus

PROJECT_ROOT = Path(__file__).resolve().parents[2]

CONTROL_TOKEN = "test-control-token"
WORKER_TOKEN = "test-worker-token"
APPROVER_NAME = "alice"
APPROVER_TOKEN = "test-approver-token"
#: Server environment that enforces approvals: control, worker and one approver token.
ENFORCING_ENV = {"AJET_SWARM_TOKEN": CONTROL_TOKEN, "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN,
                 "AJET_SWARM_APPROVER_TOKENS": f"{APPROVER_NAME}={APPROVER_TOKEN}"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerHandle:
    url: str
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    _http: httpx.Client | None = field(default=None, repr=False)

    @property
    def http(self) -> httpx.Client:
        """An `httpx.Client` on this server (relative paths: `srv.http.get("/health")`)."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=60.0)
        return self._http

    def http_as(self, token: str | None) -> httpx.Client:
        """A new `httpx.Client` on this server that sends `token` as its bearer token
        (None: no token; each request may send its own)."""
        return httpx.Client(base_url=self.url, timeout=60.0,
                            headers={"Authorization": f"Bearer {token}"} if token else {})

    def client(self, token: str | None = None, **kwargs: Any) -> SwarmClient:
        """A `SwarmClient` on this server; `token` as SwarmClient takes it (None: from the
        environment, as `SwarmClient(url)` would)."""
        return SwarmClient(self.url, token=token, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server process only (not the engine it spawned)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(workdir: Path, *, env: Mapping[str, str] | None = None, port: int | None = None,
                 host: str = "127.0.0.1", timeout: float = 30.0,
                 args: Sequence[str] = ()) -> ServerHandle:
    """Start a real swarm server subprocess and wait until /health answers (`args`: more
    flags of `ajet-swarm start`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    child_env = {k: v for k, v in os.environ.items()
                 if not k.startswith("AJET_SWARM_")}
    # A warm standby costs each server ~4 s of CPU (importing torch) and ~350 MB; tests
    # that want one pass AJET_SWARM_WARM_STANDBY=1 (tests/swarm_server/test_standby.py).
    child_env["AJET_SWARM_WARM_STANDBY"] = "0"
    child_env.update(env or {})
    log_path = workdir / f"server-{port}.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm_server", "start", f"--swarm-port={port}",
             "--host", host, "--workdir", str(workdir), *args],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env,
            cwd=workdir,
        )
    handle = ServerHandle(f"http://127.0.0.1:{port}", port, workdir, proc, log_path,
                          dict(env or {}))
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=handle.url, timeout=1.0) as probe:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"swarm server exited ({proc.returncode}):\n{handle.log()}")
            try:
                if probe.get("/health").status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    handle.stop()
    raise RuntimeError(f"swarm server not healthy after {timeout}s:\n{handle.log()}")


@contextmanager
def rolling_server(workdir: Path, job: AgentJetJob, *, env: Mapping[str, str] | None = None,
                   wait_timeout: float = 180.0) -> Iterator[ServerHandle]:
    """A token-protected server whose real engine runs `job` and serves episodes."""
    handle = start_server(workdir, env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                                        "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN, **(env or {})})
    try:
        with SwarmClient(handle.url, token=CONTROL_TOKEN) as control:
            control.configure_and_start(job, wait_timeout=wait_timeout)
        yield handle
    finally:
        handle.stop()


def make_ajet_repo(root: Path, *, source: Path = PROJECT_ROOT / "ajet") -> Path:
    """A real git repository at `root` holding a committed copy of the project's `ajet/`."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, root / "ajet",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=test"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(root)], check=True)
    subprocess.run([*git, "-C", str(root), "add", "ajet"], check=True)
    subprocess.run([*git, "-C", str(root), "commit", "-q", "-m", "initial"], check=True)
    return root


def wait_status(server: str | httpx.Client, *states: EngineState,
                headers: dict[str, str] | None = None, timeout: float = 60.0) -> EngineStatus:
    """Poll `GET /get_engine_status` until the engine is in one of `states`.

    `server` is a base URL or an `httpx.Client` on the server (a handle's `http`).
    """
    if isinstance(server, str):
        with httpx.Client(base_url=server, timeout=30) as http:
            return wait_status(http, *states, headers=headers, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        answer = server.get("/get_engine_status", headers=headers)
        status = EngineStatus.model_validate(answer.json())
        if status.state in states:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still {status.state}, wanted {states}")
        time.sleep(0.02)


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    """True once process `pid` has exited (within `timeout`)."""
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
