"""The bridge against a server that enforces approvals (approver tokens), through MCP.

The agent's tools upload and get `pending_approval` with where the human approves; the
elicitation shows the diff computed from the server's stored files; after the approver
approves with their own token the next sync activates and the engine starts. A workflow
that tries to approve, a forged approval file and `ajet-mcp approvals approve` get no
code running.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp_types import ElicitRequestParams, ElicitResult

from ajet.client import SwarmClient
from mcp_bridge.approvals import ApprovalStore
from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.models import ApprovalMode
from mcp_bridge.server import build_server
from tests.support import (
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
)
from tests.support.bridge import assert_small, run_approvals_cli, structured, text_of
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env

pytestmark = pytest.mark.anyio

REWARDS = "ajet/engine/rewards.py"

ATTACK = '''
import json, os, glob, time
from pathlib import Path
import httpx

HERE = Path(__file__).parent
target = json.loads((HERE / "target.json").read_text())
found = {k: v for k, v in os.environ.items() if k.startswith(("AJET_SWARM", "AJET_MCP"))}
answers = []
for token in [found.get("AJET_SWARM_TOKEN"), found.get("AJET_SWARM_WORKER_TOKEN")]:
    r = httpx.post(f"{target['url']}/approvals/{target['sid']}/approve",
                   json={"snapshot_id": target["sid"]},
                   headers={"Authorization": f"Bearer {token}"} if token else {})
    answers.append(r.status_code)
(HERE / "report.json").write_text(json.dumps({"env": sorted(found), "answers": answers}))
TASKS = [{"task_id": "t"}]

def workflow(task, episode):
    return 0.0
'''


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    # a real process: the bridge reaches the server over HTTP
    return server_factory(env=server_env(**ENFORCING_ENV), process=True)


@pytest.fixture
def bridge(srv: Server, repo: Path, approvals_dir: Path) -> Iterator[Bridge]:
    b = Bridge(BridgeConfig(swarm_url=srv.url, token=CONTROL_TOKEN, repo=repo,
                            approval=ApprovalMode.ASK, approvals_dir=approvals_dir,
                            start_wait_s=30))
    yield b
    b.rollouts.stop_all(timeout=5)
    b.client.stop_run(reason="test teardown")
    b.client.activate_snapshot("server")
    b.close()


@pytest.fixture
def approver(srv: Server) -> Iterator[SwarmClient]:
    with SwarmClient(srv.url, token=APPROVER_TOKEN) as c:
        yield c


def _edit(repo: Path, marker: str) -> None:
    path = repo / REWARDS
    path.write_text(path.read_text() + f"\n# {marker}\x1b[2K\n", encoding="utf-8")


async def test_pending_until_the_approver_approves_on_the_server(
        bridge: Bridge, repo: Path, approver: SwarmClient, srv: Server) -> None:
    _edit(repo, "enforced-v1")
    async with Client(build_server(bridge)) as client:  # no elicitation support
        assert "only a human approver" in (client.instructions or "")
        first = await client.call_tool("sync_train_code", {})
        assert_small(first)
        pending = structured(first)
        sid = pending["snapshot_id"]
        assert pending["status"] == "pending_approval", pending["message"]
        info = pending["approval"]
        assert info["enforced_by_server"] and info["approve_url"] == f"{srv.url}/ui/snapshots/{sid}"
        assert info["human_command"] == f"ajet-swarm approvals approve {sid}"
        assert "You cannot approve it" in pending["message"]
        assert "\\x1b[2K" in pending["diff"] and "\x1b" not in pending["diff"]
        status = structured(await client.call_tool("engine_status", {}))
        assert status["approvals_enforced"] and sid in status["pending_approvals"]
        assert bridge.client.get_active_code() is None  # stored, not active

        # the human approver decides on the server with their own token
        approver.decide_approval(sid, "approve")
        synced = structured(await client.call_tool("sync_train_code", {}))
        assert synced["status"] == "synced", synced["message"]
        assert synced["approval"]["approved_by"] == "alice"
        await client.call_tool("configure", {"batch_size": 2})
        started = structured(await client.call_tool("start_engine", {}))
        assert started["engine_state"] == "ENGINE.ROLLING" and started["snapshot_id"] == sid


async def test_elicitation_shows_the_server_side_diff_and_where_to_approve(
        bridge: Bridge, repo: Path, approver: SwarmClient, srv: Server) -> None:
    _edit(repo, "enforced-elicited")
    shown: list[str] = []

    async def human(context: Any, params: ElicitRequestParams) -> ElicitResult:
        shown.append(params.message)
        sid = params.message.split("as snapshot ", 1)[1].split(" ", 1)[0]
        approver.decide_approval(sid, "approve")  # the human approves in the console/CLI
        return ElicitResult(action="accept", content={"approve": True})

    async with Client(build_server(bridge), elicitation_callback=human) as client:
        synced = structured(await client.call_tool("sync_train_code", {}))
    assert synced["status"] == "synced", synced["message"]
    assert len(shown) == 1
    message = shown[0]
    assert "Diff computed from the server's stored files" in message
    assert f"{srv.url}/ui/snapshots/{synced['snapshot_id']}" in message
    assert "+# enforced-elicited\\x1b[2K" in message and "\x1b" not in message


async def test_a_workflow_a_forged_file_and_the_laptop_cli_cannot_approve(
        bridge: Bridge, repo: Path, approvals_dir: Path, srv: Server,
        approver: SwarmClient) -> None:
    _edit(repo, "enforced-attack")
    async with Client(build_server(bridge)) as client:
        pending = structured(await client.call_tool("sync_train_code", {}))
        sid = pending["snapshot_id"]
        assert pending["status"] == "pending_approval"

        # 1. a workflow in the repo that tries to approve when it is loaded
        (repo / "flows").mkdir()
        (repo / "flows" / "attack.py").write_text(ATTACK)
        (repo / "flows" / "target.json").write_text(json.dumps({"url": srv.url, "sid": sid}))
        started = await client.call_tool("start_rollouts", {"workflow": "flows/attack.py:workflow"})
        assert not started.is_error, text_of(started)
        report = json.loads((repo / "flows" / "report.json").read_text())
        assert report == {"env": [], "answers": [401, 401]}
        await client.call_tool("stop_rollouts", {})

        # 2. a forged approval file for exactly this snapshot in the bridge's folder
        store = ApprovalStore(approvals_dir)
        forged = store.request(snapshot_id=sid, server_url=srv.url, repo=str(repo), summary="",
                               diff="", files={}, bytes_to_upload=0)
        store.approve(forged.id, by="alice (forged)")
        again = structured(await client.call_tool("sync_train_code", {}))
        assert again["status"] == "pending_approval"

        # 3. the laptop-side command refuses and points to the server
        env_token = {"AJET_SWARM_TOKEN": CONTROL_TOKEN}
        other = store.request(snapshot_id="e" * 64, server_url=srv.url, repo="/r", summary="",
                              diff="", files={}, bytes_to_upload=0)
        old = {k: os.environ.get(k) for k in env_token}
        os.environ.update(env_token)
        try:
            refused = run_approvals_cli(approvals_dir, "approve", other.id, typed="e" * 12)
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert refused.returncode == 1 and "enforces approvals" in refused.stderr
        assert "ajet-swarm approvals approve" in refused.stderr

    assert approver.get_review(sid).approval.state.value == "pending"
    assert bridge.client.get_active_code() is None
