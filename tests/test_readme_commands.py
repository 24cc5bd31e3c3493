"""The README's commands, tried as a new user would type them.

The Claude Code registration lines run against the real `claude` CLI (installed by
`make test` from the npm registry into `.venv/claude`; skipped, saying so, without it):
each must register the `ajet` server with the command and the environment it shows.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
CLAUDE = PROJECT_ROOT / ".venv" / "claude" / "node_modules" / ".bin" / "claude"


def _claude_lines() -> list[str]:
    """Every `claude mcp add ...` command of the README, continuation lines joined."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        commands += [line.strip() for line in joined.splitlines()
                     if line.strip().startswith("claude mcp add")]
    return commands


def _claude() -> str:
    found = str(CLAUDE) if CLAUDE.exists() else shutil.which("claude")
    if not found:
        pytest.skip("no claude CLI: `make test` installs it with npm into .venv/claude")
    return found


def test_the_readme_registers_the_bridge_with_claude_code() -> None:
    lines = _claude_lines()
    assert len(lines) >= 2, "the README lost its Claude Code registration lines"
    assert all(line.split()[3] == "ajet" for line in lines), \
        "the server name must come right after `claude mcp add` (before --env)"


@pytest.mark.parametrize("line", sorted(set(_claude_lines())))
def test_each_claude_line_runs_on_the_real_cli(line: str, tmp_path: Path) -> None:
    claude = _claude()
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", ""),
           "AJET_SWARM_TOKEN": "a-control-token-for-the-test"}
    argv = shlex.split(line.replace("$AJET_SWARM_TOKEN", env["AJET_SWARM_TOKEN"])
                           .replace('"$PWD"', str(tmp_path)))
    added = subprocess.run([claude, *argv[1:]], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120)
    assert added.returncode == 0, added.stdout + added.stderr
    shown = subprocess.run([claude, "mcp", "get", "ajet"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=120).stdout
    assert "Command: ajet-mcp" in shown and "--swarm-url" in shown
    if "--env" in argv:
        assert "AJET_SWARM_TOKEN=a-control-token-for-the-test" in shown
