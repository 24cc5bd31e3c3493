"""A scripted research agent that closes the AgentJet loop through the MCP bridge only.

    python examples/research_loop.py              # what `make demo` runs (under a minute)
    python examples/research_loop.py --steps 4 --plot /tmp/rewards.png --keep

It plays the part an LLM agent plays in the real case, on one machine, with nothing
running beforehand:

  0. copies the project's `ajet/` and the digits workflow into a throwaway git repository,
     starts a local swarm server on a free loopback port (`SwarmClient(...,
     auto_start_swarm_server=True)`) and `ajet-mcp --approval ask` as a stdio subprocess;
     from here on every action is an MCP tool call;
  1. baseline: `sync_train_code` (the unmodified copy), `configure` a small GRPO job on
     `ajet-tiny`, `start_engine`, `start_rollouts` with `examples/digits_workflow.py:workflow`
     (reward = share of digits in the reply), `read_metrics` until N steps are done;
  2. states a hypothesis and patches `ajet/engine/advantages.py` in the throwaway repo:
     keep only positive advantages (learn from better-than-average replies only, as in
     rejection-sampling fine-tuning);
  3. `sync_train_code` (dry run, then the real sync: the elicitation handler prints what a
     human approves and accepts), `start_engine`, `start_rollouts`, the same N steps;
  4. `compare_runs`, a table of both runs, a PNG of both reward curves, and the verdict,
     computed from the measured `log/digit_share` (never fixed in advance);
  5. acts on it: keeps the patch, or rolls back with `activate_snapshot`.

Both runs use the same seed and one rollout worker, so they sample the same first batch;
later differences come from the patch (and a little thread timing). Ctrl-C (or SIGTERM) stops the rollouts, the engine,
the bridge and the server before exiting; so does any error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp_types import ElicitRequestParams, ElicitResult

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(PROJECT_ROOT))

from ajet.client import SwarmClient  # noqa: E402
from ajet.protocol import EngineState  # noqa: E402

WORKFLOW = "examples/digits_workflow.py:workflow"
#: The task measure: share of digits in the reply, logged by the workflow itself, so it
#: does not depend on how the engine processes rewards or advantages.
METRIC = "log/digit_share"
#: A small GRPO job that learns visibly within about ten steps on a 2-core CPU.
#: lr is above the default (0.003) so the baseline's curve rises within the demo.
JOB: dict[str, Any] = {
    "experiment_name": "research_loop_demo",
    "model": "ajet-tiny",
    "batch_size": 2,
    "num_repeat": 8,
    "lr": 0.01,
    "max_new_tokens": 16,
    "seed": 0,
}
#: One worker: episodes run in a fixed order, so both runs draw the same random numbers
#: until their weights differ. More workers are faster but make runs less comparable.
N_WORKERS = 1
#: Differences in mean digit share smaller than this count as noise (one run each).
MARGIN = 0.03
STEP_TIMEOUT_S = 120.0
POLL_S = 0.5

HYPOTHESIS = (
    "Learning only from better-than-average replies (advantages clipped at 0, as in "
    "rejection-sampling fine-tuning) raises the digit share faster than GRPO: pushing "
    "down bad replies mostly adds noise."
)
NULL_HYPOTHESIS = (
    "The negative advantages carry half of GRPO's signal: without them the digit share "
    "rises more slowly."
)
PATCHED_MODULE = "ajet/engine/advantages.py"


# ---------------------------------------------------------------------------- output


class Console:
    """Status lines on stdout; `quiet` keeps only phase headers, the table and the verdict."""

    def __init__(self, *, quiet: bool, out: TextIO = sys.stdout) -> None:
        self.quiet = quiet
        self.out = out
        self.t0 = time.monotonic()

    def say(self, text: str = "", *, always: bool = False) -> None:
        if always or not self.quiet:
            print(text, file=self.out, flush=True)

    def phase(self, text: str) -> None:
        self.say(f"\n[{time.monotonic() - self.t0:5.1f}s] == {text}", always=True)

    def boxed(self, title: str, body: str, *, max_lines: int = 40) -> None:
        lines = [piece for line in body.rstrip().splitlines()
                 for piece in (textwrap.wrap(line, 92, subsequent_indent="    ") or [""])]
        if len(lines) > max_lines:
            lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines)"]
        self.say(f"  +-- {title} " + "-" * max(0, 70 - len(title)))
        for line in lines:
            self.say(f"  | {line}")
        self.say("  +" + "-" * 76)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = min(width, round(width * done / max(1, total)))
    return "[" + "#" * filled + "." * (width - filled) + "]"


# ---------------------------------------------------------------------------- setup


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.email=agent@example.com", "-c", "user.name=research-agent",
           "-c", "commit.gpgsign=false", "-C", str(repo), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def make_throwaway_repo(root: Path) -> Path:
    """A git repository with a committed copy of the project's ajet/ and the workflow."""
    root.mkdir(parents=True)
    shutil.copytree(PROJECT_ROOT / "ajet", root / "ajet",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / "examples").mkdir()
    shutil.copy2(PROJECT_ROOT / "examples" / "digits_workflow.py", root / "examples")
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "ajet", "examples")
    _git(root, "commit", "-q", "-m", "AgentJet as the research agent found it")
    return root


