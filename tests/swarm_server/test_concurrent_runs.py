"""Concurrent runs over the HTTP API: several runs at once, each on its own snapshot, job
and device slots, with the stand-in engine (`tests.support.fake_engine`).

Two runs on two snapshots both serve, each with its own slot in its environment; a third
waits in the queue (position and reason shown) and starts when one stops; an episode key
reaches only its own run's engine (a worker of run A trying run B's episode, a key re-signed
for run B, or an end naming run B gets nowhere), and dies with that run while the other
goes on;
a queued run waits again after a server restart; revoking a snapshot stops only the runs
on it; a run that crashes goes OFFLINE on its own
with its own `last_error` (log tail included) while the others go on; the original client
drives the default run beside a run of `POST /runs`; refusals (never fits, name taken, busy without
queueing) name the next call and record nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import ApprovalPending
from ajet.protocol import EngineState
from tests.support import (
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
    WORKER_TOKEN,
    make_ajet_repo,
)
from tests.support.app import app_server
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env, set_behaviour
from tests.support.harness import wait_until

ROLLING = EngineState.ROLLING.value
JOB = AgentJetJob(experiment_name="sweep").to_yaml()


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    return server_factory(env=server_env(**ENFORCING_ENV, AJET_SWARM_DEVICES="2"))


@pytest.fixture(scope="module")
def snapshots(srv: Server, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two approved snapshots (two edits of one repository)."""
    repo = make_ajet_repo(tmp_path_factory.mktemp("repo") / "repo")
    ids = []
    with srv.client(CONTROL_TOKEN) as control, srv.client(APPROVER_TOKEN) as approver:
        for n in (1, 2):
            rewards = repo / "ajet" / "engine" / "rewards.py"
            rewards.write_text(rewards.read_text() + f"\nVARIANT = {n}\n")
            with pytest.raises(ApprovalPending) as pending:
                control.push_code(repo)
            approver.decide_approval(pending.value.snapshot_id, "approve")
            ids.append(pending.value.snapshot_id)
    return ids


@pytest.fixture
def control(srv: Server) -> Iterator[httpx.Client]:
    with srv.http_as(CONTROL_TOKEN) as http:
        yield http
        for run in http.get("/runs", params={"state": "active"}).json()["runs"]:
            http.post(f"/runs/{run['run_id']}/stop", json={"reason": "test teardown"})
        http.post("/stop_engine", json={"reason": "test teardown"})


