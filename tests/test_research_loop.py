"""`examples/research_loop.py` (what `make demo` runs): the whole loop, shortened.

The slow tests run the real program as `make demo` does, with 1 step per run instead of
12 and 4 episodes per task: a real swarm server it starts itself, the real engine,
`ajet-mcp` over stdio, a throwaway git repo. They check what a newcomer is promised:
exit 0; a baseline and three ideas, the first two side by side (two named runs at once
on disjoint device slots of a `--devices 2` server), the third killing the engine; the
recovery chosen from what the tools said (engine_status, a literal read_logs search,
activate_snapshot to the best run's snapshot, a restart that trains); the best run's
code and config active at the end, as a fresh server on the same work directory
reports; the human's approvals; every tool result within 8 KB; the plot and the report;
no process left.

`--margin 1` makes every idea "not better than noise", so the agent must undo each one:
the test then knows the best run (the baseline) in advance and fails if the undo or the
recovery is removed. The verdicts are still computed from the measured metric.

The fast tests pin the parts the demo's conclusions rest on: the edits really change
the advantages and really crash at the first update, the agent reads real tracebacks,
and the verdict follows the numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ajet.client import SwarmClient
from examples.research_agent.agent import error_line, failing_frame, next_calls
from examples.research_agent.judging import MARGIN, judge, verdict_text
from examples.research_agent.lab import make_throwaway_repo, patch_advantages, patch_rewards
from mcp_bridge.models import ToolName
from tests.support import PROJECT_ROOT, start_server

DEMO = PROJECT_ROOT / "examples" / "research_loop.py"
TOOLS = {t.value for t in ToolName}
LABELS = ["baseline", "1-positive-advantages", "2-double-lr", "3-sqrt-rewards", "restart"]


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


# ---------------------------------------------------------------------------- fast


def test_patch_drops_negative_advantages(tmp_path: Path) -> None:
    repo = make_throwaway_repo(tmp_path / "repo", PROJECT_ROOT)
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


def test_rewards_patch_imports_then_fails_at_the_first_update_and_is_read_back(
        tmp_path: Path) -> None:
    repo = make_throwaway_repo(tmp_path / "repo", PROJECT_ROOT)
    assert _load(repo / "ajet/engine/rewards.py", "rew_before").process_rewards([0.5]) == [0.5]

    diff = patch_rewards(repo)

    assert "+        out.append(math.isqrt(reward))" in diff
    module = _load(repo / "ajet/engine/rewards.py", "rew_after")  # the engine boots with it
    with pytest.raises(TypeError) as info:
        module.process_rewards([0.25, 0.5])  # what the trainer calls on the first batch
    # what the agent reads in the engine log: the error line and the innermost ajet/ frame
    lines = "".join(traceback.format_exception(info.value)).splitlines()
    assert error_line(lines) == "TypeError: 'float' object cannot be interpreted as an integer"
    path, line, func = failing_frame(lines) or ("", 0, "")
    assert (path, func) == ("ajet/engine/rewards.py", "process_rewards")
    assert "math.isqrt(reward)" in (repo / path).read_text().splitlines()[line - 1]


def test_next_calls_follow_the_message_after_next() -> None:
    said = ("Engine is ENGINE.OFFLINE; the last run failed: boom. Next: read last_error and "
            "read_logs with grep='Traceback'; then fix the code and sync_train_code, or roll "
            "back with activate_snapshot (list_runs shows each run's); then start_engine.")
    assert next_calls(said, TOOLS) == ["read_logs", "sync_train_code", "activate_snapshot",
                                       "list_runs", "start_engine"]
    assert next_calls("start_engine failed without a next step", TOOLS) == []


def test_verdict_follows_the_numbers() -> None:
    assert judge(0.40, 0.40 + MARGIN + 0.01) == "held"
    assert judge(0.40, 0.40 - MARGIN - 0.01) == "rejected"
    assert judge(0.40, 0.40 + MARGIN / 2) == "inconclusive"
    assert judge(None, 0.5) == "inconclusive"
    assert judge(0.0, 1.0, margin=1.0) == "inconclusive"  # what the slow tests rely on
    assert "HELD" in verdict_text("held", best_label="baseline", best=0.4, new=0.5, window=2)


# ---------------------------------------------------------------------------- slow


def _run_demo(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str, Path]:
    workdir = tmp_path / "demo"
    plot = tmp_path / "out" / "rewards.png"
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "1", "--set", "num_repeat=4", "--margin", "1",
         "--workdir", str(workdir), "--plot", str(plot), "--summary-json", str(summary_path),
         *extra],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    leftovers = _processes_mentioning(str(workdir))
    assert not leftovers, leftovers
    return json.loads(summary_path.read_text()), out, workdir


def _active_on_a_fresh_server(workdir: Path) -> tuple[str, dict[str, Any]]:
    """What the server's own records say is active: snapshot id and stored config."""
    handle = start_server(workdir / "swarm")
    try:
        with SwarmClient(handle.url) as client:
            stored = client.get_train_config()
            assert stored is not None
            return client.engine_status().snapshot_id, stored.config
    finally:
        handle.stop()