def patch_advantages(repo: Path) -> str:
    """Apply the hypothesis to the throwaway repo; returns `git diff` of the change."""
    path = repo / PATCHED_MODULE
    text = path.read_text(encoding="utf-8")
    # the assignment of each episode's normalised advantage inside grpo_advantages
    pattern = re.compile(r"^(?P<indent>[ \t]+)advantages\[i\] = (?P<expr>.+)$", re.MULTILINE)
    match = pattern.search(text)
    if match is None:
        raise RuntimeError(
            f"{PATCHED_MODULE} no longer assigns `advantages[i] = ...`; update "
            "patch_advantages in examples/research_loop.py to the module's new shape")
    indent = match["indent"]
    replacement = (
        f"{indent}# research_loop hypothesis: learn only from better-than-average episodes\n"
        f"{indent}# (rejection-sampling style); worse-than-average ones get advantage 0.\n"
        f"{indent}advantages[i] = max(0.0, {match['expr']})"
    )
    path.write_text(text[:match.start()] + replacement + text[match.end():], encoding="utf-8")
    return _git(repo, "diff", "--", PATCHED_MODULE)


def bridge_command() -> list[str]:
    """`ajet-mcp` next to this interpreter, else the module (same code either way)."""
    script = Path(sys.executable).with_name("ajet-mcp")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "mcp_bridge"]


# ---------------------------------------------------------------------------- the agent


class ToolFailed(RuntimeError):
    """An MCP tool returned an error; its text says what happened and what to call next."""


