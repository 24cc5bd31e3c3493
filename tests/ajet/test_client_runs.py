"""The typed client's run calls: which route each takes and what it sends, against an
in-process fake of the concurrent-runs contract (tests/support/fake_runs.py); the real
server answers the same calls in tests/mcp_bridge/test_sweep_runs.py."""

from __future__ import annotations

import pytest

from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict, SwarmNotFound, SwarmTimeout, SwarmValidationError
from ajet.protocol import EngineState
from ajet.rollout import RolloutRunner
from tests.support.fake_runs import FakeRunsServer


def test_start_run_with_a_name_posts_runs_and_queues_what_does_not_fit() -> None:
    fake = FakeRunsServer(slots=1)
    with fake.client() as client:
        job = AgentJetJob(experiment_name="sweep", num_repeat=2)
        first = client.start_run(job, name="rank8")
        method, path, _, body = fake.requests[-1]
        assert (method, path) == ("POST", "/runs")
        assert body["name"] == "rank8" and body["queue"] is True
        assert "experiment_name: sweep" in body["yaml"] and "snapshot_id" not in body
        assert first.status == "booting" and first.devices == [0] and first.name == "rank8"

        second = client.start_run("experiment_name: sweep\n", name="rank16", snapshot_id="abc")
        assert fake.requests[-1][3]["snapshot_id"] == "abc"
        assert second.status == "queued" and second.queue_position == 1
        assert client.run_status("rank16").queue_position == 1
        with pytest.raises(EngineStateConflict, match="no free devices"):
            client.start_run(name="rank32", queue=False)
        with pytest.raises(EngineStateConflict, match="is active"):
            client.start_run(name="rank8")

        page = client.list_runs(state="active")
        assert fake.requests[-1][2]["state"] == "active"
        assert {r.name for r in page.runs} == {"rank8", "rank16"}
        assert page.devices is not None and page.devices.held == {first.run_id: [0]}
        assert page.devices.queued == [second.run_id]

        stopped = client.stop_run("rank8", reason="a loser")
        assert fake.requests[-1][:2] == ("POST", "/runs/rank8/stop")
        assert fake.requests[-1][3] == {"reason": "a loser"} and stopped.stopped
        # the queued run got the freed slot
        assert client.run_status("rank16").state == EngineState.ROLLING
        assert client.get_run("rank16").devices == [0]


def test_without_a_run_the_calls_keep_the_default_run_routes() -> None:
    fake = FakeRunsServer()
    with fake.client() as client:
        status = client.start_run()
        assert fake.requests[-1][:2] == ("POST", "/start_engine")
        assert status.state == EngineState.ROLLING
        client.open_episode()
        assert "run_id" not in fake.requests[-1][3]
        client.stop_run(reason="done")
        assert fake.requests[-1][:2] == ("POST", "/stop_engine")
        with pytest.raises(ValueError, match="default run only"):
            client.start_run(name="x", force_restart=True)


def test_open_episode_names_its_run_and_the_runner_passes_it_on() -> None:
    fake = FakeRunsServer()
    with fake.client() as client:
        run = client.start_run(name="rank8")
        episode = client.open_episode(run_id="rank8")
        assert fake.requests[-1][3]["run_id"] == "rank8" and episode.run_id == run.run_id

        def workflow(task: dict, episode: object) -> float:
            return 1.0

        # a run the server does not know stops the runner with the reason, at once
        runner = RolloutRunner(client, workflow, [{"task_id": "t"}], n_workers=2,
                               run_id="no-such-run")
        runner.start()
        assert runner.join(timeout=10)
        assert "run 'no-such-run' is not on the server" in (runner.stats().stopped_reason or "")
        begins = [b for m, p, _, b in fake.requests if p == "/begin_episode"]
        assert begins[-1]["run_id"] == "no-such-run"

        # a run that ended: its workers stop (saying so) instead of waiting for it forever,
        # and never move on to another run, here a new one of the same name
        client.stop_run("rank8")
        client.start_run(name="rank8")
        since = len(fake.requests)
        runner = RolloutRunner(client, workflow, [{"task_id": "t"}], n_workers=1,
                               run_id=run.run_id)
        runner.start()
        assert runner.join(timeout=10)
        stopped = runner.stats().stopped_reason or ""
        assert f"({run.run_id}) has ended" in stopped and "start a run" in stopped
        assert runner.stats().run_ended  # the bridge does not call that a failing workflow
        assert {b["run_id"] for m, p, _, b in fake.requests[since:] if p == "/begin_episode"
                } == {run.run_id}


def test_wait_follows_one_run_and_errors_carry_the_servers_words() -> None:
    fake = FakeRunsServer(slots=1)
    with fake.client() as client:
        run = client.start_run(name="a", wait=True, wait_timeout=5)
        assert run.status == "running"
        with pytest.raises(SwarmTimeout, match=r"run run-002 still ENGINE.OFFLINE \(queued #1"):
            client.start_run(name="b", wait=True, wait_timeout=0.3)
        with pytest.raises(EngineStateConflict, match="needs 2 device slots"):
            client.start_run("n_gpu: 2\n", name="big")
        with pytest.raises(SwarmValidationError):
            client.start_run("lora_rank: 0\n", name="bad")
        with pytest.raises(SwarmNotFound):
            client.run_status("nobody")
