"""The engine killed with SIGKILL while booting and while ROLLING (the fake engine: the
real command line, socket and process-group contract, without torch).

Each ends in OFFLINE with a reason naming the kill, the run closed as failed, the whole
process group gone, and a server that starts a new engine as if nothing happened.
The kill during the policy update needs the real engine: test_training_faults.py.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from ajet.protocol import EngineState
from tests.support import process_alive
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env, set_behaviour, started_pids
from tests.support.invariants import assert_consistent, wait_status

JOB = "experiment_name: faults\nlr: 0.01\n"


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    handle = server_factory(env=server_env(AJET_SWARM_STOP_GRACE_S="1"), process=True)
    assert handle.http.post("/sync_train_config", json={"yaml": JOB}).status_code == 200
    return handle


def start(srv: Server, **behaviour: object) -> tuple[str, int, int]:
    """Start an engine that spawns a child; returns (run id, engine pid, child pid)."""
    set_behaviour(srv.workdir, spawn_child=True, **behaviour)
    run_id = httpx.post(f"{srv.url}/start_engine", json={}, timeout=60).json()["run_id"]
    child_file = srv.workdir / "runs" / run_id / "child.pid"
    deadline = time.monotonic() + 60
    while not child_file.exists() or not child_file.read_text().strip():
        assert time.monotonic() < deadline, "the engine never started its child"
        time.sleep(0.02)
    engine = started_pids(srv.workdir)[-1]
    return run_id, engine, int(child_file.read_text())


def still_works(srv: Server) -> None:
    set_behaviour(srv.workdir)
    assert httpx.post(f"{srv.url}/start_engine", json={}, timeout=60).status_code == 200
    wait_status(srv.url, EngineState.ROLLING)
    assert httpx.post(f"{srv.url}/stop_engine", json={}, timeout=60).json()["stopped"]


def test_engine_sigkilled_while_booting(srv: Server) -> None:
    run_id, engine, child = start(srv, mode="hang")  # never opens its socket: BOOTING
    status = wait_status(srv.url, EngineState.BOOTING)
    assert status.run_id == run_id and status.pid == engine and process_alive(child)

    os.kill(engine, signal.SIGKILL)

    after = assert_consistent(srv.url, srv.workdir, engine_pids=[engine, child],
                              died="killed by SIGKILL")
    assert after.last_error is not None and after.last_error.run_id == run_id
    assert "ENGINE.BOOTING" in after.last_error.reason and after.last_error.exit_code == -9
    assert any("booting" in line for line in after.last_error.log_tail)
    still_works(srv)


def test_engine_sigkilled_while_rolling(srv: Server) -> None:
    run_id, engine, child = start(srv)
    wait_status(srv.url, EngineState.ROLLING)

    os.kill(engine, signal.SIGKILL)

    after = assert_consistent(srv.url, srv.workdir, engine_pids=[engine, child],
                              died="killed by SIGKILL")
    assert after.last_error is not None and after.last_error.run_id == run_id
    assert "ENGINE.ROLLING" in after.last_error.reason
    # the episode plane of the dead run answers 409 (not ROLLING), never 5xx
    r = httpx.post(f"{srv.url}/begin_episode", json={}, timeout=30)
    assert r.status_code == 409 and r.json()["hint"]
    still_works(srv)


def test_engine_that_exits_on_its_own_and_leaves_a_child(srv: Server) -> None:
    run_id, engine, child = start(srv, exit_after_s=1.0, exit_code=5)
    after = assert_consistent(srv.url, srv.workdir, engine_pids=[engine, child],
                              died="exited with code 5")
    assert after.last_error is not None and after.last_error.run_id == run_id
    still_works(srv)


def test_stop_of_a_term_ignoring_engine_kills_its_group(srv: Server) -> None:
    run_id, engine, child = start(srv, ignore_term=True)
    wait_status(srv.url, EngineState.ROLLING)
    stop = httpx.post(f"{srv.url}/stop_engine", json={"reason": "fault test"}, timeout=60)
    body = stop.json()
    assert {k: body[k] for k in ("stopped", "run_id", "state", "success")} == {
        "stopped": True, "run_id": run_id, "state": "ENGINE.OFFLINE", "success": True}
    assert body["last_checkpoint"] is None and body["waited_for"] == []
    assert_consistent(srv.url, srv.workdir, engine_pids=[engine, child])
    run = httpx.get(f"{srv.url}/runs/{run_id}").json()
    assert (run["status"], run["exit_code"]) == ("ended", -9)  # asked to stop: not a failure