class Approver:
    """The human in the loop: shows what the bridge asks to approve, then accepts."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.shown: list[str] = []

    async def __call__(self, context: Any, params: ElicitRequestParams) -> ElicitResult:
        self.shown.append(params.message)
        self.console.say("  The bridge asks the human (MCP elicitation); the human sees:")
        self.console.boxed("approval request", params.message)
        self.console.say("  The human accepts.")
        return ElicitResult(action="accept", content={"approve": True})


@dataclass
class RunRecord:
    label: str
    run_id: str
    snapshot_id: str
    server_path: str
    ajet_file: str | None
    points: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0


class Agent:
    """Every action goes through one MCP session with the bridge."""

    def __init__(self, session: Client, console: Console) -> None:
        self.session = session
        self.console = console

    async def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        result = await self.session.call_tool(tool, arguments)
        if result.is_error:
            text = "".join(getattr(block, "text", "") for block in result.content)
            raise ToolFailed(f"{tool} failed: {text}")
        if result.structured_content is None:
            raise ToolFailed(f"{tool} returned no structured result")
        return dict(result.structured_content)

    async def sync(self, what: str) -> dict[str, Any]:
        """Preview, then sync with the human's approval; returns the synced result."""
        preview = await self.call("sync_train_code", dry_run=True)
        changed = preview["added"] + preview["changed"] + preview["removed"]
        files = (", ".join(changed) if len(changed) <= 3 and not preview["lists_truncated"]
                 else f"{preview['files_total']} files")
        self.console.say(f"  sync_train_code(dry_run=true), {what}: {files}; "
                         f"{preview['blobs_to_upload']} blob(s), "
                         f"{preview['bytes_to_upload']} bytes to upload")
        synced = await self.call("sync_train_code")
        if synced["status"] != "synced":
            raise ToolFailed(f"sync_train_code ended as {synced['status']}: {synced['message']}")
        self.console.say(f"  synced snapshot {synced['snapshot_id'][:12]} -> "
                         f"{synced['server_path']} ({synced['bytes_uploaded']} bytes uploaded, "
                         f"approval: {synced['approval']['status']})")
        return synced

    async def train(self, label: str, synced: dict[str, Any], steps: int) -> RunRecord:
        """start_engine, start_rollouts, read_metrics until `steps`, stop both."""
        started = await self.call("start_engine")
        self.console.say(f"  start_engine: run {started['run_id']} is {started['engine_state']}"
                         f" after {started['waited_s']} s; it imports ajet from "
                         f"{started.get('ajet_file')}")
        run = RunRecord(label=label, run_id=started["run_id"],
                        snapshot_id=synced["snapshot_id"], server_path=synced["server_path"],
                        ajet_file=started.get("ajet_file"))
        rollouts = await self.call("start_rollouts", workflow=WORKFLOW, n_workers=N_WORKERS)
        self.console.say(f"  start_rollouts: {rollouts['handle']}, {rollouts['n_workers']} "
                         f"worker(s), {rollouts['tasks']} tasks x {rollouts['num_repeat']}")
        t0 = last_progress = time.monotonic()
        engine_ended = False
        try:
            while len(run.points) < steps:
                if engine_ended:  # and the metrics read after it ended lack steps
                    await self._raise_engine_died(run, steps)
                await anyio.sleep(POLL_S)
                # the engine's state first: metrics read after it went OFFLINE are complete
                status = await self.call("engine_status")
                engine_ended = status["engine_state"] == EngineState.OFFLINE.value
                got = await self.call("read_metrics", run_id=run.run_id,
                                      metrics=["reward_mean", METRIC, "step_time_s"], last_n=5)
                new = [p for p in got["recent"]
                       if p["step"] not in run.points and p["step"] <= steps]
                for point in sorted(new, key=lambda p: p["step"]):
                    run.points[int(point["step"])] = point
                    last_progress = time.monotonic()
                    self.console.say(
                        f"  [{label}] step {point['step']:2d}/{steps} "
                        f"{progress_bar(len(run.points), steps)} reward "
                        f"{point.get('reward_mean', float('nan')):.3f}  digit share "
                        f"{point.get(METRIC, float('nan')):.3f}  "
                        f"({point.get('step_time_s', float('nan')):.1f} s/step)")
                if time.monotonic() - last_progress > STEP_TIMEOUT_S:
                    logs = await self.call("read_logs", run_id=run.run_id, tail=20)
                    raise ToolFailed(f"no new step in {STEP_TIMEOUT_S:.0f} s; engine log:\n"
                                     + "\n".join(logs["lines"]))
        finally:
            run.seconds = time.monotonic() - t0
        await self.call("stop_rollouts")
        stopped = await self.call("stop_engine", reason=f"{label}: {steps} steps done")
        self.console.say(f"  stop_rollouts, stop_engine: run {run.run_id} ended "
                         f"({stopped['engine_state']}); {steps} steps in {run.seconds:.0f} s")
        return run

    async def _raise_engine_died(self, run: RunRecord, steps: int) -> None:
        status = await self.call("engine_status")
        error = status.get("last_error") or {}
        logs = await self.call("read_logs", run_id=run.run_id, tail=20)
        raise ToolFailed(
            f"the engine of run {run.run_id} went OFFLINE after {len(run.points)} of {steps} "
            f"steps: {error.get('reason', 'no reason recorded')}; engine log:\n"
            + "\n".join(logs["lines"]))

    async def window_mean(self, run_id: str, last_n: int) -> float | None:
        got = await self.call("read_metrics", run_id=run_id, metrics=[METRIC], last_n=last_n)
        trend = got["trend"][0]
        return None if trend["mean"] is None else float(trend["mean"])


