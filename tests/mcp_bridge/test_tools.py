"""Tool logic as plain functions (no MCP), against a real server with a fake engine process.

The engine here is `tests/support/fake_engine.py` (the real command line and socket
contract, no torch), so lifecycle, crash reporting, metrics and logs are tested in
seconds; `test_end_to_end.py` runs the real engine.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.server.mcpserver.exceptions import ToolError

from ajet.protocol import EngineState
from mcp_bridge import sync, tools
from mcp_bridge.bridge import Bridge
from mcp_bridge.models import ApprovalMode
from mcp_bridge.server import build_server
from tests.support import ServerHandle, start_server
from tests.support.bridge import assert_small, make_bridge, structured, text_of
from tests.support.fake_engine import server_env, set_behaviour

METRICS = [{"step": i, "reward_mean": 0.1 * i, "reward_std": 0.05, "success_rate": i / 10,
            "loss": 1.0 / i, "response_length": 12.0, "episodes": 4, "log/digit_share": 0.5}
           for i in range(1, 11)]


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path / "swarm", env=server_env())
    yield handle
    handle.stop()


@pytest.fixture
def bridge(fake_server: ServerHandle, repo: Path, approvals_dir: Path) -> Iterator[Bridge]:
    b = make_bridge(fake_server, repo, approvals_dir, approval=ApprovalMode.AUTO,
                    start_wait_s=30.0)
    yield b
    b.client.stop_run(reason="test teardown")
    b.close()


def _start(bridge: Bridge, workdir: Path, **behaviour: Any) -> str:
    set_behaviour(workdir, **behaviour)
    result = tools.start_engine(bridge)
    assert result.engine_state == EngineState.ROLLING.value, result.message
    assert result.run_id
    return result.run_id


def test_configure_reports_changes_against_the_stored_config(bridge: Bridge) -> None:
    first = tools.configure(bridge, {"experiment_name": "exp-a", "batch_size": 2})
    assert {c.field for c in first.changed} == {"experiment_name", "batch_size"}
    second = tools.configure(bridge, {"lr": 0.01})
    assert [(c.field, c.after) for c in second.changed] == [("lr", 0.01)]
    assert second.config["batch_size"] == 2 and second.config["experiment_name"] == "exp-a"
    assert second.compared_with == "the server's stored config"
    with pytest.raises(ToolError, match=r"max_new_tokens.*Next: fix the named field"):
        tools.configure(bridge, {"max_new_tokens": 10_000, "max_response_length": 8})


def test_lifecycle_status_metrics_logs_and_state_guards(
        bridge: Bridge, fake_server: ServerHandle, repo: Path) -> None:
    with pytest.raises(ToolError, match="no training config.*Next: call configure"):
        tools.start_engine(bridge)
    tools.configure(bridge, {"experiment_name": "exp-m", "batch_size": 2})
    run_id = _start(bridge, fake_server.workdir, metrics=METRICS)

    status = tools.engine_status(bridge)
    assert status.engine_state == "ENGINE.ROLLING" and status.run_id == run_id
    assert "read_metrics" in status.message

    with pytest.raises(ToolError, match="OFFLINE.*Next: call stop_rollouts, stop_engine"):
        tools.configure(bridge, {"lr": 0.5})
    with pytest.raises(ToolError, match="already ENGINE.ROLLING.*force_restart"):
        tools.start_engine(bridge)

    metrics, png = tools.read_metrics(bridge, last_n=5)
    assert png is None and metrics.run_id == run_id and metrics.last_step == 10
    assert metrics.window == "6-10" and metrics.latest["log/digit_share"] == 0.5
    trend = {t.metric: t for t in metrics.trend}
    assert trend["reward_mean"].direction == "up" and trend["reward_mean"].points == 5
    assert trend["reward_mean"].first == pytest.approx(0.6)
    assert trend["loss"].direction == "down"
    assert [p["step"] for p in metrics.recent] == [6, 7, 8, 9, 10]
    odd, _ = tools.read_metrics(bridge, metrics=["no_such_metric"])
    assert "No values for no_such_metric" in odd.message

    logs = tools.read_logs(bridge, tail=5)
    assert logs.run_id == run_id and 0 < len(logs.lines) <= 5
    grepped = tools.read_logs(bridge, grep="booting")
    assert grepped.lines and all("booting" in ln for ln in grepped.lines)

    # code changes while the engine runs need force_restart, and nothing is uploaded before
    (repo / "ajet/engine/rewards.py").write_text("# changed\n", encoding="utf-8")
    plan = sync.plan_sync(bridge)
    with pytest.raises(ToolError, match="OFFLINE.*Nothing was uploaded.*force_restart=true"):
        sync.run_sync(bridge, plan, None, dry_run=False, force_restart=False)
    restarted = sync.run_sync(bridge, plan, None, dry_run=False, force_restart=True)
    assert restarted.status == "synced" and restarted.restarted
    assert restarted.run_id and restarted.run_id != run_id

    stopped = tools.stop_engine(bridge)
    assert stopped.stopped and stopped.engine_state == "ENGINE.OFFLINE"
    again = tools.stop_engine(bridge)
    assert not again.stopped and "No engine was running" in again.message

    runs = tools.list_runs(bridge)
    assert [r.run_id for r in runs.runs][:2] == [restarted.run_id, run_id]
    assert runs.runs[1].reward_last == pytest.approx(1.0)
    compared = tools.compare_runs(bridge, [run_id, restarted.run_id])
    assert not compared.same_code  # the second run used the synced snapshot
    assert {r.run_id for r in compared.runs} == {run_id, restarted.run_id}
    assert compared.runs[0].last == pytest.approx(1.0) and compared.runs[0].best_step == 10


def test_a_crash_at_boot_is_an_error_with_reason_and_log_tail(
        bridge: Bridge, fake_server: ServerHandle) -> None:
    tools.configure(bridge, {})
    set_behaviour(fake_server.workdir, mode="crash_at_boot", exit_code=3)
    with pytest.raises(ToolError) as info:
        tools.start_engine(bridge)
    text = str(info.value)
    assert "died while starting" in text and "exit code 3" in text
    assert "RuntimeError: fake boot failure" in text  # the log tail
    assert "Next: read_logs" in text and "activate_snapshot" in text
    status = tools.engine_status(bridge)
    assert status.engine_state == "ENGINE.OFFLINE" and status.last_error is not None
    assert "the last run failed" in status.message
    # the recovery, in call order: read the log, fix and resync or roll back, start again
    assert "Next: read last_error.log_tail and read_logs" in status.message
    assert status.message.index("activate_snapshot") < status.message.index("start_engine")


def test_snapshots_and_rollback(bridge: Bridge, repo: Path) -> None:
    first = sync.run_sync(bridge, sync.plan_sync(bridge), None, dry_run=False, force_restart=False)
    (repo / "ajet/engine/rewards.py").write_text("# v2\n", encoding="utf-8")
    second = sync.run_sync(bridge, sync.plan_sync(bridge), None, dry_run=False, force_restart=False)
    snaps = tools.list_snapshots(bridge)
    assert snaps.total == 2 and snaps.active == second.snapshot_id
    assert snaps.snapshots[0].snapshot_id == second.snapshot_id and snaps.snapshots[0].active
    back = tools.activate_snapshot(bridge, first.snapshot_id[:16])
    assert back.snapshot_id == first.snapshot_id and back.activated and not back.restarted
    assert "start_engine" in back.message
    server = tools.activate_snapshot(bridge, "server")
    assert server.snapshot_id == "server"
    # after a rollback to the server's own code, the diff is against its real files
    # (GET /code/server), not against git HEAD: the one edited file, nothing else
    plan = sync.plan_sync(bridge)
    assert plan.running_snapshot_id == "server" and plan.base_id == "server"
    assert plan.change_lists()["changed"] == ["ajet/engine/rewards.py"]
    assert not plan.change_lists()["added"] and "+# v2" in plan.diff


@pytest.mark.anyio
async def test_read_metrics_plot_is_image_content(bridge: Bridge, fake_server: ServerHandle
                                                  ) -> None:
    tools.configure(bridge, {})
    _start(bridge, fake_server.workdir, metrics=METRICS)
    async with Client(build_server(bridge)) as client:
        text_only = await client.call_tool("read_metrics", {})
        assert_small(text_only)
        assert [c.type for c in text_only.content] == ["text"]
        plotted = await client.call_tool("read_metrics", {"plot": True, "metrics": ["reward_mean"]})
    assert not plotted.is_error, text_of(plotted)
    kinds = [c.type for c in plotted.content]
    assert kinds == ["text", "image"]
    image = plotted.content[1]
    assert image.mime_type == "image/png"
    assert base64.b64decode(image.data).startswith(b"\x89PNG")
    assert structured(plotted)["plot_attached"] is True
    assert len(text_of(plotted).encode()) < 8 * 1024
