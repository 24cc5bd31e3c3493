"""`ajet-mcp` as installed: argument handling and the human's approvals commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mcp_bridge.approvals import ApprovalStore
from tests.support import PROJECT_ROOT
from tests.support.bridge import AJET_MCP, run_approvals_cli


def _file(store: ApprovalStore, snapshot: str = "c" * 64) -> str:
    return store.request(snapshot_id=snapshot, server_url="http://127.0.0.1:1", repo="/r",
                         summary="1 added, 0 changed, 0 removed", diff="+++ b/ajet/n.py\n+x = 1\n",
                         files={"added": ["ajet/n.py"], "changed": [], "removed": []},
                         bytes_to_upload=6).id


def test_serve_needs_a_swarm_url_and_documents_its_flags() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    missing = subprocess.run([str(AJET_MCP)], capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "--swarm-url" in missing.stderr and missing.stdout == ""
    helped = subprocess.run([sys.executable, "-m", "mcp_bridge", "--help"], capture_output=True,
                            text=True, cwd=PROJECT_ROOT, timeout=60)
    assert helped.returncode == 0
    for flag in ("--swarm-url", "--repo", "--approval", "--transport", "--port",
                 "--approvals-dir", "AJET_SWARM_TOKEN"):
        assert flag in helped.stdout


def test_approvals_list_show_approve_deny(tmp_path: Path) -> None:
    store = ApprovalStore(tmp_path)
    assert "No pending approvals" in run_approvals_cli(tmp_path, "list").stdout
    first, second = _file(store), _file(store, "d" * 64)

    listed = run_approvals_cli(tmp_path, "list")
    assert listed.returncode == 0 and first in listed.stdout and second in listed.stdout
    assert "+1 ~0 -0" in listed.stdout

    shown = run_approvals_cli(tmp_path, "show", first)
    assert shown.returncode == 0 and "c" * 64 in shown.stdout and "+x = 1" in shown.stdout

    not_a_terminal = run_approvals_cli(tmp_path, "approve", first)
    assert not_a_terminal.returncode == 1 and "terminal" in not_a_terminal.stderr
    mistyped = run_approvals_cli(tmp_path, "approve", first, typed="c" * 11 + "x")
    assert mistyped.returncode == 1 and store.get(first).status.value == "pending"
    confirmed = run_approvals_cli(tmp_path, "approve", first, typed="c" * 12)
    assert confirmed.returncode == 0, confirmed.stderr
    assert "+x = 1" in confirmed.stdout  # the diff is shown before the question
    assert run_approvals_cli(tmp_path, "deny", second).returncode == 0
    assert store.get(first).status.value == "approved"
    assert store.get(second).status.value == "denied"
    assert "No pending approvals" in run_approvals_cli(tmp_path, "list").stdout
    everything = run_approvals_cli(tmp_path, "list", "--all").stdout
    assert "approved" in everything and "denied" in everything

    again = run_approvals_cli(tmp_path, "approve", second, typed="d" * 12)
    assert again.returncode == 1 and "already denied" in again.stderr
    unknown = run_approvals_cli(tmp_path, "approve", "zzzzzzzz")
    assert unknown.returncode == 1 and "ajet-mcp approvals list" in unknown.stderr
    hostile = run_approvals_cli(tmp_path, "show", "../../etc/passwd")
    assert hostile.returncode == 1 and "not an approval id" in hostile.stderr
