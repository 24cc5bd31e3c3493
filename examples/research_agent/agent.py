"""`Agent`: every action on the cluster as an MCP tool call, chosen from what the tools said.

The agent holds one MCP client session with `ajet-mcp`. Each call is recorded with the
size of its result (the text the model reads) and the calls its message names after
"Next:"; `choose` picks the next call among those named, so a tool text that stops
guiding the loop stops the demo. Besides the tools, the agent only edits files in its
own repository, as an LLM agent does with its file tools.

The human is `Human`: asked through MCP elicitation by default (the bridge's laptop-side
approval), or, against a server with approvers, shown the pending state and approving
with `ajet-swarm approvals` and their own approver token.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from mcp import Client
from mcp_types import ElicitRequestParams, ElicitResult

from ajet.protocol import EngineState
from examples.research_agent.console import Console, progress_bar
from examples.research_agent.judging import METRIC, Failure, RunRecord

__all__ = [
    "Agent",
    "CallRecord",
    "Human",
    "ToolFailed",
    "error_line",
    "failing_frame",
    "next_calls",
]

#: The serving states; metrics are read while the engine is in one of them.
_SERVING = {EngineState.ROLLING.value, EngineState.ROLLING_POST.value,
            EngineState.WEIGHT_SYNCING.value}
STEP_TIMEOUT_S = 120.0
#: Seconds between polls (engine_status, then read_metrics). A step takes 1-5 s on two
#: cores; polling faster only spends the CPU the engine needs.
POLL_S = 1.0

_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::\s.*)?$")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


class ToolFailed(RuntimeError):
    """A tool returned an error the agent could not act on; the text says what and why."""

    def __init__(self, text: str, next_calls: Sequence[str] = ()) -> None:
        super().__init__(text)
        self.text = text
        self.next_calls = list(next_calls)


@dataclass(frozen=True)
class CallRecord:
    """One tool call: what was asked, how big the answer was, what it said to call next."""

    tool: str
    arguments: str
    bytes: int
    error: bool
    next_calls: tuple[str, ...]
    #: the start of the result's message (or of the error text)
    said: str = ""

    def call_text(self) -> str:
        return f"{self.tool}({self.arguments})"


def next_calls(text: str, tools: Collection[str]) -> list[str]:
    """The tool names a result names after its first "Next:", in the order named."""
    _, sep, tail = text.partition("Next:")
    if not sep:
        return []
    return list(dict.fromkeys(w for w in re.findall(r"[a-z_]+", tail) if w in tools))


def error_line(lines: Sequence[str]) -> str | None:
    """The last `SomeError: message` line of a traceback, if the lines hold one."""
    for line in reversed(lines):
        if _ERROR_LINE.match(line.strip()):
            return line.strip()
    return None


def failing_frame(lines: Sequence[str]) -> tuple[str, int, str] | None:
    """The innermost traceback frame inside the synced `ajet/` package: path, line, function.

    The path is given from `ajet/` on (the snapshot's folder on the server differs from
    the repository's), so it names the file to open in the repository.
    """
    found: tuple[str, int, str] | None = None
    for line in lines:
        match = _FRAME.search(line)
        if match is None or "/ajet/" not in match["file"]:
            continue
        rel = "ajet/" + match["file"].rsplit("/ajet/", 1)[1]
        found = (rel, int(match["line"]), match["func"])
    return found


def _brief(arguments: dict[str, Any]) -> str:
    parts = []
    for key, value in arguments.items():
        text = repr(value) if isinstance(value, str) else str(value)
        parts.append(f"{key}={text if len(text) <= 40 else text[:37] + '...'}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------- the human


@dataclass
class Human:
    """The person who approves syncs: in the MCP client, or as a server approver."""

    console: Console
    swarm_url: str
    #: set when the server enforces approvals: this human's approver token
    approver_token: str | None = None
    approvals: list[dict[str, str]] = field(default_factory=list)

    @property
    def enforcing(self) -> bool:
        return self.approver_token is not None

    async def elicited(self, context: Any, params: ElicitRequestParams) -> ElicitResult:
        """The MCP elicitation callback: show the question, then accept."""
        self.approvals.append({"how": "elicitation", "shown": params.message})
        self.console.say("  The bridge asks the human (MCP elicitation); the human sees:")
        self.console.boxed("approval request", params.message)
        self.console.say("  The human accepts.")
        return ElicitResult(action="accept", content={"approve": True})

    async def approve_on_server(self, human_command: str, snapshot_id: str) -> str:
        """Run the command the tool gave for the human, with the approver's own token."""
        argv = shlex.split(human_command)
        if argv[:3] != ["ajet-swarm", "approvals", "approve"] or len(argv) != 4:
            raise ToolFailed(f"the sync named an approval command this demo does not know: "
                             f"{human_command!r}")
        ref = argv[3]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
        env["AJET_SWARM_APPROVER_TOKEN"] = self.approver_token or ""
        base = [*_ajet_swarm(), "approvals", "--swarm-url", self.swarm_url]
        shown = await anyio.run_process([*base, "show", ref, "--lines", "40"], env=env,
                                        check=False)
        review = shown.stdout.decode(errors="replace")
        self.console.say(f"  The human runs `ajet-swarm approvals show {ref}` (approver token "
                         "AJET_SWARM_APPROVER_TOKEN) and reads the server's own diff:")
        self.console.boxed("ajet-swarm approvals show", review or shown.stderr.decode())
        done = await anyio.run_process(
            [*base, "approve", ref, "--yes", "--note", "reviewed in the research loop demo"],
            env=env, check=False)
        out = (done.stdout + done.stderr).decode(errors="replace").strip()
        if done.returncode != 0:
            raise ToolFailed(f"`{human_command}` failed ({done.returncode}): {out[-600:]}")
        said = next((ln for ln in out.splitlines() if " approved by " in ln), out[-200:])
        self.console.say(f"  The human runs `{human_command} --yes`: {said.strip()}")
        self.approvals.append({"how": "server approver CLI", "snapshot_id": snapshot_id,
                               "shown": review})
        return out


def _ajet_swarm() -> list[str]:
    """`ajet-swarm` next to this interpreter, else the module (same code either way)."""
    script = Path(sys.executable).with_name("ajet-swarm")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "swarm_server"]


