"""Two real tiny runs at once, on two snapshots and two device slots, both training.

One server (`--devices 2`), two snapshots of `ajet/` that differ by a line, one run of
`POST /runs` on each: both reach ROLLING, episodes go to each through its own keys (a
chat with each key is answered by its own engine), and both take a training step from
the rewards sent to them. The server, engines and snapshots are all real.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, make_ajet_repo
from tests.support.factory import ServerFactory

pytestmark = pytest.mark.slow

JOB = AgentJetJob(experiment_name="side-by-side", model="ajet-tiny", n_gpu=0, batch_size=1,
                  num_repeat=2, max_new_tokens=4).to_yaml()


def _status(http: httpx.Client, run: str) -> dict[str, Any]:
    answer = http.get(f"/runs/{run}/status")
    assert answer.status_code == 200, answer.text
    return answer.json()


def _until(predicate: Any, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_two_tiny_runs_train_at_once_each_on_its_own_snapshot_and_keys(
        server_factory: ServerFactory, tmp_path: Path) -> None:
    srv = server_factory(env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                              "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN,
                              "AJET_SWARM_DEVICES": "2"})
    repo = make_ajet_repo(tmp_path / "repo")
    snapshot_ids = []
    with srv.client(CONTROL_TOKEN) as client:
        for n in (1, 2):
            rewards = repo / "ajet" / "engine" / "rewards.py"
            rewards.write_text(rewards.read_text() + f"\nVARIANT = {n}\n")
            snapshot_ids.append(client.push_code(repo).snapshot_id)
    with srv.http_as(CONTROL_TOKEN) as control, srv.http_as(WORKER_TOKEN) as worker:
        runs = [control.post("/runs", json={"snapshot_id": sid, "yaml": JOB,
                                            "name": f"variant-{n}"}).json()
                for n, sid in enumerate(snapshot_ids, start=1)]
        assert [r["status"] for r in runs] == ["booting", "booting"], runs
        try:
            for run in runs:
                _until(lambda: _status(control, run["run_id"])["state"] in (
                    EngineState.ROLLING.value, EngineState.ROLLING_POST.value),
                    f"run {run['name']} to serve")
            for run, sid in zip(runs, snapshot_ids):
                assert _status(control, run["run_id"])["snapshot_id"] == sid
            for run in runs:  # a batch of 2 episodes each, through each run's own keys
                for reward in (0.0, 1.0):
                    episode = worker.post("/begin_episode",
                                          json={"run_id": run["name"], "task_id": "t"}).json()
                    assert episode["run_id"] == run["run_id"]
                    with srv.http_as(episode["openai_api_key"]) as chat:
                        reply = chat.post("/v1/chat/completions", json={
                            "model": "ajet-tiny", "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]})
                        assert reply.status_code == 200, reply.text
                    ended = worker.post("/end_episode", json={
                        "episode_uuid": episode["episode_uuid"], "task_id": "t",
                        "reward": reward})
                    assert ended.status_code == 200, ended.text
            for run in runs:
                _until(lambda: (_status(control, run["run_id"])["step"] or 0) >= 1,
                       f"run {run['name']} to train a step")
            active = control.get("/runs", params={"state": "active"}).json()
            assert sorted(d for r in active["runs"] for d in r["devices"]) == [0, 1]
        finally:
            for run in runs:
                control.post(f"/runs/{run['run_id']}/stop", json={"reason": "test done"})
