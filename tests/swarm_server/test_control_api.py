"""Control API against the server app in process, with a real (fake) engine subprocess.

The engine is `tests/support/fake_engine.py`: the real command line and socket
contract without torch. Covers the lifecycle, concurrency, crashes, stop of the whole
process group, auth on every route in the OpenAPI schema, the audit log and the CLI
(the CLI's tests run a real server process: stopping it is the point).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import ajet
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState, EngineStatus
from tests.support import (
    CONTROL_TOKEN,
    PROJECT_ROOT,
    WORKER_TOKEN,
    free_port,
    process_alive,
    wait_gone,
    wait_status,
)
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env, set_behaviour, started_pids

S = EngineState
JOB = "experiment_name: ctl-test\nlr: 0.01\n"


@pytest.fixture
def srv(server_factory: ServerFactory) -> Iterator[Server]:
    with server_factory.fresh(env=server_env()) as server:  # a clean server per test
        yield server


def configure_and_start(http: httpx.Client) -> EngineStatus:
    assert http.post("/sync_train_config", json={"yaml": JOB}).status_code == 200
    assert http.post("/start_engine", json={}).status_code == 200
    return wait_status(http, S.ROLLING)


# ---------------------------------------------------------------------------- lifecycle


def test_health_version_and_initial_status(srv: Server) -> None:
    assert srv.http.get("/health").json() == {"ok": True}
    version = srv.http.get("/version").json()
    assert version["api"] == 1 and version["ajet_file"].endswith("ajet/__init__.py")
    status = srv.http.get("/get_engine_status").json()
    assert status["state"] == "ENGINE.OFFLINE" and status["has_config"] is False


def test_lifecycle_and_stop_leaves_no_process_of_the_group(srv: Server) -> None:
    set_behaviour(srv.workdir, spawn_child=True)
    status = configure_and_start(srv.http)
    assert status.experiment_name == "ctl-test" and status.ajet_file
    assert status.pid is not None and status.run_id is not None
    child = int((srv.workdir / "runs" / status.run_id / "child.pid").read_text())
    assert process_alive(status.pid) and process_alive(child)

    again = srv.http.post("/start_engine", json={})
    assert again.status_code == 409
    assert "ENGINE.ROLLING" in again.json()["detail"] and "stop_engine" in again.json()["hint"]
    config = srv.http.post("/sync_train_config", json={"yaml": JOB})
    assert config.status_code == 409 and "stop_engine" in config.json()["hint"]

    stop = srv.http.post("/stop_engine", json={"reason": "test done"}, timeout=60)
    assert stop.json() == {"stopped": True, "run_id": status.run_id, "state": "ENGINE.OFFLINE",
                           "success": True, "waited_for": [], "last_checkpoint": None,
                           "message": f"stopped run {status.run_id}; no complete checkpoint"}
    assert not process_alive(status.pid) and not process_alive(child)
    run = srv.http.get(f"/runs/{status.run_id}").json()
    assert (run["status"], run["reason"], run["exit_code"]) == ("ended", "test done", 0)
    again_stop = srv.http.post("/stop_engine", timeout=60).json()
    assert again_stop["stopped"] is False


def test_twenty_concurrent_starts_launch_exactly_one_engine(srv: Server) -> None:
    assert srv.http.post("/sync_train_config", json={"yaml": JOB}).status_code == 200
    barrier = threading.Barrier(20)
    codes: list[int] = []

    def start() -> None:
        barrier.wait()
        codes.append(srv.http.post("/start_engine", json={}, timeout=60).status_code)

    threads = [threading.Thread(target=start) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] + [409] * 19
    wait_status(srv.http, S.ROLLING)
    assert len(started_pids(srv.workdir)) == 1
    assert srv.http.get("/runs").json()["total"] == 1


def test_crash_at_boot_returns_to_offline_with_exit_code_and_log_tail(srv: Server) -> None:
    set_behaviour(srv.workdir, mode="crash_at_boot", exit_code=3)
    assert srv.http.post("/sync_train_config", json={"yaml": JOB}).status_code == 200
    assert srv.http.post("/start_engine", json={}).status_code == 200
    status = wait_status(srv.http, S.OFFLINE)
    run = srv.http.get("/runs/current").json()
    assert status.last_error is not None
    assert status.last_error.run_id == run["run_id"]
    assert status.last_error.exit_code == 3
    assert "RuntimeError: fake boot failure" in status.last_error.log_tail
    assert (run["status"], run["exit_code"]) == ("failed", 3)


def test_sigkill_while_rolling_returns_to_offline_and_reaps_the_group(srv: Server) -> None:
    set_behaviour(srv.workdir, spawn_child=True)
    status = configure_and_start(srv.http)
    assert status.pid is not None and status.run_id is not None
    child = int((srv.workdir / "runs" / status.run_id / "child.pid").read_text())
    os.kill(status.pid, 9)
    after = wait_status(srv.http, S.OFFLINE)
    assert after.last_error is not None and after.last_error.exit_code == -9
    assert "SIGKILL" in after.last_error.reason
    assert any("booting" in line for line in after.last_error.log_tail)
    assert wait_gone(child)  # the crashed leader's group is cleared too


def test_hung_boot_times_out_and_a_term_ignoring_engine_is_killed(
        server_factory: ServerFactory) -> None:
    # 3 s: on a loaded machine the fake engine may need more than 1 s to ignore SIGTERM
    with server_factory.fresh(env=server_env(AJET_SWARM_BOOT_TIMEOUT_S="3",
                                             AJET_SWARM_STOP_GRACE_S="0.5")) as handle:
        set_behaviour(handle.workdir, mode="hang", ignore_term=True)
        assert handle.http.post("/sync_train_config", json={"yaml": JOB}).status_code == 200
        handle.http.post("/start_engine", json={})
        status = wait_status(handle.http, S.OFFLINE)
        assert status.last_error is not None and "boot timeout" in status.last_error.reason
        assert status.last_error.exit_code == -9  # SIGTERM ignored, so SIGKILL after grace
        (pid,) = started_pids(handle.workdir)
        assert not process_alive(pid)


def test_engine_and_config_check_run_the_synced_snapshot(srv: Server, ajet_repo: Path
                                                         ) -> None:
    # A researcher widens lr's bound in the job schema; only the synced validator knows it.
    job_py = ajet_repo / "ajet" / "copilot" / "job.py"
    original = job_py.read_text()
    patched = original.replace('_d("lr"), gt=0, le=1.0,', '_d("lr"), gt=0, le=10.0,')
    assert patched != original, "ajet/copilot/job.py changed shape; update this test"
    job_py.write_text(patched)
    assert srv.http.post("/sync_train_config",
                      json={"yaml": "lr: 5\n"}).status_code == 422  # the server's own code
    with srv.client() as client:
        synced = client.push_code(ajet_repo)
        assert client.submit_config("experiment_name: snap\nlr: 5\n").config["lr"] == 5.0
        status = client.start_run(wait=True, wait_timeout=30)
        base = (srv.workdir / synced.path).parent.resolve()
        assert status.snapshot_id == synced.snapshot_id
        assert Path(status.ajet_file or "").resolve().is_relative_to(base)
        line = f"[start_engine] Using synced training code from ./{synced.path}"
        assert client.get_run_logs(tail=1000).lines[0] == line
        assert line in srv.log()
        assert client.get_run("current").snapshot_id == synced.snapshot_id
        assert client.stop_run().stopped

        # an engine that imports some other ajet is refused, however healthy it looks
        set_behaviour(srv.workdir, report_ajet_file=ajet.__file__)
        client.start_run()
        failed = wait_status(srv.http, S.OFFLINE)
        assert failed.last_error is not None
        assert "not from the active snapshot" in failed.last_error.reason
        assert client.get_run("current").status == "failed"


# ---------------------------------------------------------------------------- auth


def _routes(http: httpx.Client) -> list[tuple[str, str]]:
    schema = http.get("/openapi.json", headers=_auth(CONTROL_TOKEN)).json()
    out = []
    for path, ops in schema["paths"].items():
        for method in ops:
            concrete = path
            while "{" in concrete:
                start, end = concrete.index("{"), concrete.index("}")
                concrete = concrete[:start] + "0" * 64 + concrete[end + 1:]
            out.append((method.upper(), concrete))
    return out


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


#: Routes only the control token may call (the worker token gets 403).
CONTROL_ROUTES = {("POST", "/sync_train_config"), ("POST", "/start_engine"),
                  ("POST", "/stop_engine"), ("GET", "/audit")}
#: Reader routes the worker token may call.
READER_ROUTES = {("GET", "/version"), ("GET", "/get_engine_status"), ("GET", "/runs")}


def test_every_route_but_health_refuses_missing_and_wrong_tokens(
        server_factory: ServerFactory) -> None:
    http = server_factory(env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                               "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN}).http
    routes = _routes(http)
    assert CONTROL_ROUTES | READER_ROUTES | {("GET", "/health")} <= set(routes)
    for method, path in routes:
        for headers in ({}, _auth("wrong-token"), {"Authorization": "Basic abc"}):
            r = http.request(method, path, headers=headers)
            if path == "/health":
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json()["hint"]
        if path.startswith("/v1/"):
            continue  # the episode plane's chat route takes episode keys, not tokens
        worker = http.request(method, path, headers=_auth(WORKER_TOKEN))
        assert worker.status_code != 401 and worker.status_code < 500, (method, path)
        if (method, path) in CONTROL_ROUTES:
            assert worker.status_code == 403, (method, path)
            assert "control token" in worker.json()["detail"]
        if (method, path) in READER_ROUTES:
            assert worker.status_code == 200, (method, path)


def test_audit_has_each_control_action_once_and_refuses_the_worker(
        server_factory: ServerFactory) -> None:
    env = server_env(AJET_SWARM_TOKEN=CONTROL_TOKEN, AJET_SWARM_WORKER_TOKEN=WORKER_TOKEN)
    with server_factory.fresh(env=env) as handle:
        ctl = _auth(CONTROL_TOKEN)
        with handle.http_as(CONTROL_TOKEN) as http:
            assert http.post("/start_engine", json={}).status_code == 409          # no config
            assert http.post("/sync_train_config", json={"yaml": "lr: 9\n"}).status_code == 422
            assert http.post("/sync_train_config", json={"yaml": JOB}).status_code == 200
            run_id = http.post("/start_engine", json={}).json()["run_id"]
            wait_status(handle.http, S.ROLLING, headers=ctl)
            assert http.post("/stop_engine", json={"reason": "r1"}).json()["stopped"] is True
            assert http.post("/sync_train_config", json={"yaml": JOB},
                             headers=_auth(WORKER_TOKEN)).status_code == 403
            entries = http.get("/audit").json()["entries"]
        summary = [(e["action"], e["role"], e["outcome"].split(":")[0]) for e in entries]
        assert summary == [
            ("start_engine", "control", "refused"),
            ("sync_config", "control", "refused"),
            ("sync_config", "control", "ok"),
            ("start_engine", "control", "ok"),
            ("stop_engine", "control", "ok"),
        ]
        assert entries[3]["detail"]["run_id"] == run_id
        assert "lr" in entries[1]["outcome"]
        worker = handle.http.get("/audit", headers=_auth(WORKER_TOKEN))
        assert worker.status_code == 403


# ---------------------------------------------------------------------------- CLI


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "ajet-swarm"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "swarm_server"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})}, cwd=cwd or PROJECT_ROOT)


def test_cli_refuses_a_public_bind_without_a_control_token(tmp_path: Path) -> None:
    refused = _cli("start", f"--swarm-port={free_port()}", "--host", "0.0.0.0",
                   "--workdir", str(tmp_path))
    assert refused.returncode == 2
    assert "AJET_SWARM_TOKEN" in refused.stderr
    assert not (tmp_path / "swarm_server.pid").exists()


def test_cli_status_and_stop_talk_to_a_running_server(server_factory: ServerFactory) -> None:
    with server_factory.fresh(env=server_env(), process=True) as srv:
        configure_and_start(srv.http)
        status = _cli("status", "--swarm-url", srv.url)
        assert status.returncode == 0
        assert EngineStatus.model_validate_json(status.stdout).state is S.ROLLING
        (engine_pid,) = started_pids(srv.workdir)
        stop = _cli("stop", "--swarm-url", srv.url, "--workdir", str(srv.workdir))
        assert stop.returncode == 0, stop.stderr
        assert "engine stopped: True" in stop.stderr
        # uvicorn shuts down gracefully (lifespan: engine stopped), then re-raises SIGTERM
        assert srv.proc.wait(timeout=30) in (0, -15)
        assert "Application shutdown complete" in srv.log()
        assert not process_alive(engine_pid)
        with pytest.raises(httpx.HTTPError):
            srv.http.get("/health", timeout=2)
        unreachable = _cli("status", "--swarm-url", srv.url)
        assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr


def test_stored_config_reads_back(server_factory: ServerFactory) -> None:
    server = server_factory()
    with server.client() as client:
        assert client.get_train_config() is None
        sent = client.submit_config(AgentJetJob(experiment_name="read_back", batch_size=3))
        stored = client.get_train_config()
    assert stored is not None
    assert stored.config_hash == sent.config_hash
    assert stored.config["batch_size"] == 3 and stored.experiment_name == "read_back"
