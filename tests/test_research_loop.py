"""`examples/research_loop.py` (what `make demo` runs): the whole loop, shortened.

The slow test runs the real program as `make demo` does, with 2 steps per run instead
of 12: a real swarm server it starts itself, the real engine, `ajet-mcp` over stdio, a
throwaway git repo. It checks what a newcomer is promised: exit 0, a table of both
runs, a PNG, a second snapshot that differs from the first and lives under
`ajet_temp/`, a human approval that showed the patch, a verdict that follows the
numbers and was acted on, and no process left behind.
The fast tests pin the parts the demo's conclusion rests on: the patch really changes
the advantages, and the verdict follows the numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from examples.research_loop import (
    MARGIN,
    judge,
    make_throwaway_repo,
    patch_advantages,
    verdict_text,
)
from tests.support import PROJECT_ROOT

DEMO = PROJECT_ROOT / "examples" / "research_loop.py"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes (other than this one) that contain `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def test_patch_drops_negative_advantages(tmp_path: Path) -> None:
    repo = make_throwaway_repo(tmp_path / "repo")
    rewards, groups = [0.0, 0.5, 1.0, 0.2, 0.2], ["a", "a", "a", "b", "b"]
    before = _load(repo / "ajet/engine/advantages.py", "adv_before")
    original = before.grpo_advantages(rewards, groups)
    assert min(original) < 0  # GRPO pushes the worse-than-average reply down

    diff = patch_advantages(repo)

    assert "advantages/" not in diff and "+            advantages[i] = max(0.0, " in diff
    after = _load(repo / "ajet/engine/advantages.py", "adv_after")
    patched = after.grpo_advantages(rewards, groups)
    assert patched == [max(0.0, a) for a in original]
    assert patched[0] == 0.0 and patched[2] > 0


def test_verdict_follows_the_numbers() -> None:
    assert judge(0.40, 0.40 + MARGIN + 0.01) == "held"
    assert judge(0.40, 0.40 - MARGIN - 0.01) == "rejected"
    assert judge(0.40, 0.40 + MARGIN / 2) == "inconclusive"
    assert judge(None, 0.5) == "inconclusive"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks leftovers through /proc")
def test_demo_runs_the_whole_loop_and_leaves_nothing_running(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    plot = tmp_path / "rewards.png"
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "2", "--workdir", str(workdir), "--plot",
         str(plot), "--summary-json", str(summary_path)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    leftovers = _processes_mentioning(str(workdir))
    assert not leftovers, leftovers

    summary = json.loads(summary_path.read_text())
    baseline, patched = summary["runs"]
    assert baseline["steps"] == patched["steps"] == [1, 2]
    assert baseline["snapshot_id"] != patched["snapshot_id"]
    assert patched["server_path"].startswith("ajet_temp/")
    snapshot_dir = workdir / "swarm" / patched["server_path"]
    assert "max(0.0, " in (snapshot_dir / "engine/advantages.py").read_text()
    # the engine imported ajet from that snapshot
    assert Path(patched["ajet_file"]).resolve() == (snapshot_dir / "__init__.py").resolve()
    compared = {r["run_id"]: r for r in summary["compare"]["runs"]}
    assert set(compared) == {baseline["run_id"], patched["run_id"]}
    assert not summary["compare"]["same_code"]
    # the human saw the patch before it shipped
    assert len(summary["approval_messages"]) == 2
    assert "max(0.0, " in summary["approval_messages"][1]
    assert summary["verdict"] == judge(summary["baseline_mean"], summary["patched_mean"])
    kept = patched if summary["verdict"] == "held" else baseline  # the decision was acted on
    assert summary["active_snapshot_after"] == kept["snapshot_id"]

    assert "[patched] step  2/2" in out
    assert f"{patched['run_id']} {patched['snapshot_id'][:12]}" in out  # the table row
    assert f"patched   code on the server: {patched['server_path']}" in out
    assert verdict_text(summary["verdict"], summary["baseline_mean"], summary["patched_mean"],
                        summary["window"]) in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
