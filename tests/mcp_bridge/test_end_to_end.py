"""The research loop through MCP with the real engine (ajet-tiny on CPU), over stdio.

configure -> start_engine -> start_rollouts -> read_metrics (text and PNG) -> patch ajet/
-> sync_train_code (the human accepts through elicitation, the engine restarts on the new
snapshot) -> read_metrics / read_logs on the new run -> compare_runs -> stop.

The loop runs once, against `ajet-mcp` as an MCP client starts it (a process speaking
stdio); the same tools in process (`build_server`) are tested one by one, on the fake
engine, in test_tools.py and test_server.py.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters

from ajet.client import SwarmClient
from tests.support import PROJECT_ROOT, ServerHandle
from tests.support.bridge import (
    AJET_MCP,
    Elicitor,
    assert_small,
    structured,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

WORKFLOW = "examples/digits_workflow.py:workflow"
MARKER = "AJET-PATCHED-REWARDS-7f3a"
STEPS = 3


async def _call(client: Client, name: str, **args: Any) -> dict[str, Any]:
    result = await client.call_tool(name, args)
    assert_small(result)
    return structured(result)


async def _wait_steps(client: Client, run_id: str, steps: int, timeout: float = 90.0
                      ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        result = await client.call_tool("read_metrics", {"run_id": run_id})
        if not result.is_error:
            metrics = structured(result)
            if metrics["total_steps"] >= steps:
                return metrics
        assert time.monotonic() < deadline, f"run {run_id} made no {steps} steps in {timeout}s"
        await anyio.sleep(0.5)


async def _research_loop(client: Client, repo: Path, human: Elicitor) -> dict[str, Any]:
    configured = await _call(client, "configure", experiment_name="mcp-e2e", batch_size=2,
                             num_repeat=2, max_new_tokens=8, max_response_length=8)
    assert configured["config"]["batch_size"] == 2
    started = await _call(client, "start_engine")
    assert started["engine_state"] == "ENGINE.ROLLING", started["message"]
    baseline = started["run_id"]
    rollouts = await _call(client, "start_rollouts", workflow=WORKFLOW, n_workers=2)
    assert rollouts["num_repeat"] == 2 and rollouts["tasks"] == 8

    metrics = await _wait_steps(client, baseline, STEPS)
    assert metrics["latest"]["episodes"] == 4
    assert {t["metric"] for t in metrics["trend"]} >= {"reward_mean", "loss"}
    plotted = await client.call_tool("read_metrics", {"run_id": baseline, "plot": True})
    assert [c.type for c in plotted.content] == ["text", "image"]
    status = await _call(client, "rollout_status")
    assert status["rollouts"][0]["stats"]["episodes_ended"] >= 4

    # patch one training module, preview, then sync with a restart; the human accepts
    rewards = repo / "ajet/engine/rewards.py"
    rewards.write_text(rewards.read_text() + f'\nprint("{MARKER}", flush=True)\n', "utf-8")
    preview = await _call(client, "sync_train_code", dry_run=True)
    assert preview["status"] == "preview" and preview["changed"] == ["ajet/engine/rewards.py"]
    assert human.messages == []
    synced = await _call(client, "sync_train_code", force_restart=True)
    assert synced["status"] == "synced" and synced["restarted"], synced["message"]
    assert synced["approval"]["status"] == "elicited" and len(human.messages) == 1
    assert MARKER in human.messages[0]
    patched = synced["run_id"]
    assert patched and patched != baseline

    deadline = time.monotonic() + 60
    while (engine := await _call(client, "engine_status"))["engine_state"] != "ENGINE.ROLLING":
        assert engine["engine_state"] != "ENGINE.OFFLINE", engine
        assert time.monotonic() < deadline
        await anyio.sleep(0.3)
    assert engine["snapshot_id"] == synced["snapshot_id"] and "ajet_temp" in engine["ajet_file"]
    await _wait_steps(client, patched, STEPS)  # the same rollout workers carry on
    logs = await _call(client, "read_logs", run_id=patched, grep=MARKER)
    assert any(MARKER in line for line in logs["lines"])
    old_logs = await _call(client, "read_logs", run_id=baseline, grep=MARKER)
    assert old_logs["lines"] == []

    compared = await _call(client, "compare_runs", run_ids=[baseline, patched])
    assert not compared["same_code"] and len(compared["runs"]) == 2
    assert all(r["last"] is not None for r in compared["runs"])
    stopped = await _call(client, "stop_engine")
    assert stopped["stopped"] and stopped["rollouts_stopped"]
    return synced


def _workflow_repo(repo: Path) -> None:
    # the workflow lives outside ajet/: it runs on the laptop and is never synced
    (repo / "examples").mkdir(exist_ok=True)
    shutil.copy(PROJECT_ROOT / "examples" / "digits_workflow.py", repo / "examples")


async def test_research_loop_over_stdio(server: ServerHandle, repo: Path,
                                        approvals_dir: Path) -> None:
    _workflow_repo(repo)
    human = Elicitor("accept")
    params = StdioServerParameters(
        command=str(AJET_MCP),
        args=["--swarm-url", server.url, "--repo", str(repo), "--approvals-dir",
              str(approvals_dir), "--log-level", "WARNING"],
    )
    try:
        async with Client(params, elicitation_callback=human) as client:
            synced = await _research_loop(client, repo, human)
    finally:
        with SwarmClient(server.url) as swarm:
            swarm.stop_run(reason="test teardown")
    with SwarmClient(server.url) as swarm:
        active = swarm.get_active_code()
    assert active is not None and active.snapshot_id == synced["snapshot_id"]
    assert "via MCP elicitation" in (active.approved_by or "")