def _check_recovery(summary: dict[str, Any], workdir: Path) -> None:
    runs = {r["label"]: r for r in summary["runs"]}
    base, failed, restart = runs["baseline"], runs["3-sqrt-rewards"], runs["restart"]
    # the broken idea shipped (its snapshot holds the slip) and its engine died
    snapshot_dir = workdir / "swarm" / failed["server_path"]
    assert "math.isqrt(reward)" in (snapshot_dir / "engine/rewards.py").read_text()
    assert failed["status"] == "failed" and failed["verdict"] == "failed"
    fail = failed["failure"]
    assert fail["error_name"] == "TypeError" and fail["grep"] == "TypeError"
    assert any("TypeError" in line for line in fail["log_lines"])  # read_logs found it
    assert fail["where"][0] == "ajet/engine/rewards.py" and "isqrt" in fail["source"]
    # the recovery, in the order the tools named it, back to the best run's snapshot
    (recovery,) = summary["recoveries"]
    calls = recovery["calls"]
    assert calls[0] == "engine_status()"
    order = [next(i for i, c in enumerate(calls) if c.startswith(prefix)) for prefix in (
        f"read_logs(run_id={failed['run_id']!r}, grep='TypeError'",
        f"activate_snapshot(snapshot_id={base['snapshot_id'][:16]!r}", "start_engine()",
        "start_rollouts(")]
    assert order == sorted(order), calls
    assert recovery["rolled_back_to"] == base["snapshot_id"]
    # the restart trained on that code
    assert restart["status"] == "ended" and restart["steps"] == [1]
    assert restart["snapshot_id"] == base["snapshot_id"]
    assert summary["runs"].index(restart) == summary["runs"].index(failed) + 1


