"""A sweep through the MCP bridge on a real server with the real engine (ajet-tiny on CPU,
`--devices 2`): two named runs at once, each on its own snapshot (two syncs of trees that
differ by a line), rollouts to each by name, both training, metrics per run, list_runs
with both and their devices, compare_runs saying they ran side by side, a third run queued
until one stops.

The bridge runs in process (`build_server` under the official MCP client); the stdio
transport is covered by test_end_to_end.py, the tools' logic against a fake of the
contract by test_run_tools.py.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from ajet.client import SwarmClient
from ajet.errors import EngineStateConflict
from ajet.protocol import BeginEpisodeResponse
from mcp_bridge.models import ApprovalMode
from mcp_bridge.server import build_server
from tests.support import PROJECT_ROOT, start_server
from tests.support.bridge import assert_small, make_bridge, structured

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

WORKFLOW = "examples/digits_workflow.py:workflow"
STEPS = 2


async def _call(client: Client, tool: str, /, **args: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, args)
    assert_small(result)
    return structured(result)


async def _wait_steps(client: Client, run: str, steps: int, timeout: float = 150.0
                      ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        result = await client.call_tool("read_metrics", {"run_id": run})
        if not result.is_error:
            metrics = structured(result)
            if metrics["total_steps"] >= steps:
                return metrics
        assert time.monotonic() < deadline, f"run {run} made no {steps} steps in {timeout}s"
        await anyio.sleep(0.5)


def _claim(swarm: SwarmClient, run: str, timeout: float = 30.0) -> BeginEpisodeResponse:
    """An episode of `run`, claimed by its name; a run between steps (weight sync) says
    409 for a moment, as the rollout workers see it too."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return swarm.open_episode(run_id=run)
        except EngineStateConflict:
            assert time.monotonic() < deadline, f"run {run} took no claim in {timeout}s"
            time.sleep(0.2)


async def _wait_rolling(client: Client, run: str, timeout: float = 120.0) -> dict[str, Any]:
    """The run's engine_status once it is ROLLING."""
    deadline = time.monotonic() + timeout
    while (status := await _call(client, "engine_status", run_id=run)
           )["engine_state"] != "ENGINE.ROLLING":
        assert status["last_error"] is None, status
        assert time.monotonic() < deadline, status
        await anyio.sleep(0.3)
    return status


async def test_a_sweep_of_two_runs_side_by_side_through_the_bridge(tmp_path: Path,
                                                                   repo: Path) -> None:
    (repo / "examples").mkdir(exist_ok=True)  # the workflow runs on the laptop, unsynced
    shutil.copy(PROJECT_ROOT / "examples" / "digits_workflow.py", repo / "examples")
    server = start_server(tmp_path / "swarm", env={"AJET_SWARM_DEVICES": "2"})
    bridge = make_bridge(server, repo, tmp_path / "approvals", approval=ApprovalMode.AUTO,
                         start_wait_s=120.0)
    try:
        async with Client(build_server(bridge)) as client:
            await _call(client, "configure", experiment_name="mcp-sweep", batch_size=2,
                        num_repeat=2, max_new_tokens=8, max_response_length=8)
            # two variants of the code: a snapshot each
            snapshots = []
            rewards = repo / "ajet" / "engine" / "rewards.py"
            for variant in (1, 2):
                rewards.write_text(rewards.read_text() + f"\nVARIANT = {variant}\n")
                synced = await _call(client, "sync_train_code")
                assert synced["status"] == "synced", synced["message"]
                snapshots.append(synced["snapshot_id"])
            assert snapshots[0] != snapshots[1]
            # both boot at once (wait_s=0: the tool returns while the run boots)
            a = await _call(client, "start_engine", name="lr-a", config={"lr": 0.01},
                            snapshot_id=snapshots[0], wait_s=0)
            b = await _call(client, "start_engine", name="lr-b", config={"lr": 0.05},
                            snapshot_id=snapshots[1], wait_s=0)
            for run in (a, b):
                assert run["status"] in ("booting", "running"), run["message"]
                assert len(run["devices"]) == 1
            assert set(a["devices"]).isdisjoint(b["devices"])
            for name, snapshot in zip(("lr-a", "lr-b"), snapshots, strict=True):
                status = await _wait_rolling(client, name)
                assert status["snapshot_id"] == snapshot, status

            listed = await _call(client, "list_runs", state="active")
            rows = {r["name"]: r for r in listed["runs"]}
            assert set(rows) == {"lr-a", "lr-b"}
            assert rows["lr-a"]["devices"] == a["devices"]
            assert listed["devices"]["total"] == 2 and listed["devices"]["free"] == []
            assert set(listed["devices"]["held"]) == {a["run_id"], b["run_id"]}

            for name in ("lr-a", "lr-b"):
                started = await _call(client, "start_rollouts", workflow=WORKFLOW,
                                      n_workers=2, run_id=name)
                assert started["run"] == name and started["num_repeat"] == 2
            metrics_a = await _wait_steps(client, "lr-a", STEPS)
            metrics_b = await _wait_steps(client, "lr-b", STEPS)
            assert metrics_a["run_id"] == a["run_id"] and metrics_b["run_id"] == b["run_id"]
            assert metrics_a["latest"]["episodes"] == 4

            # a third run does not fit: it waits in the queue, then takes a freed slot
            c = await _call(client, "start_engine", name="lr-c", config={"lr": 0.1})
            assert c["status"] == "queued" and c["queue_position"] == 1, c["message"]
            waiting = await _call(client, "engine_status")  # the latest run: lr-c
            assert waiting["queue_position"] == 1 and waiting["name"] == "lr-c"
            early = await _call(client, "start_rollouts", workflow=WORKFLOW, n_workers=1)
            assert early["run"] == "lr-c" and "is queued (#1)" in early["message"]
            # an episode claimed by name belongs to that run
            with SwarmClient(server.url) as swarm:
                episode = await anyio.to_thread.run_sync(_claim, swarm, "lr-b")
                assert episode.run_id == b["run_id"]
                swarm.cancel_episode(episode.episode_uuid, reason="test: not needed")

            compared = await _call(client, "compare_runs", run_ids=["lr-a", "lr-b"])
            assert {r["name"] for r in compared["runs"]} == {"lr-a", "lr-b"}
            assert [sorted(o["runs"]) for o in compared["side_by_side"]] == [
                sorted([a["run_id"], b["run_id"]])]
            assert "Side by side: lr-" in compared["message"]
            assert set(compared["config_differences"]) == {"lr"}
            assert all(r["last"] is not None for r in compared["runs"])

            stopped = await _call(client, "stop_engine", run_id="lr-a")
            assert stopped["stopped"] and len(stopped["rollouts_stopped"]) == 1
            deadline = time.monotonic() + 30
            while (now := await _call(client, "engine_status", run_id="lr-c")
                   )["queue_position"] is not None:
                assert time.monotonic() < deadline, now
                await anyio.sleep(0.2)
            assert now["devices"] == a["devices"], now  # the slot lr-a gave back
            assert now["engine_state"] != "ENGINE.OFFLINE" or now["last_error"] is None, now
            b_status = await _call(client, "engine_status", run_id="lr-b")
            assert b_status["engine_state"] in ("ENGINE.ROLLING", "ENGINE.ROLLING_POST",
                                                "ENGINE.WEIGHT_SYNCING")
    finally:
        bridge.close()
        server.stop()  # its shutdown stops every run's engine
