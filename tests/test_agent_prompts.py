"""The playbooks in `agent_prompts/` name only tools and parameters the bridge has.

An agent copies calls from these pages; a renamed tool or parameter must fail here,
not in front of the model. Calls are written `tool(param=value, ...)` in backticks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.models import ToolName
from mcp_bridge.server import build_server, prompt_files

_CALL = re.compile(r"`([a-z_]+)\(([^`]*)\)`")
_PARAM = re.compile(r"(?:^|[(,\s])([a-z_]+)=")


def _tool_parameters(tmp_path: Path) -> dict[str, set[str]]:
    # Nothing is contacted: listing tools needs no swarm server.
    bridge = Bridge(BridgeConfig(swarm_url="http://127.0.0.1:9", repo=tmp_path,
                                 approvals_dir=tmp_path / "approvals"))

    async def list_tools() -> Any:
        async with Client(build_server(bridge)) as client:
            return (await client.list_tools()).tools

    try:
        tools = anyio.run(list_tools)
    finally:
        bridge.close()
    return {t.name: set(t.input_schema.get("properties", {})) for t in tools}


def test_playbooks_call_real_tools_with_real_parameters(tmp_path: Path) -> None:
    params = _tool_parameters(tmp_path)
    assert set(params) == {t.value for t in ToolName}
    playbooks = prompt_files()
    assert {"research_loop", "debugging", "sync_rules", "sweeps"} <= set(playbooks)
    named: set[str] = set()
    for name, text in playbooks.items():
        calls = _CALL.findall(text)
        assert calls, f"{name}.md shows no tool call"
        for tool, args in calls:
            assert tool in params, f"{name}.md calls unknown tool {tool}"
            unknown = set(_PARAM.findall(args)) - params[tool]
            assert not unknown, f"{name}.md passes {sorted(unknown)} to {tool}"
            named.add(tool)
    assert named == set(params), f"tools no playbook shows: {sorted(set(params) - named)}"


def test_the_sweeps_playbook_shows_a_sweep_of_named_runs() -> None:
    calls = {(tool, param) for tool, args in _CALL.findall(prompt_files()["sweeps"])
             for param in _PARAM.findall(args)}
    for step in (("list_runs", "state"), ("start_engine", "name"), ("start_engine", "config"),
                 ("start_engine", "snapshot_id"), ("start_rollouts", "run_id"),
                 ("compare_runs", "run_ids"), ("stop_engine", "run_id")):
        assert step in calls, f"sweeps.md does not show {step[0]}({step[1]}=...)"