# ---------------------------------------------------------------------------- the agent


class Agent:
    """Every action goes through one MCP session with the bridge."""

    def __init__(self, session: Client, console: Console, human: Human,
                 tools: Collection[str]) -> None:
        self.session = session
        self.console = console
        self.human = human
        self.tools = set(tools)
        self.calls: list[CallRecord] = []

    async def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        """One tool call; an error result raises `ToolFailed` with the calls it names."""
        result = await self.session.call_tool(tool, arguments)
        # What the model reads: the text blocks (the result's JSON) and any image data.
        text = "".join(getattr(block, "text", "") for block in result.content)
        size = sum(len(getattr(block, "text", "").encode())
                   + len(getattr(block, "data", "") or "") for block in result.content)
        data = dict(result.structured_content or {})
        said = text if result.is_error else str(data.get("message", ""))
        named = next_calls(said, self.tools)
        self.calls.append(CallRecord(tool, _brief(arguments), size, bool(result.is_error),
                                     tuple(named), said[:300]))
        if result.is_error:
            raise ToolFailed(f"{tool} failed: {text}", named)
        if result.structured_content is None:
            raise ToolFailed(f"{tool} returned no structured result")
        return data

    def choose(self, said: str, prefer: Sequence[str]) -> str:
        """The first of `prefer` that the message names as a next call."""
        named = next_calls(said, self.tools)
        for tool in prefer:
            if tool in named:
                return tool
        raise ToolFailed(f"the last result named {named or 'no next call'}, none of "
                         f"{list(prefer)}: {said[:300]}")

    # ------------------------------------------------------------------ code sync

    async def sync(self, what: str) -> dict[str, Any]:
        """Preview, then sync through the approval path that applies; the synced result."""
        preview = await self.call("sync_train_code", dry_run=True)
        changed = preview["added"] + preview["changed"] + preview["removed"]
        if not changed:
            files = ("no file differs from the code the cluster runs "
                     f"({preview['files_total']} files)")
        elif len(changed) <= 3 and not preview["lists_truncated"]:
            files = ", ".join(changed)
        else:
            files = f"{len(changed)} files"
        self.console.say(f"  sync_train_code(dry_run=true), {what}: {files}; "
                         f"{preview['blobs_to_upload']} blob(s), "
                         f"{preview['bytes_to_upload']} bytes to upload")
        self.choose(preview["message"], ["sync_train_code"])
        synced = await self.call("sync_train_code")
        if synced["status"] == "pending_approval":
            synced = await self._approved_on_server(synced)
        if synced["status"] != "synced":
            raise ToolFailed(f"sync_train_code ended as {synced['status']}: {synced['message']}")
        approval = synced["approval"] or {}
        how = ("approved on the server by " + str(approval.get("approved_by"))
               if approval.get("enforced_by_server") else str(approval.get("status")))
        self.console.say(f"  synced snapshot {synced['snapshot_id'][:12]} -> "
                         f"{synced['server_path']} ({synced['bytes_uploaded']} bytes uploaded, "
                         f"approval: {how})")
        synced["approval_text"] = how
        return synced

    async def _approved_on_server(self, pending: dict[str, Any]) -> dict[str, Any]:
        """pending_approval: show where the human approves, let them, sync again."""
        approval = pending.get("approval") or {}
        self.console.say(f"  sync_train_code: {pending['status']}. {pending['message']}")
        command, url = approval.get("human_command"), approval.get("approve_url")
        if not command or not self.human.enforcing:
            raise ToolFailed(f"the sync waits for a human this demo cannot stand in for: "
                             f"{pending['message']}")
        status = await self.call("engine_status")
        self.console.say(f"  engine_status: approvals_enforced={status['approvals_enforced']}, "
                         f"pending on the server: "
                         f"{', '.join(s[:12] for s in status['pending_approvals']) or 'none'} "
                         f"(the console: {status.get('approve_url') or url})")
        self.console.say(f"  The agent shows the human: {url} or `{command}`.")
        await self.human.approve_on_server(command, pending["snapshot_id"])
        self.choose(pending["message"], ["sync_train_code"])
        again = await self.call("sync_train_code")
        if again["status"] == "pending_approval":
            raise ToolFailed(f"still pending after the human approved: {again['message']}")
        return again

    # ------------------------------------------------------------------ training

    async def train(self, run: RunRecord, steps: int, *, workflow: str, n_workers: int,
                    stop_after: int | None = None) -> RunRecord:
        """start_engine, start_rollouts, read_metrics until the steps are done, stop both.

        A run whose engine dies comes back with `status="failed"` and its rollouts still
        running: what happened next is the recovery's to decide, from the tools' answers.
        """
        target = min(steps, stop_after or steps)
        t0 = time.monotonic()
        try:
            started = await self.call("start_engine")
        except ToolFailed as exc:  # died while booting: the error carries reason and log
            self.console.say(f"  start_engine: {exc.text[:400]}")
            run.status = "failed"
            run.failure = Failure(reason=exc.text[:1000], exit_code=None,
                                  first_call=len(self.calls) - 1)
            return run
        run.run_id, run.snapshot_id = started["run_id"], started["snapshot_id"]
        run.ajet_file = started.get("ajet_file")
        self.console.say(f"  start_engine: run {run.run_id} is {started['engine_state']} after "
                         f"{started['waited_s']} s on snapshot {run.snapshot_id[:12]}; it "
                         f"imports ajet from {run.ajet_file}")
        self.choose(started["message"], ["start_rollouts", "engine_status"])
        rollouts = await self.call("start_rollouts", workflow=workflow, n_workers=n_workers)
        self.console.say(f"  start_rollouts: {rollouts['handle']}, {rollouts['n_workers']} "
                         f"worker(s), {rollouts['tasks']} tasks x {rollouts['num_repeat']}")
        last_progress = time.monotonic()
        try:
            while len(run.points) < target:
                await anyio.sleep(POLL_S)
                # the state first: metrics read after the engine went OFFLINE are complete
                status = await self.call("engine_status")
                got = await self.call("read_metrics", run_id=run.run_id,
                                      metrics=["reward_mean", METRIC, "step_time_s"], last_n=5)
                if self._add_points(run, got["recent"], target):
                    last_progress = time.monotonic()
                if len(run.points) >= target:
                    break
                if status["engine_state"] == EngineState.OFFLINE.value:
                    error = status.get("last_error") or {}
                    if error.get("run_id") == run.run_id:
                        run.status = "failed"
                        run.failure = Failure(reason=error.get("reason", ""),
                                              exit_code=error.get("exit_code"),
                                              steps_done=len(run.points), status=status,
                                              first_call=len(self.calls) - 2)
                        self.console.say(f"  engine_status: {status['engine_state']}: "
                                         f"{status['message']}")
                        return run
                    raise ToolFailed(f"the engine of run {run.run_id} went OFFLINE after "
                                     f"{len(run.points)} of {target} steps without an error: "
                                     f"{status['message']}")
                if time.monotonic() - last_progress > STEP_TIMEOUT_S:
                    logs = await self.call("read_logs", run_id=run.run_id, tail=20)
                    raise ToolFailed(f"no new step in {STEP_TIMEOUT_S:.0f} s; engine log:\n"
                                     + "\n".join(logs["lines"]))
        finally:
            run.seconds = time.monotonic() - t0
        await self.call("stop_rollouts")
        why = (f"{run.label}: {target} steps done" if target == steps
               else f"{run.label}: passed step {target}, enough to show the code trains")
        stopped = await self.call("stop_engine", reason=why)
        self.console.say(f"  stop_rollouts, stop_engine: run {run.run_id} ended "
                         f"({stopped['engine_state']}); {target} steps in {run.seconds:.0f} s")
        return run

    async def train_together(self, runs: Sequence[tuple[RunRecord, dict[str, Any]]],
                             steps: int, *, workflow: str, n_workers: int) -> None:
        """Several named runs at once: start each, then its rollouts, then poll them all.

        `runs` pairs each record with what its `start_engine` call adds to the name
        (`snapshot_id`, `config`). Every run is started without waiting (`wait_s=0`), so
        the engines boot together; each gets its rollouts once `engine_status` shows it
        serving, and is stopped (its rollouts with it) once it has `steps` steps, while
        the others go on. A run whose engine dies comes back with `status="failed"`.
        """
        t0 = time.monotonic()
        for run, start in runs:
            started = await self.call("start_engine", name=run.label, wait_s=0, **start)
            run.run_id, run.snapshot_id = started["run_id"], started["snapshot_id"]
            run.devices = list(started.get("devices") or [])
            self.console.say(f"  start_engine(name={run.label!r}): run {run.run_id} "
                             f"{started['status']} on device slot(s) {run.devices} with "
                             f"snapshot {run.snapshot_id[:12]}")
            self.choose(started["message"], ["engine_status", "start_rollouts"])
        waiting = {run.label: run for run, _ in runs}
        while waiting:  # each run gets its rollouts as soon as it serves
            await anyio.sleep(POLL_S)
            for label, run in list(waiting.items()):
                status = await self.call("engine_status", run_id=label)
                if status["engine_state"] in _SERVING:
                    run.ajet_file = status.get("ajet_file")
                    run.devices = list(status.get("devices") or run.devices)
                    rollouts = await self.call("start_rollouts", workflow=workflow,
                                               n_workers=n_workers, run_id=label)
                    self.console.say(f"  start_rollouts(run_id={label!r}): "
                                     f"{rollouts['handle']}, {rollouts['n_workers']} "
                                     f"worker(s) after {time.monotonic() - t0:.0f} s")
                    del waiting[label]
                elif status["engine_state"] == EngineState.OFFLINE.value and (
                        (status.get("last_error") or {}).get("run_id") == run.run_id):
                    error = status["last_error"]
                    run.status = "failed"
                    run.failure = Failure(reason=error.get("reason", ""),
                                          exit_code=error.get("exit_code"), status=status,
                                          first_call=len(self.calls) - 1)
                    del waiting[label]
                elif time.monotonic() - t0 > STEP_TIMEOUT_S:
                    raise ToolFailed(f"run {label} did not serve in {STEP_TIMEOUT_S:.0f} s: "
                                     f"{status['message']}")
        active = await self.call("list_runs", state="active")
        pool = active.get("devices") or {}
        self.console.say("  list_runs(state='active'): " + "; ".join(
            f"{r.get('name') or r['run_id']} on {r.get('devices')} ({r.get('engine_state')})"
            for r in active["runs"]) + f"; device pool: {pool.get('free')} of "
            f"{pool.get('total')} slot(s) free")
        training = {run.label: run for run, _ in runs if not run.failed}
        last_progress = time.monotonic()
        try:
            while training:
                await anyio.sleep(POLL_S)
                for label, run in list(training.items()):
                    status = await self.call("engine_status", run_id=label)
                    got = await self.call("read_metrics", run_id=label,
                                          metrics=["reward_mean", METRIC, "step_time_s"],
                                          last_n=5)
                    if self._add_points(run, got["recent"], steps):
                        last_progress = time.monotonic()
                    if len(run.points) >= steps:
                        run.seconds = time.monotonic() - t0
                        stopped = await self.call("stop_engine", run_id=label,
                                                  reason=f"{label}: {steps} steps done")
                        self.console.say(f"  stop_engine(run_id={label!r}): run {run.run_id} "
                                         f"ended ({stopped['engine_state']}); {steps} steps "
                                         f"after {run.seconds:.0f} s; its slot is free")
                        del training[label]
                    elif status["engine_state"] == EngineState.OFFLINE.value:
                        error = status.get("last_error") or {}
                        run.status = "failed"
                        run.failure = Failure(reason=error.get("reason", "ended early"),
                                              exit_code=error.get("exit_code"),
                                              steps_done=len(run.points), status=status,
                                              first_call=len(self.calls) - 2)
                        self.console.say(f"  engine_status(run_id={label!r}): "
                                         f"{status['message']}")
                        await self.call("stop_engine", run_id=label, reason="its engine died")
                        del training[label]
                if training and time.monotonic() - last_progress > STEP_TIMEOUT_S:
                    label = next(iter(training))
                    logs = await self.call("read_logs", run_id=label, tail=20)
                    raise ToolFailed(f"no new step of {', '.join(training)} in "
                                     f"{STEP_TIMEOUT_S:.0f} s; the log of {label}:\n"
                                     + "\n".join(logs["lines"]))
        finally:
            for run, _ in runs:
                run.seconds = run.seconds or time.monotonic() - t0

    def _add_points(self, run: RunRecord, recent: list[dict[str, Any]], target: int) -> bool:
        new = [p for p in recent if p["step"] not in run.points and p["step"] <= target]
        for point in sorted(new, key=lambda p: p["step"]):
            run.points[int(point["step"])] = point
            self.console.say(
                f"  [{run.label}] step {point['step']:2d}/{target} "
                f"{progress_bar(len(run.points), target)} reward "
                f"{point.get('reward_mean', float('nan')):.3f}  digit share "
                f"{point.get(METRIC, float('nan')):.3f}  "
                f"({point.get('step_time_s', float('nan')):.1f} s/step)")
        return bool(new)

    async def window_mean(self, run_id: str, last_n: int) -> float | None:
        got = await self.call("read_metrics", run_id=run_id, metrics=[METRIC], last_n=last_n)
        trend = got["trend"][0]
        return None if trend["mean"] is None else float(trend["mean"])

    # ------------------------------------------------------------------ a failed run

    async def diagnose(self, run: RunRecord) -> tuple[Failure, dict[str, Any]]:
        """What killed the run, from engine_status's last_error and read_logs.

        Returns the failure and the engine_status result whose message names the
        recovery's calls (the one that saw the engine die, or a fresh one after a failed
        start). The search is literal: the error's name from the log tail (a plain word),
        then the traceback's frame lines.
        """
        failure = run.failure or Failure(reason="", exit_code=None, first_call=len(self.calls))
        status = failure.status or await self.call("engine_status")
        error = status.get("last_error") or {}
        if error.get("run_id") != run.run_id:
            raise ToolFailed(f"engine_status shows no error for run {run.run_id}: "
                             f"{status['message']}")
        failure.reason, failure.exit_code = error["reason"], error.get("exit_code")
        tail = list(error.get("log_tail") or [])
        self.console.say(f"  engine_status: {status['engine_state']}, last_error of run "
                         f"{error['run_id']}: {error['reason']} (exit code "
                         f"{error.get('exit_code')}); its log tail ends with:")
        for line in tail[-4:]:
            self.console.say(f"    | {line[:160]}")
        self.choose(status["message"], ["read_logs"])
        failure.error_line = error_line(tail)
        failure.error_name = (failure.error_line or "Traceback").split(":", 1)[0]
        failure.grep = failure.error_name
        found = await self.call("read_logs", run_id=run.run_id, grep=failure.grep, tail=20)
        failure.log_lines = list(found["lines"])
        self.console.say(f"  read_logs(run_id={run.run_id!r}, grep={failure.grep!r}): "
                         f"{len(found['lines'])} line(s) of {found['total_lines']}:")
        for line in found["lines"][-3:]:
            self.console.say(f"    | {line[:160]}")
        frames = await self.call("read_logs", run_id=run.run_id, grep="File", tail=20)
        failure.where = failing_frame(frames["lines"]) or failing_frame(tail)
        if failure.error_line is None and failure.log_lines:
            failure.error_line = error_line(failure.log_lines)
        where = (f"{failure.where[0]}, line {failure.where[1]}, in {failure.where[2]}"
                 if failure.where else "no frame inside ajet/")
        self.console.say(f"  read_logs(run_id={run.run_id!r}, grep='File'): the innermost "
                         f"frame inside ajet/ is {where}")
        return failure, status
