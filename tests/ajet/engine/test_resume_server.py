"""Stop and resume through the server: a run stopped during training leaves a complete
checkpoint named in its record, and `resume_from: latest` continues its step count.

Checkpoints are written in the background (`async_save: true`, as on GPUs), so the stop,
which comes as soon as step 2's metrics line is out, usually finds step 2's checkpoint
still being written: the engine's stop path waits for it, and the run's record names
it. A running run's record names its last complete checkpoint as it is written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.rollout import RolloutRunner, load_workflow
from tests.support import PROJECT_ROOT, start_server


def _train_until(client: SwarmClient, runner: RolloutRunner, run_id: str, steps: int
                 ) -> list[dict]:
    runner.start()
    deadline = time.monotonic() + 180
    points: list[dict] = []
    while len(points) < steps:
        assert time.monotonic() < deadline, client.get_run_logs(tail=30).lines
        time.sleep(0.3)
        points = client.get_metrics(run_id).points
    return points


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    workflow, tasks = load_workflow("examples/digits_workflow.py:workflow", PROJECT_ROOT)
    job = AgentJetJob(experiment_name="resumed", batch_size=2, num_repeat=4, save_every=2,
                      async_save=True)
    server = start_server(tmp_path / "swarm")
    client = SwarmClient(server.url, timeout=60)
    runner = RolloutRunner(client, workflow, tasks, n_workers=2, num_repeat=job.num_repeat)
    try:
        first = client.configure_and_start(job, wait_timeout=120).run_id
        assert first is not None
        _train_until(client, runner, first, 2)
        runner.stop(timeout=30)
        stopped = client.stop_run(reason="stop during training")
        record = client.get_run(first)
        assert record.last_step is not None and record.last_step >= 2
        # the stop left a complete checkpoint of the last step, named in the record
        assert stopped.last_checkpoint == record.last_checkpoint is not None
        assert (Path(record.last_checkpoint) / "ajet_checkpoint.json").is_file()
        run_dir = tmp_path / "swarm" / "runs" / first
        assert run_dir.is_dir() and not list(run_dir.rglob("*.partial"))

        job.resume_from = "latest"
        second = client.configure_and_start(job, wait_timeout=120).run_id
        assert second is not None and second != first
        runner = RolloutRunner(client, workflow, tasks, n_workers=2, num_repeat=job.num_repeat)
        saved_step = (record.last_step // job.save_every + 1) * job.save_every
        points = _train_until(client, runner, second, saved_step - record.last_step)
        # the record of the running run names that step's checkpoint once it is written
        saved: str | None = None
        deadline = time.monotonic() + 60
        while not (saved or "").endswith(f"step_{saved_step}"):
            assert time.monotonic() < deadline, client.get_run_logs(tail=30).lines
            live = client.get_run(second)
            assert live.status == "running"
            saved = live.last_checkpoint
            time.sleep(0.2)
        assert (Path(saved) / "ajet_checkpoint.json").is_file()
        runner.stop(timeout=30)
        assert points[0]["step"] == record.last_step + 1  # the step count goes on
        resumed = client.get_run(second)
        assert (resumed.resumed_from, resumed.resume_step) == (first, record.last_step)
        assert resumed.resume_checkpoint == record.last_checkpoint
        chain = client.compare_runs([second])["runs"][0]["chain"]
        assert chain == [first, second]
    finally:
        runner.stop(timeout=5)
        client.close()
        server.stop()
