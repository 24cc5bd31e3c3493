"""Recovery: a server killed with SIGKILL and started again reconciles ledger and reality.

The old engine (and its whole process group) is stopped by recorded pid and start time,
its run is closed with a reason and stays readable, the config is restored, and a
recycled pid of an unrelated process is never signalled.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import SERVER_CODE, EngineState
from swarm_server.ledger import Ledger, RunRecord
from tests.support import process_alive, start_server
from tests.support.fake_engine import server_env, set_behaviour

METRICS = [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}]


def test_sigkilled_server_restart_stops_the_orphan_engine_and_keeps_the_run(
        tmp_path: Path, ajet_repo: Path) -> None:
    workdir = tmp_path / "swarm"
    set_behaviour(workdir, spawn_child=True, metrics=METRICS)
    first = start_server(workdir, env=server_env())
    try:
        with SwarmClient(first.url) as client:
            snapshot = client.push_code(ajet_repo).snapshot_id
            accepted = client.submit_config(AgentJetJob(experiment_name="survivor", lr=0.02))
            status = client.start_run(wait=True, wait_timeout=30)
    finally:
        first.kill(signal.SIGKILL)
    assert status.pid is not None and status.run_id is not None
    run_id, engine_pid = status.run_id, status.pid
    child_pid = int((workdir / "runs" / run_id / "child.pid").read_text())
    assert process_alive(engine_pid) and process_alive(child_pid)  # orphaned, still running

    second = start_server(workdir, env=server_env())
    try:
        assert not process_alive(engine_pid) and not process_alive(child_pid)
        with SwarmClient(second.url) as client:
            run = client.get_run(run_id)
            assert run.status == "ended" and "server restarted" in (run.reason or "")
            assert run.last_step == 2 and run.summary["reward_mean"]["best"] == 0.5
            assert [p["step"] for p in client.get_metrics(run_id).points] == [1, 2]
            assert any("booting" in line for line in client.get_run_logs(run_id).lines)

            after = client.engine_status()
            assert after.state is EngineState.OFFLINE and after.has_config
            assert after.experiment_name == "survivor" and after.snapshot_id == snapshot
            audit = [e for e in client.get_audit().entries if e.action == "recover"]
            assert len(audit) == 1 and audit[0].detail["run_id"] == run_id

            set_behaviour(workdir)
            new = client.start_run(wait=True, wait_timeout=30)  # the restored config
            assert new.run_id != run_id and new.experiment_name == "survivor"
            assert new.snapshot_id == snapshot
            assert client.get_run(new.run_id or "").config_hash == accepted.config_hash
            assert client.stop_run().stopped
    finally:
        second.stop()


def test_restart_never_signals_a_recycled_pid_and_fails_vanished_runs(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    workdir.mkdir(parents=True)
    # An unrelated process in its own group: its pid is "recorded" with a wrong start time,
    # as if the old engine died and the pid was reused.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 start_new_session=True)
    try:
        start_time = psutil.Process(bystander.pid).create_time()
        ledger = Ledger(workdir / "swarm.sqlite3")
        for run_id, pid, started in (("r-recycled", bystander.pid, start_time - 100.0),
                                     ("r-gone", 2 ** 22 - 7, time.time() - 50)):
            ledger.create_run(RunRecord(
                id=run_id, snapshot_id=SERVER_CODE, config_yaml="experiment_name: old\n",
                config_hash="0" * 64, experiment_name="old", started_by="control",
                started_at=time.time(), run_dir=str(workdir / "runs" / run_id),
                status="running", pid=pid, pid_start_time=started))
        ledger.close()

        server = start_server(workdir, env=server_env())
        try:
            assert process_alive(bystander.pid)
            for run_id in ("r-recycled", "r-gone"):
                run = httpx.get(f"{server.url}/runs/{run_id}").json()
                assert run["status"] == "failed", run
                assert "already gone" in run["reason"]
        finally:
            server.stop()
        assert process_alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
