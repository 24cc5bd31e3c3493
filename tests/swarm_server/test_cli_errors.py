"""`ajet-swarm` errors a new user meets, each with the next step: a busy port, a missing
server extra, a stale pid file (never signalled), a laptop-only auto-start."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ajet.client import SwarmClient
from ajet.errors import SwarmConnectionError
from tests.support import free_port


def _cli(*args: str, code: str = "") -> subprocess.CompletedProcess[str]:
    program = f"{code}\nimport sys\nfrom swarm_server.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True,
                          text=True, timeout=60)


def test_a_busy_port_says_so_and_names_the_next_step(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = _cli("start", f"--swarm-port={port}", "--workdir", str(tmp_path))
    assert started.returncode == 2, started.stderr
    assert "already in use" in started.stderr and "--swarm-port" in started.stderr
    assert "ajet-swarm status" in started.stderr


def test_a_missing_server_extra_names_the_extra(tmp_path: Path) -> None:
    started = _cli("start", "--workdir", str(tmp_path),
                   code="import sys; sys.modules['pydantic_settings'] = None")
    assert started.returncode == 2
    assert "pydantic_settings" in started.stderr and "agentjet-swarm[server]" in started.stderr


def test_stop_with_a_stale_pid_file_signals_nothing(tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "swarm_server.pid").write_text(json.dumps({"pid": bystander.pid,
                                                               "started": time.time()}))
        stopped = _cli("stop", "--workdir", str(tmp_path),
                       "--swarm-url", f"http://127.0.0.1:{free_port()}")
        assert stopped.returncode == 1
        assert "stale" in stopped.stderr and "Nothing was signalled" in stopped.stderr
        assert bystander.poll() is None, "stop killed a process that is not the server"
        assert not (tmp_path / "swarm_server.pid").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_auto_start_on_a_laptop_only_install_names_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pydantic_settings", None)
    with pytest.raises(SwarmConnectionError, match=r"agentjet-swarm\[server\]"):
        SwarmClient(f"http://127.0.0.1:{free_port()}", auto_start_swarm_server=True,
                    swarm_workdir=tmp_path)


def test_the_ray_launcher_without_ray_names_the_extra_and_the_local_one_needs_none(
        tmp_path: Path) -> None:
    no_ray = "import sys; sys.modules['ray'] = None"
    started = _cli("start", "--workdir", str(tmp_path / "ray"), "--launcher", "ray", code=no_ray)
    assert started.returncode == 2, started.stderr
    assert "--launcher ray needs Ray" in started.stderr
    assert "agentjet-swarm[ray]" in started.stderr
    # the default launcher is the local one, and it runs without the extra
    local = subprocess.run(
        [sys.executable, "-c", f"{no_ray}\nfrom swarm_server.main import create_app\n"
         "from swarm_server.settings import Settings\n"
         "app = create_app(Settings(workdir=sys.argv[1], warm_standby=False))\n"
         "print(app.state.ctx.settings.launcher)", str(tmp_path / "local")],
        capture_output=True, text=True, timeout=60)
    assert local.returncode == 0, local.stderr
    assert local.stdout.split()[-1] == "local"


def test_an_unreachable_ray_cluster_is_named_at_start(tmp_path: Path) -> None:
    address = f"http://127.0.0.1:{free_port()}"
    started = _cli("start", "--workdir", str(tmp_path), "--launcher", "ray",
                   "--ray-address", address)
    assert started.returncode == 2, started.stderr
    assert f"cannot reach the Ray cluster's Jobs API at {address}" in started.stderr
    assert "--ray-address" in started.stderr