# ---------------------------------------------------------------------------- judging


def judge(baseline: float | None, patched: float | None, *, margin: float = MARGIN) -> str:
    """'held', 'rejected' or 'inconclusive' for the patch's hypothesis, from two means."""
    if baseline is None or patched is None:
        return "inconclusive"
    if patched - baseline > margin:
        return "held"
    if baseline - patched > margin:
        return "rejected"
    return "inconclusive"


def verdict_text(verdict: str, baseline: float | None, patched: float | None,
                 window: int) -> str:
    """Two lines: which hypothesis held, and the numbers it rests on."""
    if baseline is None or patched is None:
        return "Verdict: none; a run has no digit share values (read_logs tells why)."
    numbers = (f"  mean {METRIC} over the last {window} step(s): baseline {baseline:.3f}, "
               f"patched {patched:.3f} ({patched - baseline:+.3f})")
    if verdict == "held":
        head = "Verdict: the hypothesis HELD: with positive advantages only, learning was faster."
    elif verdict == "rejected":
        head = ("Verdict: the null hypothesis HELD: without negative advantages, learning was "
                "slower.")
    else:
        head = (f"Verdict: neither held: the difference is within +-{MARGIN}, noise for one "
                "run each.")
    return f"{head}\n{numbers}"


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"


def results_table(runs: list[RunRecord], compared: dict[str, Any], means: list[float | None],
                  job: dict[str, Any], steps: int, window: int) -> str:
    """Both runs side by side: code snapshot, reward first/last/best, the verdict's mean."""
    rows = {r["run_id"]: r for r in compared["runs"]}
    config = (f"{job['model']}, batch {job['batch_size']}x{job['num_repeat']}, lr {job['lr']}, "
              f"max_new_tokens {job['max_new_tokens']}, seed {job['seed']}, {steps} steps, "
              f"{N_WORKERS} rollout worker{'s' if N_WORKERS > 1 else ''}")
    differs = ", ".join(compared["config_differences"]) or "none"
    span = f"steps {steps - window + 1}-{steps}" if window > 1 else f"step {steps}"
    head = (f"{'run':9} {'run id':22} {'snapshot':12} {'reward first':>12} {'last':>6} "
            f"{'best':>6} {'@step':>5}   digit share, mean of {span}")
    lines = [f"config of both runs: {config}", f"config differences: {differs}", "", head,
             "-" * len(head)]
    for run, mean in zip(runs, means, strict=True):
        row = rows.get(run.run_id, {})
        lines.append(f"{run.label:9} {run.run_id:22} {run.snapshot_id[:12]:12} "
                     f"{_fmt(row.get('first')):>12} {_fmt(row.get('last')):>6} "
                     f"{_fmt(row.get('best')):>6} {row.get('best_step') or '-':>5}   "
                     f"{_fmt(mean)}")
    lines.append("")
    for run in runs:
        lines.append(f"{run.label:9} code on the server: {run.server_path}")
    return "\n".join(lines)


def write_plot(runs: list[RunRecord], path: Path) -> None:
    """Both reward curves (reward_mean per step) in one PNG, without a display."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    ax = fig.subplots()
    from matplotlib.ticker import MaxNLocator

    for run, what in zip(runs, ("GRPO", "positive advantages only"), strict=False):
        steps = sorted(run.points)
        ax.plot(steps, [run.points[s].get("reward_mean") for s in steps], marker="o",
                label=f"{run.label}: {what} (snapshot {run.snapshot_id[:8]})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean (digit share)")
    ax.set_title("ajet-tiny on the digits task: GRPO vs. positive advantages only")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


# ---------------------------------------------------------------------------- the loop


def _cancel_on_signals(console: Console) -> None:
    """Ctrl-C and SIGTERM cancel the loop once; the finally blocks then clean up."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is None:
        raise RuntimeError("_cancel_on_signals must run inside asyncio.run")

    def on_signal() -> None:
        if task.cancelling():
            console.say("  still stopping rollouts, engine, bridge and server...", always=True)
        else:
            console.say("\n  interrupted: stopping rollouts, engine, bridge and server",
                        always=True)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


