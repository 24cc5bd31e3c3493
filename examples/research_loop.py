"""A scripted research agent that closes the AgentJet loop through the MCP bridge only.

    python examples/research_loop.py              # what `make demo` runs
    python examples/research_loop.py --approvers  # the server enforces approvals
    python examples/research_loop.py --steps 4 --plot /tmp/rewards.png --keep

It plays the part an LLM agent plays in the real case, on one machine, with nothing
running beforehand:

  0. copies the project's `ajet/` and the digits workflow into a throwaway git repository,
     starts a local swarm server with two device slots (`--devices 2`, as
     `AJET_SWARM_DEVICES=2`) on a free loopback port (`SwarmClient(...,
     auto_start_swarm_server=True)`) and `ajet-mcp --approval ask` as a stdio subprocess;
     from here on every action on the cluster is an MCP tool call;
  1. baseline: `sync_train_code` (the unmodified copy), `configure` a small GRPO job on
     `ajet-tiny`, `start_engine`, `start_rollouts` with `examples/digits_workflow.py:workflow`
     (reward = share of digits in the reply), `read_metrics` until N steps are done;
  2. three ideas, each with a hypothesis and judged against the best run before it by
     the measured `log/digit_share` (never fixed in advance):
       a. a code patch: keep only positive advantages (`ajet/engine/advantages.py`);
       b. a config change alone (twice the learning rate), no sync;
       c. a code patch with a slip (`math.isqrt` in `ajet/engine/rewards.py`) that kills
          the engine at its first update;
     a and b train at the same time, as two named runs on a device slot each: a is
     synced and its run pinned to that snapshot id (`start_engine(name=...,
     snapshot_id=...)`), b's run is pinned to the baseline's snapshot with its changed
     field (`start_engine(name=..., config={'lr': ...})`); the agent polls both
     (`engine_status`, `read_metrics` with `run_id`) and stops each once it has N steps.
     Then c, alone on the default run. A change that does not beat the best run is
     undone: `activate_snapshot` for code, `configure` for config; of a and b, the one
     that beat the baseline by more is kept;
  3. the recovery from c, chosen from what the tools say: `engine_status` (state,
     `last_error`, log tail), `read_logs` with a literal search, `stop_rollouts`,
     `list_runs`, `activate_snapshot` to the best run's snapshot, `start_engine`, and a
     run that trains one step past the one that crashed;
  4. keep the best: the best run's snapshot and config are made (and checked) active;
  5. `compare_runs` of every run, a table, a PNG of every run's curve and
     `demo_report.md` for the human: hypotheses, snapshots, config differences,
     verdicts, which runs ran side by side (how long, on which device slots), the crash
     and the recovery, the approvals, the size of every tool result.

Each sync is approved by the human: through MCP elicitation (printed, then accepted), or
with `--approvers` on the server (the pending state is shown, then the human runs
`ajet-swarm approvals approve` with their own approver token). Every run uses the same
seed and one rollout worker, so runs start from the same first batch. Ctrl-C (or
SIGTERM) stops the rollouts, the engine, the bridge and the server before exiting; so
does any error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import yaml
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(PROJECT_ROOT))

from ajet.client import SwarmClient  # noqa: E402
from examples.research_agent.agent import Agent, Human, ToolFailed  # noqa: E402
from examples.research_agent.console import Console  # noqa: E402
from examples.research_agent.judging import (  # noqa: E402
    MARGIN,
    METRIC,
    Recovery,
    RunRecord,
    Study,
    judge,
    verdict_text,
)
from examples.research_agent.lab import (  # noqa: E402
    IDEAS,
    Idea,
    keep_edit,
    make_throwaway_repo,
    revert_edit,
)
from examples.research_agent.report import (  # noqa: E402
    LoopResult,
    results_table,
    write_plot,
    write_report,
)

WORKFLOW = "examples/digits_workflow.py:workflow"
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
#: One worker: episodes run in a fixed order, so runs draw the same random numbers
#: until their weights differ. More workers are faster but make runs less comparable.
N_WORKERS = 1
#: The ideas that train at once, as two named runs (the crash is shown on its own).
SIDE_BY_SIDE = ("positive-advantages", "double-lr")
#: Device slots of the demo's server (`--devices 2`): one per side-by-side run.
DEVICES = 2
APPROVER_NAME = "demo-approver"


# ---------------------------------------------------------------------------- setup


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bridge_command() -> list[str]:
    """`ajet-mcp` next to this interpreter, else the module (same code either way)."""
    script = Path(sys.executable).with_name("ajet-mcp")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "mcp_bridge"]


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
    repo = make_throwaway_repo(root / "repo", PROJECT_ROOT)
    console.say(f"  repository: {repo} (a committed copy of ajet/ and the digits workflow)")
    token = secrets.token_hex(16)
    approver_token = secrets.token_hex(16) if args.approvers else None
    url = f"http://127.0.0.1:{free_port()}"
    # The approver list is set either way, so one in the caller's environment does not
    # switch enforcement on behind the flag's back.
    server_env = {"AJET_SWARM_TOKEN": token, "AJET_SWARM_APPROVER_TOKENS":
                  f"{APPROVER_NAME}={approver_token}" if approver_token else "",
                  "AJET_SWARM_DEVICES": str(DEVICES)}
    swarm = SwarmClient(url, token=token, auto_start_swarm_server=True,
                        swarm_workdir=root / "swarm", server_start_timeout=60.0,
                        server_env=server_env)
    try:
        console.say(f"  swarm server: {url} (pid {swarm.started_server_pid}, workdir "
                    f"{root / 'swarm'}" + (f", approver {APPROVER_NAME!r} with its own token"
                                           if approver_token else "") + ")")
        params = StdioServerParameters(
            command=bridge_command()[0],
            args=[*bridge_command()[1:], "--swarm-url", url, "--repo", str(repo), "--approval",
                  "ask", "--approvals-dir", str(root / "approvals"), "--log-level", "WARNING"],
            env={"AJET_SWARM_TOKEN": token},
        )
        human = Human(console, url, approver_token=approver_token)
        # A tool error is kept and raised after the session closed: raised inside it, the
        # client's task group would wrap it in an exception group.
        failure: ToolFailed | None = None
        summary: dict[str, Any] = {}
        # Against approvers the client declares no elicitation, so the sync answers
        # pending_approval and the demo shows that state; otherwise the bridge asks here.
        elicit = None if human.enforcing else human.elicited
        with open(root / "ajet-mcp.log", "w", encoding="utf-8") as bridge_log:
            async with Client(stdio_client(params, errlog=bridge_log),
                              elicitation_callback=elicit) as session:
                tools = sorted(t.name for t in (await session.list_tools()).tools)
                console.say(f"  ajet-mcp over stdio: {len(tools)} tools ({', '.join(tools)})")
                agent = Agent(session, console, human, tools)
                try:
                    summary = await _loop(agent, args, console, repo)
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


# ---------------------------------------------------------------------------- the loop


async def _loop(agent: Agent, args: argparse.Namespace, console: Console,
                repo: Path) -> dict[str, Any]:
    steps, margin = args.steps, args.margin
    window = max(1, steps // 2)
    study = Study()
    status = await agent.call("engine_status")
    console.say(f"  engine_status: {status['engine_state']}, snapshot {status['snapshot_id']}, "
                f"approvals enforced by the server: {status['approvals_enforced']}")

    console.phase(f"baseline: sync the unmodified code, configure, train {steps} steps")
    synced = await agent.sync("the unmodified copy of ajet/")
    # max_steps: the engine ends the run by itself after exactly `steps` updates
    configured = await agent.call("configure", **{**args.job, "max_steps": steps})
    console.say(f"  configure: {configured['message']}")
    config: dict[str, Any] = configured["config"]  # what the next start uses, as the server says
    base = RunRecord(label="baseline", idea=None, approval=synced["approval_text"],
                     server_path=synced["server_path"], config=config)
    await _train(agent, base, steps)
    if base.failed:
        raise ToolFailed(f"the baseline run failed: {base.failure}; nothing to compare with")
    base.mean = await agent.window_mean(base.run_id, window)
    study.add(base)
    study.best = base
    console.say(f"  baseline: mean {METRIC} over the last {window} step(s) {base.mean:.3f}",
                always=True)

    # The code idea and the config idea train at once, as two named runs on their own
    # device slots; the crashing idea then runs alone on the default run, as a recovery
    # from a dead engine is shown best with nothing else running.
    together = [i for i in args.ideas if i.key in SIDE_BY_SIDE]
    for idea in args.ideas:
        if len(together) > 1 and idea in together:
            if idea is together[0]:
                config = await _side_by_side(agent, study, together, repo, steps, window,
                                             margin, config)
            continue
        config = await _one_idea(agent, study, idea, repo, steps, window, margin, config)

    console.phase("keep the best: the best run's snapshot and config stay active")
    best = study.the_best()
    sentence, config = await keep_best(agent, study, config, final=True)
    console.say(f"  {sentence}", always=True)

    console.phase("compare_runs, table, plot, report")
    compared = await _compare(agent, study)
    result = LoopResult(study=study, compared=compared, calls=agent.calls,
                        approvals=agent.human.approvals, job=args.job, steps=steps,
                        window=window,
                        margin=margin, n_workers=N_WORKERS, enforcing=agent.human.enforcing,
                        # keep_best checked both against engine_status and configure
                        final_snapshot=best.snapshot_id, final_config=config,
                        seconds=console.elapsed(), plot=Path(args.plot).resolve())
    console.say(results_table(result), always=True)
    write_plot(study, result.plot)
    report = Path(args.report).resolve() if args.report else result.plot.with_name(
        "demo_report.md")
    write_report(result, report)
    largest = max(agent.calls, key=lambda c: c.bytes)
    console.say(f"\nevery run's curve: {result.plot}\nthe report for the human: {report}\n"
                f"{len(agent.calls)} tool calls; the largest result {largest.bytes} bytes "
                f"({largest.tool}); {sum(c.error for c in agent.calls)} error result(s)",
                always=True)
    return _summary(result, report)


async def _one_idea(agent: Agent, study: Study, idea: Idea, repo: Path, steps: int,
                    window: int, margin: float, config: dict[str, Any]) -> dict[str, Any]:
    """One idea on the default run, judged against the best run so far; the config now."""
    console = agent.console
    n = IDEAS.index(idea) + 1
    best = study.the_best()
    console.phase(f"idea {n} of {len(IDEAS)}, {idea.title}; the best so far: {best.label}")
    console.wrapped(f"Hypothesis: {idea.hypothesis}")
    console.wrapped(f"Null: {idea.null}")
    console.wrapped(f"Judged by {METRIC} (the raw task measure, untouched by reward or "
                    f"advantage processing), the mean over the last {window} step(s), "
                    f"against {best.label}'s {best.mean:.3f}; a difference under {margin} "
                    "is noise.")
    run = RunRecord(label=f"{n}-{idea.key}", idea=idea, config=config)
    if idea.kind == "code" and idea.edit is not None:
        run.diff = idea.edit(repo)
        console.say(f"  edited {idea.module} in the repository "
                    f"({run.diff.count(chr(10))} diff lines)")
        synced = await agent.sync(f"idea {n}")
        run.approval, run.server_path = synced["approval_text"], synced["server_path"]
    elif idea.change is not None:
        run.config_change = idea.change(best.config)
        configured = await agent.call("configure", **run.config_change)
        console.say(f"  configure (no sync; the code stays {best.snapshot_id[:12]}): "
                    f"{configured['message']}")
        config = run.config = configured["config"]
    await _train(agent, run, steps)
    study.add(run)
    if run.failed:
        return await _recover(agent, study, run, repo, steps, config)
    run.mean = await agent.window_mean(run.run_id, window)
    run.compared_with = best.label
    run.verdict = judge(best.mean, run.mean, margin=margin)
    console.say(verdict_text(run.verdict, best_label=best.label, best=best.mean,
                             new=run.mean, window=window, margin=margin), always=True)
    if run.verdict == "held":
        study.best = run
        if idea.module:
            keep_edit(repo, idea.module, f"keep: {idea.title}")
        run.decision = (f"Kept: {run.label} is the new best run (snapshot "
                        f"{run.snapshot_id[:12]}, lr {run.config.get('lr')}).")
    else:
        run.decision, config = await keep_best(agent, study, config)
        if idea.module:
            revert_edit(repo, idea.module)
            run.decision += f" It undid the edit of {idea.module} in its repository."
    console.say(f"Decision: {run.decision}", always=True)
    return config


async def _side_by_side(agent: Agent, study: Study, ideas: list[Idea], repo: Path, steps: int,
                        window: int, margin: float, config: dict[str, Any]) -> dict[str, Any]:
    """Ideas that train at once, each a named run judged against the best run before them.

    A code idea is synced (its snapshot becomes the active one) and its run is pinned to
    that snapshot id; a config idea's run is pinned to the best run's snapshot with its
    changed fields (`start_engine(config=...)`), so the stored config stays the best
    run's. Afterwards the best of the runs that beat the baseline by more than the margin
    is kept, and everything else is undone. Returns the config now stored.
    """
    console = agent.console
    best = study.the_best()
    numbers = [IDEAS.index(i) + 1 for i in ideas]
    console.phase(f"ideas {' and '.join(map(str, numbers))} of {len(IDEAS)} side by side, "
                  f"two named runs on their own device slots; the best so far: {best.label}")
    pairs: list[tuple[RunRecord, dict[str, Any]]] = []
    for n, idea in zip(numbers, ideas, strict=True):
        console.wrapped(f"Idea {n}, {idea.title}. Hypothesis: {idea.hypothesis}")
        console.wrapped(f"Null: {idea.null}")
        run = RunRecord(label=f"{n}-{idea.key}", idea=idea, config=config)
        if idea.kind == "code" and idea.edit is not None:
            run.diff = idea.edit(repo)
            console.say(f"  edited {idea.module} in the repository "
                        f"({run.diff.count(chr(10))} diff lines)")
            synced = await agent.sync(f"idea {n}")
            run.approval, run.server_path = synced["approval_text"], synced["server_path"]
            # pinned to its own snapshot: a later sync or activate does not move it
            pairs.append((run, {"snapshot_id": synced["snapshot_id"]}))
        elif idea.change is not None:
            run.config_change = idea.change(best.config)
            run.config = {**config, **run.config_change}
            run.server_path = best.server_path
            console.say(f"  config {run.config_change} for its run alone, no configure and no "
                        f"sync: the code stays {best.label}'s {best.snapshot_id[:12]}")
            pairs.append((run, {"snapshot_id": best.snapshot_id,
                                "config": run.config_change}))
    console.wrapped(f"Each judged by {METRIC}, the mean over the last {window} step(s), "
                    f"against {best.label}'s {best.mean:.3f}; a difference under {margin} is "
                    "noise.")
    await agent.train_together(pairs, steps, workflow=WORKFLOW, n_workers=N_WORKERS)
    held: list[RunRecord] = []
    for run, _ in pairs:
        study.add(run)
        if run.failed:
            run.verdict = "failed"
            reason = run.failure.reason if run.failure else "no reason given"
            run.decision = (f"Not kept: its engine died ({reason}); engine_status and "
                            f"read_logs with run_id={run.label} say why.")
            continue
        run.mean = await agent.window_mean(run.run_id, window)
        run.compared_with = best.label
        run.verdict = judge(best.mean, run.mean, margin=margin)
        console.say(f"[{run.label}] " + verdict_text(
            run.verdict, best_label=best.label, best=best.mean, new=run.mean, window=window,
            margin=margin), always=True)
        if run.verdict == "held":
            held.append(run)
    winner = max(held, key=lambda r: r.mean or 0.0, default=None)
    if winner is not None:
        study.best = winner
    undone, config = await keep_best(agent, study, config)
    for run, _ in pairs:
        module = run.idea.module if run.idea else None
        if run is winner:
            if module:
                keep_edit(repo, module, f"keep: {run.idea.title if run.idea else run.label}")
            run.decision = (f"Kept: {run.label} is the new best run (snapshot "
                            f"{run.snapshot_id[:12]}, lr {run.config.get('lr')}); the cluster "
                            "has its code and config active.")
        elif not run.failed:
            beaten = (f" {winner.label} beat it." if winner is not None and run in held
                      else "")
            run.decision = f"{undone}{beaten}"
        if run is not winner and module:
            revert_edit(repo, module)
            run.decision += f" It undid the edit of {module} in its repository."
        console.say(f"Decision on {run.label}: {run.decision}", always=True)
    return config


async def _compare(agent: Agent, study: Study) -> dict[str, Any]:
    """compare_runs of every run (it takes 2 to 6); a lone baseline from its own points."""
    ids = [r.run_id for r in study.runs if r.run_id]
    if len(ids) >= 2:
        return await agent.call("compare_runs", run_ids=ids[:6], metric=METRIC)
    rows = []
    for run in study.runs:
        values = [v for v in run.values() if v is not None]
        rows.append({"run_id": run.run_id, "first": values[0] if values else None,
                     "last": values[-1] if values else None,
                     "best": max(values) if values else None})
    return {"runs": rows, "config_differences": {}}


async def _train(agent: Agent, run: RunRecord, steps: int, *, stop_after: int | None = None
                 ) -> RunRecord:
    return await agent.train(run, steps, workflow=WORKFLOW, n_workers=N_WORKERS,
                             stop_after=stop_after)


async def keep_best(agent: Agent, study: Study, config: dict[str, Any], *, final: bool = False
                    ) -> tuple[str, dict[str, Any]]:
    """Make the best run's snapshot and config the active ones; returns what was done.

    The code: `engine_status` names the active snapshot, `activate_snapshot` restores the
    best run's if it differs (no upload, no new approval). The config: `configure` with the
    fields that differ from the best run's; at the end also with none, which answers the
    config the server stores, to check it.
    """
    best = study.the_best()
    done: list[str] = []
    # the default run's status names the active snapshot (a named run's, its own)
    status = await agent.call("engine_status", run_id="current")
    if status["snapshot_id"] != best.snapshot_id:
        back = await agent.call("activate_snapshot", snapshot_id=best.snapshot_id)
        done.append(f"rolled the cluster back to {best.label}'s snapshot "
                    f"{back['snapshot_id'][:12]} with activate_snapshot")
    fields = {k: v for k, v in best.config.items() if config.get(k) != v and v is not None}
    config_hash = ""
    if fields or final:
        configured = await agent.call("configure", **fields)
        config, config_hash = configured["config"], configured["config_hash"]
        if fields:
            sent = ", ".join(f"{k}={v}" for k, v in fields.items())
            done.append(f"set {sent} with configure ({best.label}'s config)")
    if final:
        # check what the server says now, not what the agent believes it did
        active = (await agent.call("engine_status", run_id="current"))["snapshot_id"]
        if active != best.snapshot_id or config != best.config:
            wrong = [k for k in sorted(set(config) | set(best.config))
                     if config.get(k) != best.config.get(k)]
            raise ToolFailed(f"the best run {best.label} is not what the cluster has active: "
                             f"snapshot {active[:12]} (best: {best.snapshot_id[:12]}), config "
                             f"fields that differ: {', '.join(wrong) or 'none'}")
        did = f"; the agent {'; '.join(done)}" if done else ""
        return (f"{best.label} is the best run{did}. engine_status shows its snapshot "
                f"{active[:12]} active, and configure with no change answers its config "
                f"(lr {config.get('lr')}, hash {config_hash[:12]}).", config)
    if not done:
        return (f"Not kept: {best.label}'s code and config were still active; nothing to "
                "undo.", config)
    return "Not kept: the agent " + "; ".join(done) + ".", config


async def _recover(agent: Agent, study: Study, run: RunRecord, repo: Path, steps: int,
                   config: dict[str, Any]) -> dict[str, Any]:
    """The engine died: read why, roll back to the best run's code, restart on it.

    Every step is the call the previous result named: engine_status's message names
    read_logs, then activate_snapshot (or a fix and a sync); activate_snapshot's names
    start_engine; start_engine's names start_rollouts. Returns the config now stored.
    """
    best = study.the_best()
    console = agent.console
    console.phase(f"recovery: the engine of run {run.run_id} died after "
                  f"{run.failure.steps_done if run.failure else 0} step(s)")
    failure, status = await agent.diagnose(run)
    run.failure, run.verdict = failure, "failed"
    module = run.idea.module if run.idea else None
    if failure.where is not None:
        path, line, _ = failure.where
        lines = (repo / path).read_text(encoding="utf-8").splitlines()
        failure.source = lines[line - 1] if 0 < line <= len(lines) else None
        culprit = ("the module this idea changed" if path == module
                   else "not the module this idea changed")
        console.say(f"  the failing line, {path}:{line} ({culprit}): "
                    f"{(failure.source or '').strip()}")
    console.say(f"  cause: {failure.describe()}", always=True)
    if status["rollouts"]:  # workers still wait for an engine that is gone
        await agent.call("stop_rollouts")
    # Roll back so training is not blocked (the debugging playbook): the run that trained
    # best, as list_runs reports it, not as remembered.
    agent.choose(status["message"], ["activate_snapshot"])
    runs = await agent.call("list_runs", limit=10)
    row = next((r for r in runs["runs"] if r["run_id"] == best.run_id), None)
    if row is None or row["status"] != "ended":
        raise ToolFailed(f"list_runs does not show {best.label}'s run {best.run_id} as ended")
    back = await agent.call("activate_snapshot", snapshot_id=row["snapshot_id"])
    console.say(f"  activate_snapshot({row['snapshot_id']!r}), {best.label}'s code: "
                f"{back['message']}")
    if module:
        revert_edit(repo, module)
        console.say(f"  {module} restored in the repository (the fix is the next iteration)")
    fields = {k: v for k, v in best.config.items() if config.get(k) != v and v is not None}
    if fields:  # the failed run also ran another config: the best run's, for the restart
        config = (await agent.call("configure", **fields))["config"]
        console.say(f"  configure({', '.join(f'{k}={v}' for k, v in fields.items())}): "
                    f"{best.label}'s config for the restart")
    agent.choose(back["message"], ["start_engine"])
    restart = RunRecord(label="restart", idea=None, config=config,
                        approval="no new approval: it ran before",
                        server_path=best.server_path)
    # One step past the one that crashed shows the rolled-back code trains; the rest of
    # the run would repeat the best run, so the agent stops it there.
    await _train(agent, restart, steps, stop_after=failure.steps_done + 1)
    if restart.failed:
        raise ToolFailed(f"the restart on {best.label}'s code failed too: {restart.failure}")
    # the calls from the first sign of the failure to the restart's rollouts
    made = agent.calls[failure.first_call:]
    cut = next((i for i, c in enumerate(made) if c.tool == "start_rollouts"), len(made) - 1)
    study.recoveries.append(Recovery(failed=run, rolled_back_to=back["snapshot_id"],
                                     calls=made[:cut + 1], restart=restart))
    study.add(restart)
    run.decision = (f"Rolled back to {best.label}'s snapshot {back['snapshot_id'][:12]} and "
                    f"restarted (run {restart.run_id}, {len(restart.points)} step(s)); the "
                    "edit was undone in the repository.")
    console.say(f"Decision: {run.decision}", always=True)
    return config


def _summary(result: LoopResult, report: Path) -> dict[str, Any]:
    """The results as JSON (`--summary-json`): what the test of the whole loop checks."""
    study = result.study
    best = study.the_best()
    labels = {r.run_id: r.label for r in study.runs}

    def run_json(r: RunRecord) -> dict[str, Any]:
        return {"label": r.label, "kind": r.idea.kind if r.idea else None,
                "run_id": r.run_id, "snapshot_id": r.snapshot_id, "server_path": r.server_path,
                "ajet_file": r.ajet_file, "status": r.status, "steps": sorted(r.points),
                "digit_share": r.values(), "mean": r.mean, "verdict": r.verdict,
                "compared_with": r.compared_with, "decision": r.decision,
                "config": r.config, "config_change": r.config_change, "devices": r.devices,
                "failure": None if r.failure is None else {
                    "reason": r.failure.reason, "error_line": r.failure.error_line,
                    "error_name": r.failure.error_name, "grep": r.failure.grep,
                    "where": r.failure.where, "log_lines": r.failure.log_lines,
                    "source": r.failure.source}}

    return {
        "metric": METRIC, "window": result.window, "margin": result.margin,
        "runs": [run_json(r) for r in study.runs],
        "best": best.label, "best_run_id": best.run_id, "best_snapshot_id": best.snapshot_id,
        "best_config": best.config,
        "active_snapshot_after": result.final_snapshot, "config_after": result.final_config,
        "recoveries": [{"failed": rec.failed.label, "rolled_back_to": rec.rolled_back_to,
                        "restart": rec.restart.label if rec.restart else None,
                        "calls": [c.call_text() for c in rec.calls]}
                       for rec in study.recoveries],
        "approvals": result.approvals, "enforcing": result.enforcing,
        "tool_calls": [{"tool": c.tool, "arguments": c.arguments, "bytes": c.bytes,
                        "error": c.error, "next_calls": list(c.next_calls)}
                       for c in result.calls],
        "side_by_side": [{"runs": [labels.get(i, i) for i in o["runs"]], "seconds": o["seconds"]}
                         for o in result.compared.get("side_by_side", [])],
        "compare": result.compared, "plot": str(result.plot), "report": str(report),
        "seconds": round(result.seconds, 1),
    }


# ---------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12,
                   help="training steps per run (default: 12)")
    p.add_argument("--ideas", default=",".join(str(i) for i in range(1, len(IDEAS) + 1)),
                   help="which ideas to test, in order, by number: 1 positive advantages "
                        "(code), 2 twice the learning rate (config), 3 square-root rewards "
                        "(code that crashes the engine), or 'none'; default: all")
    p.add_argument("--set", dest="job_overrides", action="append", default=[],
                   metavar="FIELD=VALUE",
                   help="change a field of the demo's job for every run, e.g. "
                        "--set num_repeat=4 (values are read as YAML); repeatable")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help=f"a mean digit share difference under this is noise and the change "
                        f"is not kept (default: {MARGIN})")
    p.add_argument("--approvers", action="store_true",
                   help="start the server with an approver token: every sync waits on the "
                        "server (pending) until the human approves it with `ajet-swarm "
                        "approvals approve`; without it the human approves in the MCP client")
    p.add_argument("--plot", default="demo_rewards.png",
                   help="where to write the PNG of every run's curve (default: "
                        "./demo_rewards.png)")
    p.add_argument("--report", default=None,
                   help="where to write the report for the human (default: demo_report.md "
                        "next to the plot)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="put the throwaway repo, server workdir and logs here (kept); "
                        "default: a temporary directory, removed at the end")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary directory (repo, server workdir, engine logs)")
    p.add_argument("--summary-json", type=Path, default=None,
                   help="also write the results (runs, snapshots, numbers, tool calls) as "
                        "JSON here")
    p.add_argument("--quiet", action="store_true",
                   help="print only phase headers, the table and the verdicts")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    try:
        numbers = [] if args.ideas.strip() == "none" else [
            int(n) for n in args.ideas.split(",") if n.strip()]
        if any(n < 1 for n in numbers):
            raise IndexError(numbers)
        args.ideas = [IDEAS[n - 1] for n in numbers]
    except (ValueError, IndexError):
        parser.error(f"--ideas takes numbers from 1 to {len(IDEAS)} (e.g. --ideas 1,3) or "
                     "'none' (the baseline only)")
    args.job = dict(JOB)
    for item in args.job_overrides:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            parser.error(f"--set {item!r}: write FIELD=VALUE, e.g. --set num_repeat=4")
        args.job[name.strip()] = yaml.safe_load(value)
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
