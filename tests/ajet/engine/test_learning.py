"""Learning happens: the digits workflow's reward rises under GRPO (server, engine, workers)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.engine.metrics import REQUIRED_FIELDS
from ajet.rollout import RolloutRunner, load_workflow
from tests.support import PROJECT_ROOT, start_server


@pytest.mark.slow
def test_digit_reward_rises_within_ten_steps(tmp_path: Path) -> None:
    workflow, tasks = load_workflow("examples/digits_workflow.py:workflow", PROJECT_ROOT)
    # a higher lr than the default keeps this test short; the bench uses the defaults
    job = AgentJetJob(batch_size=4, num_repeat=8, lr=0.01, max_steps=10)
    server = start_server(tmp_path / "swarm")
    client = SwarmClient(server.url, timeout=60)
    runner = RolloutRunner(client, workflow, tasks, n_workers=4, num_repeat=job.num_repeat)
    try:
        client.configure_and_start(job, wait_timeout=120)
        runner.start()
        deadline = time.monotonic() + 240
        points: list[dict] = []
        while len(points) < 10:
            assert time.monotonic() < deadline, client.get_run_logs(tail=30).lines
            time.sleep(0.5)
            points = client.get_metrics().points
        runner.stop(timeout=30)
    finally:
        runner.stop(timeout=5)
        client.close()
        server.stop()
    rewards = [p["reward_mean"] for p in points]
    assert all(set(REQUIRED_FIELDS) <= set(p) for p in points)
    assert all(p["episodes"] == 32 for p in points)
    assert "log/digit_share" in points[-1]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= 0.2, rewards
    run_dir = next((tmp_path / "swarm" / "runs").iterdir())
    assert (run_dir / "final" / "model.safetensors").is_file()  # max_steps ends cleanly


@pytest.mark.slow
def test_lora_with_the_defaults_meets_the_learning_criterion(tmp_path: Path) -> None:
    """LoRA on ajet-tiny with nothing but lora_rank set: the server's defaults for the
    model (lr, targets) gain +0.3 within the 90 s budget, counted from the start."""
    workflow, tasks = load_workflow("examples/digits_workflow.py:workflow", PROJECT_ROOT)
    job = AgentJetJob(batch_size=4, num_repeat=8, lora_rank=8)
    server = start_server(tmp_path / "swarm")
    client = SwarmClient(server.url, timeout=60)
    runner = RolloutRunner(client, workflow, tasks, n_workers=4, num_repeat=job.num_repeat)
    rewards: list[float] = []
    try:
        accepted = client.submit_config(job)
        assert "lm_head" in accepted.config["lora_target_modules"]
        start = time.monotonic()
        client.start_run()
        runner.start()
        while time.monotonic() - start < 90:
            time.sleep(0.5)
            rewards = [p["reward_mean"] for p in client.get_metrics().points]
            if len(rewards) >= 6 and sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.3:
                break
        runner.stop(timeout=30)
    finally:
        runner.stop(timeout=5)
        client.close()
        server.stop()
    assert len(rewards) >= 6, rewards
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.3, rewards