async def research_loop(args: argparse.Namespace, console: Console, root: Path) -> dict[str, Any]:
    _cancel_on_signals(console)
    console.phase("setting up: a throwaway repository, a local swarm server, the MCP bridge")
    repo = make_throwaway_repo(root / "repo")
    console.say(f"  repository: {repo} (a committed copy of ajet/ and the digits workflow)")
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{free_port()}"
    swarm = SwarmClient(url, token=token, auto_start_swarm_server=True,
                        swarm_workdir=root / "swarm", server_start_timeout=60.0)
    try:
        console.say(f"  swarm server: {url} (pid {swarm.started_server_pid}, "
                    f"workdir {root / 'swarm'})")
        params = StdioServerParameters(
            command=bridge_command()[0],
            args=[*bridge_command()[1:], "--swarm-url", url, "--repo", str(repo), "--approval",
                  "ask", "--approvals-dir", str(root / "approvals"), "--log-level", "WARNING"],
            env={"AJET_SWARM_TOKEN": token},
        )
        approver = Approver(console)
        # A tool error is kept and raised after the session closed: raised inside it, the
        # client's task group would wrap it in an exception group.
        failure: ToolFailed | None = None
        summary: dict[str, Any] = {}
        with open(root / "ajet-mcp.log", "w", encoding="utf-8") as bridge_log:
            async with Client(stdio_client(params, errlog=bridge_log),
                              elicitation_callback=approver) as session:
                tools = sorted(t.name for t in (await session.list_tools()).tools)
                console.say(f"  ajet-mcp over stdio: {len(tools)} tools ({', '.join(tools)})")
                agent = Agent(session, console)
                try:
                    summary = await _loop(agent, args, console, repo, approver)
                except ToolFailed as exc:
                    failure = exc
                finally:
                    # whatever happened: no rollouts, no engine (shielded from Ctrl-C)
                    with anyio.move_on_after(30, shield=True):
                        for tool in ("stop_rollouts", "stop_engine"):
                            try:
                                await agent.call(tool)
                            except Exception as exc:  # best effort; the server stops next
                                console.say(f"  cleanup: {tool}: {exc}", always=True)
        if failure is not None:
            raise failure
        return summary
    finally:
        swarm.close()  # stops the server, which stops any engine it still runs


