"""The bridge's public surface, its weight on a laptop, and the README's tool list."""

from __future__ import annotations

import json
import subprocess
import sys

import mcp_bridge
from mcp_bridge.models import ToolName
from tests.support import PROJECT_ROOT


def test_all_is_sorted_and_complete() -> None:
    assert mcp_bridge.__all__ == sorted(mcp_bridge.__all__)
    public = {name for name in vars(mcp_bridge) if not name.startswith("_")}
    for name in public - set(mcp_bridge.__all__):
        assert type(getattr(mcp_bridge, name)).__name__ == "module", f"{name} not in __all__"
    for name in mcp_bridge.__all__:
        assert hasattr(mcp_bridge, name)


def test_the_bridge_never_imports_torch_or_matplotlib_at_start() -> None:
    code = ("import sys, json; import mcp_bridge, mcp_bridge.server, mcp_bridge.cli; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'matplotlib') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PROJECT_ROOT)
    assert json.loads(out.stdout) == []


def test_the_approvals_command_does_not_load_the_mcp_sdk() -> None:
    code = ("import sys; import mcp_bridge, mcp_bridge.cli; "
            "print(any(m == 'mcp' or m.startswith('mcp.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PROJECT_ROOT)
    assert out.stdout.strip() == "False"


def test_readme_lists_every_tool_and_approval_mode() -> None:
    readme = (PROJECT_ROOT / "README.md").read_text("utf-8")
    section = readme.split("## Use from an MCP client", 1)[1].split("\n## ", 1)[0]
    for tool in ToolName:
        assert f"`{tool.value}`" in section, tool.value
    for text in ("claude mcp add", "claude_desktop_config.json", "streamable-http",
                 "`ask`", "`queue`", "`auto`", "ajet-mcp approvals approve"):
        assert text in section, text
