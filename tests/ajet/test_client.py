"""SwarmClient against the server: typed errors, waits with deadlines, auto start, runs.

The server runs in process (the client on its transport), the engine behind it is the
test fake (`tests/support/fake_engine.py`): the real client, server and engine lifecycle
without torch. Auto start and an unreachable server need real sockets and processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import (
    EngineStateConflict,
    SwarmAuthError,
    SwarmConnectionError,
    SwarmError,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmTimeout,
    SwarmValidationError,
)
from ajet.protocol import EngineState
from tests.support import (
    CONTROL_TOKEN,
    WORKER_TOKEN,
    free_port,
    process_alive,
)
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env, set_behaviour

S = EngineState


@pytest.fixture
def fake_server(server_factory: ServerFactory) -> Iterator[Server]:
    with server_factory.fresh(env=server_env()) as server:
        yield server


def test_compatibility_import_path() -> None:
    from ajet.tuner_lib.experimental.swarm_client import SwarmClient as Compat

    # the original's class is the typed client plus the original names; the typed one has
    # one name per action and none of the original's
    assert issubclass(Compat, SwarmClient) and Compat is not SwarmClient
    for name in ("get_engine_status", "begin_episode", "end_episode", "sync_train_config",
                 "start_engine", "stop_engine", "abort_episode", "client_uuid"):
        assert hasattr(Compat, name) or name == "client_uuid", name
        assert not hasattr(SwarmClient, name), name
    with Compat("http://127.0.0.1:9", False) as compat:
        assert compat.client_uuid and compat.verbose is False


def test_errors_are_typed_and_carry_detail_and_hint(fake_server: Server) -> None:
    with fake_server.client() as client:
        with pytest.raises(EngineStateConflict) as no_config:
            client.start_run()
        assert no_config.value.status == 409
        assert no_config.value.detail == "no training config on the server"
        assert "sync_train_config" in no_config.value.hint
        assert "POST /start_engine -> 409" in str(no_config.value)
        with pytest.raises(SwarmValidationError) as invalid:
            client.submit_config("lr: 2\n")
        assert invalid.value.detail[0]["loc"] == ["lr"]
        with pytest.raises(SwarmNotFound):
            client.get_metrics("no-such-run")
        with pytest.raises(SwarmValidationError) as bad_regex:
            client.get_run_logs("current", grep="(", regex=True)
        assert bad_regex.value.status == 400 and "regex" in bad_regex.value.hint


def test_auth_errors_and_token_from_the_environment(server_factory: ServerFactory,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    secured_server = server_factory(env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                                         "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN})
    monkeypatch.delenv("AJET_SWARM_TOKEN", raising=False)
    monkeypatch.delenv("AJET_SWARM_WORKER_TOKEN", raising=False)
    with secured_server.client() as anonymous:
        with pytest.raises(SwarmAuthError) as missing:
            anonymous.engine_status()
        assert missing.value.status == 401 and "AJET_SWARM_TOKEN" in missing.value.hint
    with secured_server.client(WORKER_TOKEN) as worker:
        assert worker.engine_status().state is S.OFFLINE  # read-only is allowed
        with pytest.raises(SwarmAuthError) as forbidden:
            worker.stop_run()
        assert forbidden.value.status == 403
    monkeypatch.setenv("AJET_SWARM_TOKEN", CONTROL_TOKEN)
    with secured_server.client() as control:
        assert control.stop_run().stopped is False
        assert control.get_audit().entries[-1].action == "stop_engine"


def test_unreachable_server_is_a_connection_error() -> None:
    with SwarmClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
        assert client.health() is False
        with pytest.raises(SwarmConnectionError, match="cannot reach"):
            client.engine_status()


def test_auto_sync_and_start_waits_until_rolling_and_respects_force_restart(
        fake_server: Server) -> None:
    with fake_server.client() as client:
        status = client.configure_and_start(
            AgentJetJob(experiment_name="auto-1"), wait_timeout=30)
        assert status.state is S.ROLLING and status.experiment_name == "auto-1"
        with pytest.raises(EngineStateConflict) as busy:
            client.configure_and_start(AgentJetJob(experiment_name="auto-2"))
        assert "force_restart=True" in busy.value.hint
        assert client.engine_status().run_id == status.run_id  # nothing changed
        again = client.configure_and_start(
            AgentJetJob(experiment_name="auto-2"), force_restart=True, wait_timeout=30)
        assert again.state is S.ROLLING and again.run_id != status.run_id
        assert again.experiment_name == "auto-2"
        assert client.get_run(status.run_id or "").status == "ended"
        assert client.stop_run().stopped


def test_wait_raises_with_the_engines_error_when_boot_fails(fake_server: Server) -> None:
    set_behaviour(fake_server.workdir, mode="crash_at_boot", exit_code=5)
    with fake_server.client() as client:
        client.submit_config(AgentJetJob())
        with pytest.raises(SwarmError) as exc:
            client.start_run(wait=True, wait_timeout=30)
        assert not isinstance(exc.value, SwarmHTTPError)
        assert "exited with code 5" in str(exc.value)
        assert "fake boot failure" in str(exc.value)


def test_wait_for_state_has_a_deadline(fake_server: Server) -> None:
    with fake_server.client() as client:
        with pytest.raises(SwarmTimeout, match="ENGINE.ROLLING"):
            client.wait_for_state(S.ROLLING, timeout=0.2)


def test_auto_start_swarm_server_starts_a_local_server_and_close_stops_it(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = SwarmClient(url, auto_start_swarm_server=True, swarm_workdir=tmp_path / "auto",
                         server_env=server_env())
    try:
        pid = client.started_server_pid
        assert pid is not None and process_alive(pid)
        assert client.engine_status().state is S.OFFLINE
        assert (tmp_path / "auto" / "swarm.sqlite3").exists()
        # a second client finds the running server and starts nothing
        with SwarmClient(url, auto_start_swarm_server=True) as second:
            assert second.started_server_pid is None
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(pid)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_auto_start_refuses_a_url_it_cannot_start_locally() -> None:
    with pytest.raises(SwarmConnectionError, match="localhost URL with a port"):
        SwarmClient("http://127.0.0.1", auto_start_swarm_server=True)
