"""The bridge's run-taking tools as plain functions and through MCP, against an in-process
fake of the concurrent-runs contract (tests/support/fake_runs.py): which run each tool
addresses, what a sweep looks like (named runs, the queue, the device pool, side by
side), and the errors the model reads. The real server and engine run the same sweep in
test_sweep_runs.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mcp import Client
from mcp.server.mcpserver.exceptions import ToolError

from mcp_bridge import tools
from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.models import ApprovalMode
from mcp_bridge.server import build_server
from tests.support.bridge import assert_names_next, assert_small, structured
from tests.support.fake_runs import FakeRunsServer

RUN_TAKING = ("start_rollouts", "stop_engine", "engine_status", "read_metrics", "read_logs",
              "list_checkpoints")


@pytest.fixture
def fake() -> FakeRunsServer:
    return FakeRunsServer(slots=2)


@pytest.fixture
def bridge(fake: FakeRunsServer, tmp_path: Path) -> Iterator[Bridge]:
    b = Bridge(BridgeConfig(swarm_url="http://fake-swarm", repo=tmp_path,
                            approval=ApprovalMode.AUTO, approvals_dir=tmp_path / "approvals",
                            start_wait_s=5.0), client=fake.client())
    yield b
    b.close()


def _paths(fake: FakeRunsServer, since: int = 0) -> list[str]:
    return [f"{m} {p}" for m, p, _, _ in fake.requests[since:]]


def test_a_sweep_of_named_runs_queues_lists_compares_and_stops(
        bridge: Bridge, fake: FakeRunsServer) -> None:
    rank8 = tools.start_engine(bridge, name="rank8", config={"lora_rank": 8})
    assert rank8.status == "running" and rank8.devices == [0] and rank8.name == "rank8"
    assert "start_rollouts with run_id=rank8" in rank8.message
    sent = yaml.safe_load(next(b for m, p, _, b in fake.requests if p == "/runs")["yaml"])
    assert sent["lora_rank"] == 8 and sent["experiment_name"] == "sweep"  # stored + changed
    rank16 = tools.start_engine(bridge, name="rank16", config={"lora_rank": 16})
    assert rank16.devices == [1]
    rank32 = tools.start_engine(bridge, name="rank32", config={"lora_rank": 32})
    assert rank32.status == "queued" and rank32.queue_position == 1
    assert "queued (#1" in rank32.message and "boots by itself" in rank32.message

    listed = tools.list_runs(bridge, state="active")
    assert {r.name: r.devices for r in listed.runs} == {"rank8": [0], "rank16": [1],
                                                       "rank32": []}
    assert next(r for r in listed.runs if r.name == "rank32").queue_position == 1
    assert listed.devices is not None and listed.devices.free == []
    assert listed.devices.queued == [rank32.run_id]
    assert "0 of 2 free" in listed.message and "queued: rank32" in listed.message
    assert "rank8 on [0]" in listed.message

    # no run given: the tools address the run started last (rank32, still queued)
    status = tools.engine_status(bridge)
    assert status.queue_position == 1 and "stop_engine" in status.message
    before = len(fake.requests)
    tools.read_metrics(bridge)
    tools.read_logs(bridge)
    assert {"GET /runs/rank32/metrics", "GET /runs/rank32/logs"} <= set(_paths(fake, before))

    fake.set_metrics("rank8", [{"step": i, "reward_mean": 0.1 * i} for i in range(1, 4)])
    fake.set_metrics("rank16", [{"step": i, "reward_mean": 0.2 * i} for i in range(1, 4)])
    metrics, _ = tools.read_metrics(bridge, run_id="rank16")
    assert metrics.run_id == rank16.run_id and metrics.last_step == 3
    compared = tools.compare_runs(bridge, ["rank8", "rank16"])
    assert compared.best_run == rank16.run_id
    assert [sorted(o.runs) for o in compared.side_by_side] == [sorted([rank8.run_id,
                                                                       rank16.run_id])]
    assert "Side by side: rank8 and rank16" in compared.message
    assert {r.name for r in compared.runs} == {"rank8", "rank16"}
    assert compared.config_differences["lora_rank"] == {rank8.run_id: 8, rank16.run_id: 16}

    # stop the loser: its slot goes to the queued run
    stopped = tools.stop_engine(bridge, run_id="rank8")
    assert stopped.stopped and "devices went back to the pool" in stopped.message
    assert "POST /runs/rank8/stop" in _paths(fake)
    now = tools.engine_status(bridge, run_id="rank32")
    assert now.engine_state == "ENGINE.ROLLING" and now.devices == [0]
    assert now.queue_position is None and "read_metrics with run_id=rank32" in now.message
    active = tools.compare_runs(bridge)  # no ids: the active runs
    assert {r.name for r in active.runs} == {"rank16", "rank32"}


def test_refusals_reach_the_model_with_the_next_step(bridge: Bridge,
                                                     fake: FakeRunsServer) -> None:
    tools.start_engine(bridge, name="a")
    with pytest.raises(ToolError, match=r"refused to start a: .*is active.*Next: if the name "
                                        r"is taken, pick another"):
        tools.start_engine(bridge, name="a")
    with pytest.raises(ToolError, match=r"needs 4 device slots.*Next:.*fewer devices"):
        tools.start_engine(bridge, name="big", config={"n_gpu": 4})
    tools.start_engine(bridge, name="b")
    with pytest.raises(ToolError, match=r"no free devices.*queue=true"):
        tools.start_engine(bridge, name="c", queue=False)
    with pytest.raises(ToolError, match=r"rejected the input.*lora_rank.*Next:"):
        tools.start_engine(bridge, name="bad", config={"lora_rank": 0})
    with pytest.raises(ToolError, match=r"not found: no run 'ghost'.*Next:"):
        tools.engine_status(bridge, run_id="ghost")
    # restarting a named run stops the active one of that name first
    again = tools.start_engine(bridge, name="a", force_restart=True)
    assert again.status == "running" and "POST /runs/a/stop" in _paths(fake)
    assert tools.stop_engine(bridge, run_id="b").stopped
    with pytest.raises(ToolError, match=r"run b .* has ended; it takes no more episodes.*"
                                        r"Next: start_engine with name=b"):
        tools.start_rollouts(bridge, "wf.py:workflow", run_id="b")


def test_without_a_named_run_the_tools_keep_the_default_run(
        bridge: Bridge, fake: FakeRunsServer) -> None:
    assert bridge.run_ref(None) == "current"
    with pytest.raises(ToolError, match="no run 'current'"):
        tools.read_logs(bridge)
    assert _paths(fake)[-1] == "GET /runs/current/logs"
    started = tools.start_engine(bridge)
    assert started.engine_state == "ENGINE.ROLLING" and bridge.last_run is None
    assert "POST /start_engine" in _paths(fake)
    tools.start_engine(bridge, name="side")
    assert bridge.run_ref(None) == "side"
    # the default run is still there under 'current'
    assert tools.engine_status(bridge, run_id="current").run_id == started.run_id
    stopped = tools.stop_engine(bridge, run_id="current")
    assert stopped.stopped and _paths(fake)[-1] == "POST /stop_engine"


@pytest.mark.anyio
async def test_the_model_sees_run_arguments_and_how_to_sweep(bridge: Bridge,
                                                              fake: FakeRunsServer) -> None:
    async with Client(build_server(bridge)) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        for name in RUN_TAKING:
            param = listed[name].input_schema["properties"]["run_id"]
            assert "run name" in str(param) and "started last" in str(param), name
        start = listed["start_engine"]
        assert {"name", "config", "snapshot_id", "queue"} <= set(start.input_schema["properties"])
        described = {name: " ".join((t.description or "").split())
                     for name, t in listed.items()}
        for phrase in ("SWEEP", "one named run per value", "list_runs", "compare_runs",
                       "queued"):
            assert phrase in described["start_engine"], phrase
        assert "state" in listed["list_runs"].input_schema["properties"]
        assert "sweep" in described["list_runs"] and "sweep" in described["start_rollouts"]
        assert "side by side" in described["compare_runs"]
        assert "sweep" in (client.instructions or "")

        started = await client.call_tool("start_engine", {"name": "r1",
                                                          "config": {"lora_rank": 2}})
        assert structured(started)["devices"] == [0]
        await client.call_tool("start_engine", {"name": "r2"})
        runs = await client.call_tool("list_runs", {"state": "active"})
        assert_small(runs)
        assert structured(runs)["devices"]["held"]
        refused = await client.call_tool("start_engine", {"name": "r1"})
        assert_names_next(refused)


def test_rollouts_claim_from_the_resolved_run_id_not_a_name_a_later_run_may_take() -> None:
    from mcp_bridge.rollouts import _claim_from

    assert _claim_from("rank8", "20261204-120000-abcdef") == "20261204-120000-abcdef"
    assert _claim_from("rank8", None) == "rank8"  # not resolved: as given
    assert _claim_from(None, "20261204-120000-abcdef") is None  # the default run, followed