def _check_tool_results(summary: dict[str, Any]) -> None:
    calls = summary["tool_calls"]
    largest = max(calls, key=lambda c: c["bytes"])
    assert largest["bytes"] <= 8 * 1024, largest
    for call in calls:
        if call["error"]:
            assert call["next_calls"], call  # every error result names the next call


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks leftovers through /proc")
def test_demo_runs_three_ideas_recovers_keeps_the_best_and_reports(tmp_path: Path) -> None:
    summary, out, workdir = _run_demo(tmp_path)

    runs = {r["label"]: r for r in summary["runs"]}
    assert [r["label"] for r in summary["runs"]] == LABELS
    base = runs["baseline"]
    for run in summary["runs"]:  # the table has every run
        assert f"{run['label']:21} {run['run_id']} {run['snapshot_id'][:12]}" in out
    # every verdict comes from the measured means (margin 1: none beats the noise)
    for label in LABELS[1:3]:
        run = runs[label]
        assert run["verdict"] == judge(base["mean"], run["mean"], margin=1.0) == "inconclusive"
    assert runs["1-positive-advantages"]["snapshot_id"] != base["snapshot_id"]
    assert runs["2-double-lr"]["config"]["lr"] == 2 * base["config"]["lr"]
    # ideas 1 and 2 trained at once: two named runs, each on device slots of its own, the
    # code idea pinned to its own snapshot and the config idea to the baseline's
    one, two = runs["1-positive-advantages"], runs["2-double-lr"]
    pair = next(o for o in summary["side_by_side"]
                if sorted(o["runs"]) == ["1-positive-advantages", "2-double-lr"])
    assert pair["seconds"] > 0
    assert one["devices"] and two["devices"] and not set(one["devices"]) & set(two["devices"])
    assert [r["name"] for r in summary["compare"]["runs"][1:3]] == [one["label"], two["label"]]
    assert "  start_engine(name='2-double-lr'): run " in out
    # keep the best: idea 2 ran on the baseline's code (not idea 1's, active after its
    # sync), idea 1's code and idea 2's config were undone before idea 3 ran, and the
    # baseline's code and config are what the server has active now
    assert runs["2-double-lr"]["snapshot_id"] == base["snapshot_id"]
    assert runs["3-sqrt-rewards"]["config"] == base["config"]
    assert summary["best"] == "baseline" and summary["best_config"] == base["config"]
    assert summary["active_snapshot_after"] == base["snapshot_id"]
    assert _active_on_a_fresh_server(workdir) == (base["snapshot_id"], base["config"])

    _check_recovery(summary, workdir)
    assert "recovery: the engine of run" in out and "[restart] step  1/1" in out
    # the human saw each code change before it shipped
    shown = [a["shown"] for a in summary["approvals"]]
    assert [a["how"] for a in summary["approvals"]] == ["elicitation"] * 3
    assert "max(0.0, " in shown[1] and "math.isqrt(reward)" in shown[2]
    _check_tool_results(summary)

    plot, report = Path(summary["plot"]), Path(summary["report"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report == plot.with_name("demo_report.md")
    text = report.read_text()
    for needle in ("## In short", "## Runs", "![digit share of every run](rewards.png)",
                   "### The recovery, call by call", "## Approvals", "## Tool results",
                   "## Side by side", "- `1-positive-advantages` and `2-double-lr` ran at "
                   "the same time for",
                   "TypeError", "**The best run is `baseline`**"):
        assert needle in text, needle
    for run in summary["runs"]:
        assert f"`{run['run_id']}`" in text and f"`{run['snapshot_id'][:12]}`" in text
    # the size of every tool result, call by call
    for i, call in enumerate(summary["tool_calls"], 1):
        assert f"| {i} | `{call['tool']}(" in text and f"` | {call['bytes']} |" in text


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks leftovers through /proc")
def test_demo_against_approvers_shows_pending_and_approves_with_the_cli(tmp_path: Path) -> None:
    # the baseline only (one engine run): the approval path is the same for every sync
    summary, out, _ = _run_demo(tmp_path, "--approvers", "--ideas", "none")

    (base,) = summary["runs"]
    assert summary["enforcing"] and base["status"] == "ended" and base["steps"] == [1]
    # pending on the server, shown with where to approve; the approver's CLI; synced
    assert "sync_train_code: pending_approval. Uploaded; the server stores snapshot" in out
    assert f"pending on the server: {base['snapshot_id'][:12]}" in out
    assert f"`ajet-swarm approvals approve {base['snapshot_id']}`" in out  # the full id
    assert f"Snapshot {base['snapshot_id'][:12]} approved by demo-approver" in out
    assert [a["how"] for a in summary["approvals"]] == ["server approver CLI"]
    assert summary["approvals"][0]["shown"].startswith(f"Snapshot {base['snapshot_id']}: pending")
    assert summary["active_snapshot_after"] == base["snapshot_id"]
    _check_tool_results(summary)
