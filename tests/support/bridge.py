"""MCP bridge test support: bridges on a server, MCP result helpers, the approvals CLI."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

from mcp_types import CallToolResult, ElicitRequestParams, ElicitResult

from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.models import ApprovalMode
from tests.support.servers import PROJECT_ROOT, ServerHandle

AJET_MCP = Path(sys.executable).with_name("ajet-mcp")
#: Every tool's default output must stay under this much text (docs/design.md: ~2,000 tokens).
MAX_TOOL_TEXT = 8 * 1024


def make_bridge(server: ServerHandle, repo: Path, approvals_dir: Path, *,
                approval: ApprovalMode = ApprovalMode.ASK, token: str | None = None,
                start_wait_s: float = 60.0) -> Bridge:
    return Bridge(BridgeConfig(swarm_url=server.url, token=token, repo=repo, approval=approval,
                               approvals_dir=approvals_dir, start_wait_s=start_wait_s))


def patch_file(repo: Path, rel: str, text: str) -> Path:
    path = repo / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=test", "-C",
                    str(repo), *args], check=True, capture_output=True)


def text_of(result: CallToolResult) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


def structured(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return result.structured_content


def assert_small(result: CallToolResult) -> None:
    size = len(text_of(result).encode("utf-8"))
    assert size < MAX_TOOL_TEXT, f"{size} bytes of text: {text_of(result)[:300]}"


def assert_names_next(result: CallToolResult) -> None:
    assert result.is_error, text_of(result)
    assert "Next:" in text_of(result), text_of(result)


class Elicitor:
    """A client-side elicitation callback that records what the human was shown."""

    def __init__(self, action: str = "accept", approve: bool = True) -> None:
        self.action = action
        self.approve = approve
        self.messages: list[str] = []

    async def __call__(self, context: Any, params: ElicitRequestParams) -> ElicitResult:
        self.messages.append(params.message)
        if self.action == "accept":
            return ElicitResult(action="accept", content={"approve": self.approve})
        return ElicitResult(action=self.action)  # type: ignore[arg-type]


def run_approvals_cli(approvals_dir: Path, *args: str, typed: str | None = None
                      ) -> subprocess.CompletedProcess[str]:
    """`ajet-mcp approvals ...` as the human runs it (the installed console script).

    With `typed`, stdin is a terminal (a pty) on which that line is typed, as a human
    confirming an approval does; without it stdin is not a terminal.
    """
    cmd = [str(AJET_MCP), "approvals", "--approvals-dir", str(approvals_dir), *args]
    if typed is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL)
    master, slave = pty.openpty()
    try:
        os.write(master, typed.encode() + b"\n")
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              cwd=PROJECT_ROOT, stdin=slave)
    finally:
        os.close(master)
        os.close(slave)


def snapshot_count(bridge: Bridge) -> int:
    return len(bridge.client.list_snapshots().snapshots)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
