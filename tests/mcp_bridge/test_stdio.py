"""The installed `ajet-mcp` console script over stdio, driven by the official MCP client.

A real swarm server with tokens on loopback, a real git repo; the bridge gets its
token from `AJET_SWARM_TOKEN` in its environment. Anything the bridge printed to stdout
besides the protocol would break these sessions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from ajet.client import SwarmClient
from mcp_bridge.models import ToolName
from tests.support import CONTROL_TOKEN, ServerHandle
from tests.support.bridge import (
    AJET_MCP,
    Elicitor,
    assert_small,
    run_approvals_cli,
    structured,
)

pytestmark = pytest.mark.anyio


def _params(server: ServerHandle, repo: Path, approvals_dir: Path, *extra: str,
            token: str = CONTROL_TOKEN) -> StdioServerParameters:
    return StdioServerParameters(
        command=str(AJET_MCP),
        args=["--swarm-url", server.url, "--repo", str(repo), "--approvals-dir",
              str(approvals_dir), "--log-level", "WARNING", *extra],
        env={"AJET_SWARM_TOKEN": token},
    )


def _edit(repo: Path, marker: str) -> None:
    path = repo / "ajet/engine/rewards.py"
    path.write_text(path.read_text() + f"\n# {marker}\n", encoding="utf-8")


async def test_stdio_pending_approval_then_human_approves(
        secured_server: ServerHandle, repo: Path, approvals_dir: Path) -> None:
    _edit(repo, "stdio v1")
    async with Client(_params(secured_server, repo, approvals_dir)) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert names == {t.value for t in ToolName}
        assert {p.name for p in (await client.list_prompts()).prompts} >= {"research_loop"}
        status = structured(await client.call_tool("engine_status", {}))
        assert status["engine_state"] == "ENGINE.OFFLINE" and status["approval_mode"] == "ask"

        pending = structured(await client.call_tool("sync_train_code", {}))
        assert pending["status"] == "pending_approval"
        approval_id = pending["approval"]["approval_id"]
        assert run_approvals_cli(approvals_dir, "approve", approval_id,
                                 typed=pending["snapshot_id"][:12]).returncode == 0

        result = await client.call_tool("sync_train_code", {})
        assert_small(result)
        synced = structured(result)
        assert synced["status"] == "synced" and synced["snapshot_id"] == pending["snapshot_id"]
        configured = structured(await client.call_tool("configure", {"batch_size": 2}))
        assert configured["config"]["batch_size"] == 2
    with SwarmClient(secured_server.url, token=CONTROL_TOKEN) as swarm:
        active = swarm.get_active_code()
        assert active is not None and active.snapshot_id == synced["snapshot_id"]
        assert active.approved_by and f"approval {approval_id}" in active.approved_by


async def test_stdio_elicitation_accept(secured_server: ServerHandle, repo: Path,
                                        approvals_dir: Path) -> None:
    _edit(repo, "stdio elicited")
    human = Elicitor("accept")
    async with Client(_params(secured_server, repo, approvals_dir),
                      elicitation_callback=human) as client:
        synced = structured(await client.call_tool("sync_train_code", {}))
    assert synced["status"] == "synced" and synced["approval"]["status"] == "elicited"
    assert len(human.messages) == 1 and "# stdio elicited" in human.messages[0]


async def test_stdio_wrong_token_names_the_fix(secured_server: ServerHandle, repo: Path,
                                               approvals_dir: Path) -> None:
    async with Client(_params(secured_server, repo, approvals_dir, token="wrong")) as client:
        result = await client.call_tool("engine_status", {})
    assert result.is_error
    text = result.content[0].text
    assert "refused" in text and "Next: start ajet-mcp with AJET_SWARM_TOKEN" in text


async def test_streamable_http_on_loopback(server: ServerHandle, repo: Path,
                                           approvals_dir: Path) -> None:
    import subprocess
    import time

    import httpx

    from tests.support import free_port

    port = free_port()
    proc = subprocess.Popen(
        [str(AJET_MCP), "--swarm-url", server.url, "--repo", str(repo), "--approvals-dir",
         str(approvals_dir), "--transport", "streamable-http", "--port", str(port),
         "--log-level", "WARNING"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline, "ajet-mcp did not listen"
                time.sleep(0.1)
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            assert len((await client.list_tools()).tools) == len(ToolName)
            status = structured(await client.call_tool("engine_status", {}))
            assert status["engine_state"] == "ENGINE.OFFLINE"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