async def _loop(agent: Agent, args: argparse.Namespace, console: Console, repo: Path,
                approver: Approver) -> dict[str, Any]:
    steps = args.steps
    status = await agent.call("engine_status")
    console.say(f"  engine_status: {status['engine_state']}, snapshot {status['snapshot_id']}")

    console.phase(f"1. baseline: sync the unmodified code, configure, train {steps} steps")
    baseline_sync = await agent.sync("the unmodified copy of ajet/")
    # max_steps: the engine ends the run by itself after exactly `steps` updates
    job = {**JOB, "max_steps": steps}
    configured = await agent.call("configure", **job)
    console.say(f"  configure: {configured['message']}")
    baseline = await agent.train("baseline", baseline_sync, steps)

    console.phase("2. hypothesis and patch")
    console.say(textwrap.fill(f"Hypothesis: {HYPOTHESIS}", 96, initial_indent="  ",
                              subsequent_indent="    "))
    console.say(textwrap.fill(f"Null: {NULL_HYPOTHESIS}", 96, initial_indent="  ",
                              subsequent_indent="    "))
    console.say(textwrap.fill(f"Judged by {METRIC} (the raw task measure, untouched by "
                              "advantage processing), averaged over the last half of the "
                              "steps.", 96, initial_indent="  ", subsequent_indent="    "))
    original = (repo / PATCHED_MODULE).read_text(encoding="utf-8")
    diff = patch_advantages(repo)
    console.say(f"  patched {PATCHED_MODULE} in {repo} ({diff.count(chr(10))} diff lines)")

    console.phase("3. sync the patch (a human approves), restart, train the same steps")
    patched_sync = await agent.sync("the patch")
    if patched_sync["snapshot_id"] == baseline_sync["snapshot_id"]:
        raise ToolFailed("the patched snapshot equals the baseline's: the patch did not ship")
    patched = await agent.train("patched", patched_sync, steps)

    console.phase("4. compare_runs, table, plot, verdict")
    compared = await agent.call("compare_runs", run_ids=[baseline.run_id, patched.run_id],
                                metric="reward_mean")
    window = max(1, steps // 2)
    base_mean = await agent.window_mean(baseline.run_id, window)
    patch_mean = await agent.window_mean(patched.run_id, window)
    verdict = judge(base_mean, patch_mean)
    console.say(results_table([baseline, patched], compared, [base_mean, patch_mean], job,
                              steps, window), always=True)
    plot_path = Path(args.plot).resolve()
    write_plot([baseline, patched], plot_path)
    console.say(f"\nreward curves of both runs: {plot_path}", always=True)
    console.say(verdict_text(verdict, base_mean, patch_mean, window), always=True)

    console.phase("5. decision")
    if verdict == "held":
        console.say(f"Decision: keep the patch; snapshot {patched.snapshot_id[:12]} stays "
                    "active.", always=True)
    else:
        # not better: roll the cluster back to the baseline's code (no upload, no approval)
        # and the repository with it
        back = await agent.call("activate_snapshot", snapshot_id=baseline.snapshot_id)
        (repo / PATCHED_MODULE).write_text(original, encoding="utf-8")
        console.say(f"Decision: roll back. activate_snapshot: {back['message']}", always=True)
        console.say(f"  {PATCHED_MODULE} restored in the repository.", always=True)
    return {
        "verdict": verdict,
        "active_snapshot_after": (await agent.call("engine_status"))["snapshot_id"],
        "metric": METRIC,
        "window": window,
        "baseline_mean": base_mean,
        "patched_mean": patch_mean,
        "plot": str(plot_path),
        "approval_messages": approver.shown,
        "compare": compared,
        "runs": [{"label": r.label, "run_id": r.run_id, "snapshot_id": r.snapshot_id,
                  "server_path": r.server_path, "ajet_file": r.ajet_file,
                  "steps": sorted(r.points),
                  "reward_mean": [r.points[s].get("reward_mean") for s in sorted(r.points)],
                  "seconds": round(r.seconds, 1)} for r in (baseline, patched)],
    }


# ---------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12,
                   help="training steps per run (default: 12)")
    p.add_argument("--plot", default="demo_rewards.png",
                   help="where to write the PNG of both reward curves (default: "
                        "./demo_rewards.png)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="put the throwaway repo, server workdir and logs here (kept); "
                        "default: a temporary directory, removed at the end")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary directory (repo, server workdir, engine logs)")
    p.add_argument("--summary-json", type=Path, default=None,
                   help="also write the results (run ids, snapshots, numbers) as JSON here")
    p.add_argument("--quiet", action="store_true",
                   help="print only phase headers, the table and the verdict")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    console = Console(quiet=args.quiet)
    if args.workdir is not None:
        root = args.workdir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            raise SystemExit(f"--workdir {root} is not empty; pass an empty or new directory")
        keep = True
    else:
        root = Path(tempfile.mkdtemp(prefix="ajet-research-loop-"))
        keep = args.keep
    code = 1
    try:
        summary = asyncio.run(research_loop(args, console, root))
        if args.summary_json is not None:
            args.summary_json.write_text(json.dumps(summary, indent=1), encoding="utf-8")
        console.phase(f"done in {time.monotonic() - console.t0:.0f} s; nothing left running")
        code = 0
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.say("interrupted: rollouts, engine, bridge and server were stopped",
                    always=True)
        code = 130
    except ToolFailed as exc:
        console.say(f"\nerror: {exc}", always=True)
        keep = True  # the engine and server logs explain it
    finally:
        if keep:
            console.say(f"kept {root} (repo/, swarm/ with runs and engine logs, "
                        "ajet-mcp.log)", always=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