def _start(http: httpx.Client, snapshot_id: str, name: str, **extra: Any) -> dict[str, Any]:
    answer = http.post("/runs", json={"snapshot_id": snapshot_id, "yaml": JOB, "name": name,
                                      **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _status(http: httpx.Client, run: str) -> dict[str, Any]:
    answer = http.get(f"/runs/{run}/status")
    assert answer.status_code == 200, answer.text
    return answer.json()


def _wait_state(http: httpx.Client, run: str, state: str, timeout: float = 60.0) -> None:
    wait_until(lambda: _status(http, run)["state"] == state, timeout=timeout)


def _begin(http: httpx.Client, run: str | None) -> dict[str, Any]:
    answer = http.post("/begin_episode", json={"run_id": run} if run else {})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _chat(srv: Server, key: str) -> httpx.Response:
    with srv.http_as(key) as http:
        return http.post("/v1/chat/completions",
                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_two_runs_on_two_snapshots_serve_side_by_side_and_a_third_waits_its_turn(
        srv: Server, snapshots: list[str], control: httpx.Client) -> None:
    a = _start(control, snapshots[0], "lr-low")
    b = _start(control, snapshots[1], "lr-high")
    assert a["status"] == "booting" and b["status"] == "booting"
    assert sorted(a["devices"] + b["devices"]) == [0, 1]  # disjoint slots
    _wait_state(control, "lr-low", ROLLING)
    _wait_state(control, "lr-high", ROLLING)
    assert _status(control, a["run_id"])["snapshot_id"] == snapshots[0]
    assert _status(control, "lr-high")["snapshot_id"] == snapshots[1]
    # each engine was given its own slot
    for run in (a, b):
        log = control.get(f"/runs/{run['run_id']}/logs", params={"tail": 50}).json()
        text = "\n".join(line if isinstance(line, str) else str(line) for line in log["lines"])
        assert f"AJET_ENGINE_DEVICE_SLOTS={run['devices'][0]}" in text

    c = _start(control, snapshots[0], "lr-mid")
    assert c["status"] == "queued" and c["queue_position"] == 1
    assert "needs 1 device slot" in c["queue_reason"] and "0 of 2 free" in c["queue_reason"]
    listed = control.get("/runs", params={"state": "active"}).json()
    assert {r["name"] for r in listed["runs"]} == {"lr-low", "lr-high", "lr-mid"}
    assert listed["devices"]["total"] == 2 and listed["devices"]["free"] == []
    assert listed["devices"]["queued"] == [c["run_id"]]
    assert set(listed["devices"]["held"]) == {a["run_id"], b["run_id"]}

    # the console shows the operator the same: each run, its devices, the queue
    with srv.http_as(None) as browser:
        assert browser.post("/ui/login", data={"token": APPROVER_TOKEN}).status_code in (
            200, 303)
        page = browser.get("/ui/runs").text
    table = page[page.index('id="active-runs"'):page.index("</table>", page.index(
        'id="active-runs"'))]
    for name in ("lr-low", "lr-high", "lr-mid"):
        assert name in table
    assert "0 of 2 free" in page and "#1: needs 1 device slot" in table

    stopped = control.post("/runs/lr-low/stop", json={"reason": "a loser"}).json()
    assert stopped["stopped"] and stopped["run_id"] == a["run_id"]
    _wait_state(control, "lr-mid", ROLLING)  # the queued run took the freed slot
    mid = control.get(f"/runs/{c['run_id']}").json()
    assert mid["devices"] == a["devices"] and mid["queue_position"] is None
    assert _status(control, "lr-high")["state"] == ROLLING  # the other run went on
    ended = control.get(f"/runs/{a['run_id']}").json()
    assert ended["status"] == "ended" and ended["reason"] == "a loser"


def test_an_episode_key_reaches_only_its_own_run(
        srv: Server, snapshots: list[str], control: httpx.Client) -> None:
    a = _start(control, snapshots[0], "key-a")
    b = _start(control, snapshots[1], "key-b")
    _wait_state(control, "key-a", ROLLING)
    _wait_state(control, "key-b", ROLLING)
    with srv.http_as(WORKER_TOKEN) as worker:
        episode_a, episode_b = _begin(worker, "key-a"), _begin(worker, b["run_id"])
    assert episode_a["run_id"] == a["run_id"] and episode_b["run_id"] == b["run_id"]
    for episode, run in ((episode_a, a), (episode_b, b)):
        reply = _chat(srv, episode["openai_api_key"])
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == f"run {run['run_id']}"

    # a worker of run A cannot cross to run B: naming B's episode in the header the server
    # sets itself changes nothing, and a genuine key whose run is B's is refused (the key
    # binds its run; the server's own table says the episode is A's)
    with srv.http_as(episode_a["openai_api_key"]) as worker_a:
        crossed = worker_a.post("/v1/chat/completions",
                                headers={"X-Episode-UUID": episode_b["episode_uuid"]},
                                json={"model": "m", "messages": [{"role": "user",
                                                                  "content": "hi"}]})
    assert crossed.json()["choices"][0]["message"]["content"] == f"run {a['run_id']}"
    signer = srv.app.state.ctx.episodes.signer  # type: ignore[union-attr]
    rebound, _ = signer.sign(b["run_id"], episode_a["episode_uuid"])
    refused = _chat(srv, rebound)
    assert refused.status_code == 401 and "unknown episode for this key" in refused.text
    with srv.http_as(WORKER_TOKEN) as worker:
        aimed = worker.post("/end_episode", json={"episode_uuid": episode_a["episode_uuid"],
                                                  "task_id": "t", "reward": 1.0,
                                                  "run_id": b["run_id"]})
        assert aimed.status_code == 422  # an episode's run is the server's, never the body's

    # run A ends: its keys die with it, while run B's go on
    control.post("/runs/key-a/stop", json={})
    refused = _chat(srv, episode_a["openai_api_key"])
    assert refused.status_code == 401
    assert f"belongs to engine run {a['run_id']}" in refused.json()["detail"]
    assert _chat(srv, episode_b["openai_api_key"]).status_code == 200
    with srv.http_as(WORKER_TOKEN) as worker:
        late = worker.post("/end_episode", json={"episode_uuid": episode_a["episode_uuid"],
                                                 "task_id": "t", "reward": 1.0})
        assert late.status_code == 404 and a["run_id"] in late.json()["detail"]
        gone = worker.post("/begin_episode", json={"run_id": "key-a"})
        assert gone.status_code == 409 and "cannot begin_episode" in gone.json()["detail"]
        assert worker.post("/end_episode", json={"episode_uuid": episode_b["episode_uuid"],
                                                 "task_id": "t", "reward": 1.0}
                           ).json()["accepted"]


def test_revoking_a_snapshot_stops_only_the_runs_on_it(
        srv: Server, snapshots: list[str], control: httpx.Client) -> None:
    with srv.client(CONTROL_TOKEN) as client:  # a third snapshot, only for this test
        repo = make_ajet_repo(srv.workdir.parent / "revoke-repo")
        rewards = repo / "ajet" / "engine" / "rewards.py"
        rewards.write_text(rewards.read_text() + "\nREVOKED = 1\n")
        with pytest.raises(ApprovalPending) as pending:
            client.push_code(repo)
    doomed = pending.value.snapshot_id
    with srv.client(APPROVER_TOKEN) as approver:
        approver.decide_approval(doomed, "approve")
        _start(control, doomed, "on-doomed")
        _start(control, snapshots[1], "on-kept")
        queued = _start(control, doomed, "queued-on-doomed")
        assert queued["status"] == "queued"
        _wait_state(control, "on-doomed", ROLLING)
        _wait_state(control, "on-kept", ROLLING)
        approver.decide_approval(doomed, "revoke", note="bad reward")
    _wait_state(control, "on-doomed", EngineState.OFFLINE.value)
    assert "revoked" in control.get("/runs/on-doomed").json()["reason"]
    dropped = control.get("/runs/queued-on-doomed").json()
    assert dropped["status"] == "failed" and "revoked" in dropped["reason"]
    assert _status(control, "on-kept")["state"] == ROLLING
    refused = control.post("/runs", json={"snapshot_id": doomed, "yaml": JOB})
    assert refused.status_code == 409 and "revoked" in refused.text


def test_a_run_that_crashes_goes_offline_on_its_own_with_its_own_last_error(
        srv: Server, snapshots: list[str], control: httpx.Client) -> None:
    survivor = _start(control, snapshots[0], "survivor")
    _wait_state(control, "survivor", ROLLING)
    set_behaviour(srv.workdir, mode="crash_at_boot", exit_code=7)  # the next engine only
    try:
        crasher = _start(control, snapshots[1], "crasher")
        wait_until(lambda: _status(control, "crasher")["last_error"] is not None, timeout=30)
    finally:
        set_behaviour(srv.workdir)
    status = _status(control, crasher["run_id"])
    assert status["state"] == EngineState.OFFLINE.value
    error = status["last_error"]
    assert error["run_id"] == crasher["run_id"] and error["exit_code"] == 7
    assert "exited with code 7 while ENGINE.BOOTING" in error["reason"]
    assert "RuntimeError: fake boot failure" in error["log_tail"]  # what the agent reads
    # the others are untouched: the survivor serves, the default run has no error, and
    # the crashed run's slot is free again
    assert _status(control, "survivor")["state"] == ROLLING
    assert control.get("/get_engine_status").json()["last_error"] is None
    devices = control.get("/runs", params={"state": "active"}).json()["devices"]
    assert set(devices["held"]) == {survivor["run_id"]} and len(devices["free"]) == 1


def test_the_original_client_drives_the_default_run_beside_a_run_of_post_runs(
        server_factory: ServerFactory) -> None:
    from ajet.tuner_lib.experimental.swarm_client import SwarmClient as OriginalClient

    # a real process: the original client reaches servers by URL only
    srv = server_factory(env=server_env(AJET_SWARM_TOKEN=CONTROL_TOKEN,
                                        AJET_SWARM_DEVICES="2"), process=True)
    with srv.http_as(CONTROL_TOKEN) as control, \
            OriginalClient(srv.url, token=CONTROL_TOKEN) as original:
        side = _start(control, "server", "beside")
        original.auto_sync_train_config_and_start_engine(AgentJetJob(), force_restart=True)
        wait_until(lambda: original.get_engine_status()[0] == ROLLING, timeout=60)
        _wait_state(control, "beside", ROLLING)
        default = control.get("/runs/current").json()
        assert default["default_run"] and default["run_id"] != side["run_id"]
        assert sorted(default["devices"] + side["devices"]) == [0, 1]
        assert _begin(control, None)["run_id"] == default["run_id"]  # no run: the default
        original.stop_engine()
        assert original.get_engine_status()[0] == EngineState.OFFLINE.value
        assert _status(control, "beside")["state"] == ROLLING
        control.post("/runs/beside/stop", json={})


def test_a_queued_run_waits_again_after_a_server_restart(tmp_path: Path) -> None:
    env = server_env(AJET_SWARM_DEVICES="1")
    with app_server(tmp_path / "swarm", env=env) as first, first.http_as(None) as http:
        head = _start(http, "server", "head")
        assert _start(http, "server", "behind")["status"] == "queued"
    # the shutdown stopped the head run; the queued one is a ledger row the next server
    # queues again, and starts on the slot that is now free
    with app_server(tmp_path / "swarm", env=env) as second, second.http_as(None) as http:
        _wait_state(http, "behind", ROLLING)
        assert http.get(f"/runs/{head['run_id']}").json()["status"] == "ended"
        http.post("/runs/behind/stop", json={"reason": "test done"})


def test_refusals_say_why_and_what_to_do(
        srv: Server, snapshots: list[str], control: httpx.Client) -> None:
    big = AgentJetJob(n_proc=3).to_yaml()
    never = control.post("/runs", json={"snapshot_id": snapshots[0], "yaml": big})
    assert never.status_code == 409 and "could never start" in never.json()["detail"]
    assert "--devices" in never.json()["hint"]
    _start(control, snapshots[0], "only-one")
    taken = control.post("/runs", json={"snapshot_id": snapshots[0], "yaml": JOB,
                                        "name": "only-one"})
    assert taken.status_code == 409 and "already named" in taken.json()["detail"]
    reserved = control.post("/runs", json={"yaml": JOB, "name": "current"})
    assert reserved.status_code == 422 and "names the default run" in reserved.text
    _start(control, snapshots[1], "second")
    busy = control.post("/runs", json={"snapshot_id": snapshots[0], "yaml": JOB,
                                       "queue": False})
    assert busy.status_code == 409 and "0 of 2 are free" in busy.json()["detail"]
    assert "POST /runs" in busy.json()["hint"]
    # the default run cannot take a slot either, and says who holds them
    SwarmClient(srv.url, token=CONTROL_TOKEN, transport=srv.transport).submit_config(
        AgentJetJob())
    default = control.post("/start_engine", json={})
    assert default.status_code == 409 and "holds" in default.json()["detail"]
    with srv.http_as(WORKER_TOKEN) as worker:
        assert worker.post("/runs", json={"yaml": JOB}).status_code == 403
        assert worker.post("/runs/second/stop", json={}).status_code == 403
    assert control.get("/runs", params={"state": "active"}).json()["total"] == 2
    unknown = control.get("/runs/no-such-run/status")
    assert unknown.status_code == 404 and "list_runs" in unknown.json()["hint"]
