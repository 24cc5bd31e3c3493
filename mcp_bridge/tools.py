"""The logic of the bridge's tools, as plain functions of a `Bridge` (no MCP here).

`mcp_bridge.server` wraps each function in one `@mcp.tool()`; tests call them directly
against a real swarm server. Every function returns a small pydantic result (see
`mcp_bridge.models`) and raises `ToolError` with the next call named. The sync flow,
with its approvals, lives in `mcp_bridge.sync`.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import yaml

from ajet.client import SERVING_STATES
from ajet.copilot.job import default_job_values
from ajet.errors import ApprovalPending, EngineStateConflict, SwarmNotFound
from ajet.protocol import EngineState, EngineStatus, LastError, RunPublic
from ajet.run_compare import RunComparison as Comparison
from ajet.run_compare import compare_runs as compare
from mcp_bridge.bridge import CURRENT_RUN, Bridge, swarm_errors, tool_error
from mcp_bridge.models import (
    ActivateResult,
    CheckpointsResult,
    CompareResult,
    ConfigChange,
    ConfigureResult,
    DevicePool,
    EngineStatusResult,
    ErrorInfo,
    LogsResult,
    MetricsResult,
    MetricTrend,
    RolloutInfo,
    RolloutStartResult,
    RolloutStatusResult,
    RolloutStopResult,
    RunComparison,
    RunOverlap,
    RunRow,
    RunsResult,
    SnapshotRow,
    SnapshotsResult,
    StartResult,
    StopResult,
    ToolName,
)
from mcp_bridge.plotting import plot_metrics_png
from mcp_bridge.rollouts import RolloutHandle

__all__ = [
    "DEFAULT_METRICS",
    "activate_snapshot",
    "compare_runs",
    "configure",
    "current_config",
    "engine_status",
    "list_runs",
    "list_snapshots",
    "read_logs",
    "read_metrics",
    "rollout_status",
    "start_engine",
    "start_rollouts",
    "stop_engine",
    "stop_rollouts",
]

log = logging.getLogger(__name__)

#: The metrics `read_metrics` and `compare_runs` look at unless told otherwise.
DEFAULT_METRICS = ("reward_mean", "success_rate", "loss", "response_length")
_LOG_LINE_CHARS = 400
_LOG_TOTAL_CHARS = 6000
_TAIL_LINES = 12
_POLL_S = 0.25


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")


def _error_info(err: LastError | None, *, tail: int = _TAIL_LINES) -> ErrorInfo | None:
    if err is None:
        return None
    return ErrorInfo(reason=err.reason[:1000], exit_code=err.exit_code, run_id=err.run_id,
                     at=_iso(err.at),
                     log_tail=[ln[:_LOG_LINE_CHARS] for ln in err.log_tail[-tail:]])


# ---------------------------------------------------------------------------- status


def engine_status(bridge: Bridge, *, run_id: str | None = None) -> EngineStatusResult:
    """A run's engine state, step, code, last error (default: the agent's latest run, else
    the default run); this bridge's rollouts and approvals."""
    ref = bridge.run_ref(run_id)
    with swarm_errors(f"call {ToolName.LIST_RUNS} for the runs there are, then "
                      f"{ToolName.ENGINE_STATUS} again"):
        status = (bridge.client.engine_status() if ref == CURRENT_RUN
                  else bridge.client.run_status(ref))
        if status.approvals_enforced:  # the server's record, never the local folder
            pending = [s.snapshot_id for s in bridge.client.list_snapshots().snapshots
                       if s.approval is not None and s.approval.state.value == "pending"]
        else:
            pending = [a.id for a in bridge.approvals.all()
                       if a.status.value == "pending" and not a.expired(time.time())
                       and a.server_url.rstrip("/") == bridge.config.swarm_url.rstrip("/")]
    rollouts = [_rollout_info(h) for h in bridge.rollouts.all() if h.running()]
    message = _status_message(status, None if ref == CURRENT_RUN else ref)
    approve_url = None
    if status.approvals_enforced and status.snapshot_approval.value != "approved":
        approve_url = f"{bridge.config.swarm_url}/ui/snapshots/{status.snapshot_id}"
        message += (f" The active snapshot is {status.snapshot_approval.value} on the server: "
                    f"the engine cannot start on it until a human approver approves it at "
                    f"{approve_url}; you cannot approve it.")
    elif status.approvals_enforced and pending:
        approve_url = f"{bridge.config.swarm_url}/ui/approvals"
        message += (f" {len(pending)} snapshot(s) wait for a human approver ({approve_url}); "
                    f"after approval, {ToolName.SYNC_TRAIN_CODE} again activates yours.")
    return EngineStatusResult(
        approvals_enforced=status.approvals_enforced,
        snapshot_approval=status.snapshot_approval.value, approve_url=approve_url,
        message=message,
        engine_state=status.state.value, run_id=status.run_id, step=status.step,
        snapshot_id=status.snapshot_id, snapshot_path=status.snapshot_path,
        experiment_name=status.experiment_name, has_config=status.has_config,
        ajet_file=status.ajet_file, in_state_since=_iso(status.since),
        last_error=_error_info(status.last_error), rollouts=rollouts,
        approval_mode=bridge.config.approval, pending_approvals=pending,
        name=status.name, devices=status.devices, queue_position=status.queue_position,
        queue_reason=status.queue_reason,
    )


def _status_message(status: EngineStatus, run: str | None = None) -> str:
    state = status.state
    if status.queue_position is not None:
        return _queued_message(run or status.name or status.run_id or "?",
                               status.queue_position, status.queue_reason)
    if run is not None:  # a run started with a name (or by id): its own lifecycle
        return _named_status_message(status, run)
    if state == EngineState.OFFLINE:
        if status.last_error is not None:
            # The recovery the debugging playbook spells out, in call order: read, then
            # fix and resync, or roll back to code that trained well; then start again.
            return (f"Engine is {state}; the last run failed: {status.last_error.reason[:200]}. "
                    f"Next: read last_error.log_tail and {ToolName.READ_LOGS} with "
                    f"run_id={status.last_error.run_id} and grep='Traceback' (or the error's "
                    f"name); then fix the code under ajet/ and {ToolName.SYNC_TRAIN_CODE}, or "
                    f"roll back with {ToolName.ACTIVATE_SNAPSHOT} to a snapshot that trained "
                    f"well ({ToolName.LIST_RUNS} shows each run's); then "
                    f"{ToolName.START_ENGINE}.")
        if not status.has_config:
            return (f"Engine is {state} with no config; call {ToolName.CONFIGURE}, then "
                    f"{ToolName.START_ENGINE}.")
        return f"Engine is {state}; call {ToolName.START_ENGINE} to train."
    if state == EngineState.BOOTING:
        return (f"Engine is {state} (run {status.run_id}); call {ToolName.ENGINE_STATUS} "
                "again shortly.")
    return (f"Engine is {state}, run {status.run_id}, step {status.step}; call "
            f"{ToolName.READ_METRICS} to follow training.")


def _queued_message(run: str, position: int | None, reason: str | None) -> str:
    return (f"Run {run} is queued (#{position}: {reason or 'waiting for free devices'}); it "
            f"boots by itself when device slots free up. Next: {ToolName.LIST_RUNS} "
            f"state='active' shows the device pool; {ToolName.STOP_ENGINE} with run_id of a "
            f"run you no longer need frees its devices ({ToolName.STOP_ENGINE} run_id={run} "
            f"takes this one out of the queue). {ToolName.START_ROLLOUTS} with run_id={run} "
            "may start now: its workers wait until it serves.")


def _named_status_message(status: EngineStatus, run: str) -> str:
    state = status.state
    where = f" on devices {status.devices}" if status.devices else ""
    if state == EngineState.OFFLINE:
        if status.last_error is not None:
            return (f"Run {run} is {state}; it failed: {status.last_error.reason[:200]}. Next: "
                    f"read last_error.log_tail and {ToolName.READ_LOGS} with run_id={run} and "
                    f"grep='Traceback'; fix the code and {ToolName.SYNC_TRAIN_CODE}, then "
                    f"{ToolName.START_ENGINE} with name={run} (and snapshot_id) again.")
        return (f"Run {run} is {state} (it ended). Next: {ToolName.READ_METRICS} or "
                f"{ToolName.COMPARE_RUNS} with run_id={run}; {ToolName.START_ENGINE} with "
                f"name={run} starts it again.")
    if state == EngineState.BOOTING:
        return (f"Run {run} is {state} (run {status.run_id}){where}; call "
                f"{ToolName.ENGINE_STATUS} with run_id={run} again shortly.")
    return (f"Run {run} is {state} (run {status.run_id}){where}, step {status.step}; call "
            f"{ToolName.READ_METRICS} with run_id={run} to follow it, {ToolName.LIST_RUNS} "
            "state='active' for every run at once.")


# ---------------------------------------------------------------------------- config


def current_config(bridge: Bridge) -> tuple[dict[str, Any] | None, str]:
    """The config the server stores (what the next start uses), and where it came from."""
    with swarm_errors(f"call {ToolName.ENGINE_STATUS} to check the server"):
        stored = bridge.client.get_train_config()
    if stored is None:
        return None, "the defaults (the server has no config yet)"
    return stored.config, "the server's stored config"


def configure(bridge: Bridge, changes: dict[str, Any], *, reset: bool = False) -> ConfigureResult:
    """Merge `changes` into the current config (or the defaults with `reset`) and send it.

    The server validates with the active code's own schema (so a synced schema change
    counts) and names bad fields; the result lists what changed.
    """
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}"):
        status = bridge.client.engine_status()
    if status.state != EngineState.OFFLINE:
        raise tool_error(
            f"the engine is {status.state}; the config can change only while it is OFFLINE",
            f"call {ToolName.STOP_ROLLOUTS}, {ToolName.STOP_ENGINE}, then {ToolName.CONFIGURE} "
            f"again and {ToolName.START_ENGINE}",
        )
    base, source = current_config(bridge)
    merged = {**({} if reset else base or {}), **changes}
    if isinstance(merged.get("defaults_chosen"), list):  # what is changed here is set
        merged["defaults_chosen"] = [f for f in merged["defaults_chosen"] if f not in changes]
    text = yaml.safe_dump(merged, sort_keys=False)
    with swarm_errors(f"fix the named field(s) and call {ToolName.CONFIGURE} again"):
        accepted = bridge.client.submit_config(text)
    before = base if base is not None else default_job_values()
    changed = [ConfigChange(field=k, before=before.get(k), after=accepted.config.get(k))
               for k in sorted(set(before) | set(accepted.config))
               # defaults_chosen is the server's bookkeeping of the fields it chose
               if k != "defaults_chosen" and before.get(k) != accepted.config.get(k)]
    what = ", ".join(f"{c.field}={c.after!r}" for c in changed[:8]) or "nothing"
    return ConfigureResult(
        message=(f"Config accepted for experiment {accepted.experiment_name!r}; changed {what}. "
                 f"Next: {ToolName.START_ENGINE}."),
        experiment_name=accepted.experiment_name, config_hash=accepted.config_hash,
        changed=changed, compared_with=source, config=accepted.config,
    )


# ---------------------------------------------------------------------------- engine


def start_engine(bridge: Bridge, *, force_restart: bool = False, wait_s: float | None = None,
                 name: str | None = None, snapshot_id: str | None = None,
                 config: dict[str, Any] | None = None, queue: bool = True) -> StartResult:
    """Start a run and wait (bounded) until it serves episodes; a failed boot is an error.

    Without `name`, `snapshot_id` and `config`: the default run, with the stored config on
    the active code (one at a time; `force_restart` replaces it). With any of them: a run
    beside the others (a sweep), on device slots of its own; `config` holds the fields
    that differ from the stored config. A run that does not fit the free devices waits in
    the server's queue (`queue=False`: refused instead); the result says where it stands.
    """
    wait = bridge.config.start_wait_s if wait_s is None else max(0.0, wait_s)
    if name is not None or snapshot_id is not None or config is not None:
        return _start_concurrent(bridge, name=name, snapshot_id=snapshot_id, config=config,
                                 queue=queue, force_restart=force_restart, wait=wait)
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}"):
        before = bridge.client.engine_status()
    if not before.has_config:
        raise tool_error("the server has no training config yet",
                         f"call {ToolName.CONFIGURE} (defaults are fine), then "
                         f"{ToolName.START_ENGINE}")
    if before.state != EngineState.OFFLINE and not force_restart:
        raise tool_error(
            f"the default run is already {before.state} (run {before.run_id})",
            f"use it ({ToolName.READ_METRICS}), call {ToolName.START_ENGINE} with "
            "force_restart=true to restart it, or with a name (and config) to start another "
            "run beside it",
        )
    t0 = time.monotonic()
    with swarm_errors(f"call {ToolName.ENGINE_STATUS} and {ToolName.READ_LOGS}"):
        status = bridge.client.start_run(force_restart=force_restart)
        bridge.last_run = None  # the default run: 'current' follows it across restarts
        run_id = status.run_id
        deadline = t0 + wait
        while True:
            if status.state in SERVING_STATES:
                break
            if status.state == EngineState.OFFLINE:
                err = status.last_error
                if err is not None and (run_id is None or err.run_id in (None, run_id)):
                    _raise_engine_died(err)
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
            status = bridge.client.engine_status()
            run_id = run_id or status.run_id
    waited = round(time.monotonic() - t0, 1)
    if status.state in SERVING_STATES:
        message = (f"Run {status.run_id} is {status.state} on snapshot {status.snapshot_id[:12]}. "
                   f"Next: {ToolName.START_ROLLOUTS}, then {ToolName.READ_METRICS}.")
    else:
        message = (f"Run {run_id} is still {status.state} after {waited}s. Next: call "
                   f"{ToolName.ENGINE_STATUS} until ENGINE.ROLLING ({ToolName.READ_LOGS} shows "
                   "boot progress).")
    return StartResult(message=message, run_id=status.run_id or run_id,
                       engine_state=status.state.value, snapshot_id=status.snapshot_id,
                       ajet_file=status.ajet_file, waited_s=waited, devices=status.devices,
                       status="running" if status.state in SERVING_STATES else "booting")


def _run_yaml(bridge: Bridge, config: dict[str, Any] | None) -> str | None:
    """The job of a concurrent run: the stored config (or the defaults) with `config`'s
    fields changed; None (the server's stored config as it is) without changes."""
    if config is None:
        return None
    base, _ = current_config(bridge)
    merged = {**(base or {}), **config}
    if isinstance(merged.get("defaults_chosen"), list):  # what is changed here is set
        merged["defaults_chosen"] = [f for f in merged["defaults_chosen"] if f not in config]
    return yaml.safe_dump(merged, sort_keys=False)


def _start_concurrent(bridge: Bridge, *, name: str | None, snapshot_id: str | None,
                      config: dict[str, Any] | None, queue: bool, force_restart: bool,
                      wait: float) -> StartResult:
    label = name or "the new run"
    text = _run_yaml(bridge, config)
    t0 = time.monotonic()
    with swarm_errors(f"call {ToolName.LIST_RUNS} state='active' for the runs and devices, "
                      f"then {ToolName.START_ENGINE} again"):
        if force_restart and name is not None:
            try:
                bridge.client.stop_run(name, reason=f"restarted by start_engine name={name}")
            except SwarmNotFound:
                pass  # nothing by that name yet: nothing to stop
        try:
            run = bridge.client.start_run(text, snapshot_id=snapshot_id, name=name, queue=queue)
        except ApprovalPending:
            raise  # swarm_errors says who approves, and where
        except EngineStateConflict as exc:
            raise tool_error(
                f"the server refused to start {label}: {exc.detail}"
                + (f" (server hint: {exc.hint[:300]})" if exc.hint else ""),
                f"if the name is taken, pick another (names are unique among active runs) or "
                f"{ToolName.STOP_ENGINE} with run_id={name or '<run>'} first; if the devices "
                f"are busy, pass queue=true to wait, or {ToolName.STOP_ENGINE} a run you no "
                f"longer need; if it can never fit, ask for fewer devices (config={{'n_gpu': 1}}, "
                f"or n_proc on a CPU server); {ToolName.LIST_RUNS} state='active' shows the "
                "pool",
            ) from exc
        ref = name or run.run_id
        bridge.last_run = ref  # the tools' default run from now on
        status: EngineStatus | None = None
        deadline = t0 + wait
        while run.status != "queued":
            status = bridge.client.run_status(run.run_id)
            if status.state in SERVING_STATES or status.queue_position is not None:
                break
            if status.state == EngineState.OFFLINE and status.last_error is not None:
                _raise_engine_died(status.last_error, run=ref)
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
    waited = round(time.monotonic() - t0, 1)
    queued = run.status == "queued" or (status is not None and status.queue_position is not None)
    position = status.queue_position if status is not None else run.queue_position
    reason = status.queue_reason if status is not None else run.queue_reason
    devices = status.devices if status is not None and status.devices else run.devices
    state = status.state.value if status is not None else (
        run.engine_state.value if run.engine_state else EngineState.OFFLINE.value)
    if queued:
        message = _queued_message(ref, position, reason)
        run_status = "queued"
    elif status is not None and status.state in SERVING_STATES:
        message = (f"Run {ref} ({run.run_id}) is {status.state} on devices {devices}, snapshot "
                   f"{run.snapshot_id[:12]}. Next: {ToolName.START_ROLLOUTS} with run_id={ref}, "
                   f"then {ToolName.READ_METRICS} with run_id={ref}; for a sweep, start the "
                   f"next value with another name, then {ToolName.LIST_RUNS} state='active'.")
        run_status = "running"
    else:
        message = (f"Run {ref} ({run.run_id}) is still {state} after {waited}s on devices "
                   f"{devices}. Next: {ToolName.ENGINE_STATUS} with run_id={ref} until "
                   f"ENGINE.ROLLING ({ToolName.READ_LOGS} with run_id={ref} shows boot progress).")
        run_status = "booting"
    return StartResult(message=message, run_id=run.run_id, name=run.name, status=run_status,
                       engine_state=state, snapshot_id=run.snapshot_id,
                       ajet_file=status.ajet_file if status is not None else None,
                       waited_s=waited, devices=devices,
                       queue_position=position if queued else None,
                       queue_reason=reason if queued else None)


def _raise_engine_died(err: LastError, *, run: str | None = None) -> None:
    tail = "\n".join(ln[:_LOG_LINE_CHARS] for ln in err.log_tail[-_TAIL_LINES:])
    which = f" with run_id={run}" if run else ""
    again = f" with name={run}" if run else ""
    raise tool_error(
        f"the engine died while starting (run {err.run_id}, exit code {err.exit_code}): "
        f"{err.reason[:800]}\nlog tail:\n{tail}",
        f"{ToolName.READ_LOGS}{which} for more; fix the code under ajet/ and call "
        f"{ToolName.SYNC_TRAIN_CODE}, or roll back with {ToolName.ACTIVATE_SNAPSHOT}; "
        f"then {ToolName.START_ENGINE}{again}",
    )


def stop_engine(bridge: Bridge, *, reason: str = "stopped by the research agent",
                stop_rollouts: bool = True, run_id: str | None = None) -> StopResult:
    """Stop this bridge's rollouts to a run (by default), then the run; idempotent.

    The run: `run_id` (an id or name), else the agent's latest run, else the default
    run. A queued run leaves the queue; a stopped run's devices go to the next queued one.
    """
    ref = bridge.run_ref(run_id)
    with swarm_errors(f"call {ToolName.LIST_RUNS} state='active' for the runs there are"):
        target = _find_run(bridge, ref)
    stopped = ([h.handle for h in bridge.rollouts.all()
                if h.running() and _rollouts_feed(h, ref, target)] if stop_rollouts else [])
    for handle in stopped:
        bridge.rollouts.stop(handle)
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}"):
        result = bridge.client.stop_run(None if ref == CURRENT_RUN else ref,
                                        reason=reason[:500])
    label = "" if ref == CURRENT_RUN else f" ({ref})"
    if result.stopped:
        waited = (f" It waited for the checkpoint(s) being written: "
                  f"{', '.join(result.waited_for)}." if result.waited_for else "")
        last = (f" Last complete checkpoint: {result.last_checkpoint} (resume_from="
                f"{result.run_id!r} continues from it)." if result.last_checkpoint else "")
        freed = "" if ref == CURRENT_RUN else " Its devices went back to the pool."
        message = (f"Run {result.run_id}{label} stopped; engine is {result.state}.{waited}{last}"
                   f"{freed} Next: {ToolName.SYNC_TRAIN_CODE} or {ToolName.CONFIGURE}, then "
                   f"{ToolName.START_ENGINE}.")
    elif result.message:
        message = (f"{result.message.rstrip('.')}{label}. Next: {ToolName.LIST_RUNS} "
                   "state='active'.")
    else:
        message = (f"No engine was running{label} (state {result.state}). Next: "
                   f"{ToolName.START_ENGINE} when ready.")
    return StopResult(message=message, stopped=result.stopped, run_id=result.run_id,
                      engine_state=result.state.value, rollouts_stopped=stopped,
                      waited_for=result.waited_for, last_checkpoint=result.last_checkpoint)


def _find_run(bridge: Bridge, ref: str) -> RunPublic | None:
    """The run `ref` names now, or None if the server has none by that ref."""
    try:
        return bridge.client.get_run(ref)
    except SwarmNotFound:
        return None


def _rollouts_feed(job: RolloutHandle, ref: str, run: RunPublic | None) -> bool:
    """Whether rollout job `job` sends its episodes to the run `ref` (resolved: `run`)."""
    if job.run is None:  # the default run, whichever it is now
        return ref == CURRENT_RUN or (run is not None and run.default_run)
    if job.run == ref:
        return True
    return run is not None and (job.run_id == run.run_id or job.run == run.name)


# ---------------------------------------------------------------------------- metrics, logs


def read_metrics(bridge: Bridge, *, run_id: str | None = None,
                 metrics: Sequence[str] | None = None, last_n: int = 20,
                 plot: bool = False) -> tuple[MetricsResult, bytes | None]:
    """Latest values, the trend over the last `last_n` steps, and optionally a PNG plot,
    of run `run_id` (an id or name; default: the agent's latest run, else 'current')."""
    run_id = bridge.run_ref(run_id)
    names = list(dict.fromkeys(metrics or DEFAULT_METRICS))
    last_n = max(1, min(last_n, 500))
    with swarm_errors(f"call {ToolName.LIST_RUNS} for valid run ids; if there is no run yet, "
                      f"{ToolName.CONFIGURE} and {ToolName.START_ENGINE}"):
        head = bridge.client.get_metrics(run_id, max_points=1)
        rid = head.run_id
        if not head.points or head.last_step is None:
            return MetricsResult(
                message=(f"Run {rid} has no metrics yet (a step needs batch_size x num_repeat "
                         f"episodes). Next: check {ToolName.ROLLOUT_STATUS}, then "
                         f"{ToolName.READ_METRICS} again."),
                run_id=rid, total_steps=head.total_steps, window="none",
            ), None
        since = max(-1, head.last_step - last_n)
        window = bridge.client.get_metrics(rid, since_step=since, fields=names)
    points = [p for p in window.points if _num(p.get("step")) is not None
              and p["step"] > head.last_step - last_n]
    latest = {k: _round(v) for k, v in head.points[-1].items()}
    trend = [_trend(name, points) for name in names]
    recent = [{k: _round(p.get(k)) for k in ["step", *names] if k in p} for p in points[-5:]]
    png: bytes | None = None
    if plot:
        with swarm_errors(f"call {ToolName.READ_METRICS} without plot"):
            full = bridge.client.get_metrics(rid, fields=names, max_points=300)
        png = plot_metrics_png(full.points, names, title=f"run {rid}")
    first_step = points[0]["step"] if points else head.last_step
    unknown = [t.metric for t in trend if t.points == 0]
    message = f"Run {rid}: {head.total_steps} step(s), last step {head.last_step}."
    if unknown:
        message += (f" No values for {', '.join(unknown)}; 'latest' lists the metric names "
                    "this run has.")
    message += (f" Next: {ToolName.READ_METRICS} again later, or {ToolName.COMPARE_RUNS} "
                 "against a baseline run.")
    return MetricsResult(
        message=message, run_id=rid, total_steps=head.total_steps, last_step=head.last_step,
        window=f"{first_step}-{head.last_step}", latest=latest, trend=trend, recent=recent,
        plot_attached=png is not None,
    ), png


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def _round(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


def _trend(name: str, points: Sequence[dict[str, Any]]) -> MetricTrend:
    pairs = [(float(p["step"]), v) for p in points if (v := _num(p.get(name))) is not None]
    if not pairs:
        return MetricTrend(metric=name)
    ys = [y for _, y in pairs]
    lo, hi = min(ys), max(ys)
    direction: Literal["up", "down", "flat"] = "flat"
    rise = 0.0
    if len(pairs) >= 2 and hi > lo:
        # Least-squares slope over the window: less fooled by one noisy end point than
        # last - first. "flat" when the fitted rise is under 10% of the observed range.
        xs = [x for x, _ in pairs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in pairs) / sxx if sxx else 0.0
        rise = slope * (xs[-1] - xs[0])
        if abs(rise) >= 0.1 * (hi - lo):
            direction = "up" if rise > 0 else "down"
    return MetricTrend(metric=name, first=_round(ys[0]), last=_round(ys[-1]), min=_round(lo),
                       max=_round(hi), mean=_round(sum(ys) / len(ys)),
                       change=_round(rise), direction=direction, points=len(ys))


def read_logs(bridge: Bridge, *, run_id: str | None = None, tail: int = 50,
              grep: str | None = None, regex: bool = False) -> LogsResult:
    """The last lines of a run's engine log, optionally only those containing `grep`
    (plain text), or matching it with `regex=True`. Plain text by default: a pattern is
    searched under a time budget on the server, and most searches need no pattern.
    The run: `run_id` (an id or name), else the agent's latest, else 'current'."""
    run_id = bridge.run_ref(run_id)
    if grep and regex:
        try:
            re.compile(grep)
        except re.error as exc:
            raise tool_error(f"grep {grep!r} is not a valid regular expression ({exc})",
                             f"call {ToolName.READ_LOGS} with a plain word or a valid "
                             "pattern") from exc
    tail = max(1, min(tail, 500))
    with swarm_errors(f"call {ToolName.LIST_RUNS} for run ids"):
        logs = bridge.client.get_run_logs(run_id, tail=tail, grep=grep or None, regex=regex)
    lines = [ln if len(ln) <= _LOG_LINE_CHARS else ln[:_LOG_LINE_CHARS] + " ...(cut)"
             for ln in logs.lines]
    kept: list[str] = []
    used = 0
    for line in reversed(lines):  # keep the newest lines within the size budget
        if used + len(line) > _LOG_TOTAL_CHARS:
            break
        kept.append(line)
        used += len(line) + 1
    kept.reverse()
    truncated = logs.truncated or len(kept) < len(lines)
    message = f"{len(kept)} line(s) of run {logs.run_id}'s log ({logs.total_lines} in all)."
    if len(kept) < len(lines):
        message += " Older lines cut to fit; use grep or a smaller tail to see others."
    message += (f" Next: {ToolName.READ_LOGS} with grep='Traceback' to find errors, or "
                f"{ToolName.ENGINE_STATUS}.")
    return LogsResult(message=message, run_id=logs.run_id, lines=kept,
                      total_lines=logs.total_lines, truncated=truncated)


# ---------------------------------------------------------------------------- runs


def _run_row(run: RunPublic) -> RunRow:
    reward = run.summary.get("reward_mean", {})
    return RunRow(
        run_id=run.run_id, name=run.name, status=run.status,
        experiment_name=run.experiment_name,
        snapshot_id=run.snapshot_id[:16], started=_iso(run.started_at) or "",
        ended=_iso(run.ended_at), last_step=run.last_step,
        reason=(run.reason or None) and str(run.reason)[:200],
        reward_last=_round(_num(reward.get("last"))), reward_best=_round(_num(reward.get("best"))),
        resumed_from=run.resumed_from, resume_step=run.resume_step,
        last_checkpoint=run.last_checkpoint, default_run=run.default_run, devices=run.devices,
        engine_state=run.engine_state.value if run.engine_state else None,
        queue_position=run.queue_position, queue_reason=run.queue_reason,
    )


def list_runs(bridge: Bridge, *, state: Literal["active", "ended", "all"] | None = None,
              experiment_name: str | None = None, status: str | None = None,
              offset: int = 0, limit: int = 10) -> RunsResult:
    """Runs, newest first, one small row each (`state='active'`: the running and queued
    ones, with their devices and queue positions), and the server's device pool."""
    limit = max(1, min(limit, 30))
    with swarm_errors(f"call {ToolName.LIST_RUNS} without filters"):
        page = bridge.client.list_runs(state=state, experiment_name=experiment_name,
                                       status=status, offset=max(0, offset), limit=limit)
    rows = [_run_row(r) for r in page.runs]
    next_offset = page.offset + len(rows) if page.offset + len(rows) < page.total else None
    label = {"active": "active ", "ended": "ended "}.get(state or "", "")
    message = f"{len(rows)} of {page.total} {label}run(s)."
    pool = None
    if page.devices is not None:
        d = page.devices
        pool = DevicePool(kind=d.kind, total=d.total, free=d.free, held=d.held, queued=d.queued)
        names = {r.run_id: r.name or r.run_id for r in page.runs}
        held = "; ".join(f"{names.get(rid, rid)} on {slots}" for rid, slots in d.held.items())
        if d.kind == "ray":  # no slots here: a run the cluster cannot hold is refused
            message += (" Devices: on a Ray cluster (the server's Ray launcher reserves each "
                        "run's nodes and GPUs there, and refuses a start it cannot hold).")
        else:
            message += (f" Devices ({d.kind}): {len(d.free)} of {d.total} free"
                        + (f"; {held}" if held else "")
                        + (f"; queued: {', '.join(names.get(q, q) for q in d.queued)}"
                           if d.queued else "") + ".")
    if next_offset is not None:
        message += f" More: {ToolName.LIST_RUNS} with offset={next_offset}."
    message += (f" Next: {ToolName.COMPARE_RUNS} with two or more run ids (or names); "
                f"{ToolName.STOP_ENGINE} with run_id=<name> stops a losing run and frees its "
                "devices.")
    return RunsResult(message=message, runs=rows, total=page.total, next_offset=next_offset,
                      devices=pool)


def list_checkpoints(bridge: Bridge, *, run_id: str | None = None) -> CheckpointsResult:
    """A run's checkpoints, and how a person downloads one (never through the agent)."""
    run_id = bridge.run_ref(run_id)
    with swarm_errors(f"call {ToolName.LIST_RUNS} for valid run ids"):
        page = bridge.client.list_checkpoints(run_id)
    complete = [c for c in page.checkpoints if c.complete]
    download = (f"ajet-swarm runs download {page.run_id} DIR --swarm-url {bridge.client.server_url}"
                if complete else None)
    message = (f"Run {page.run_id}: {len(page.checkpoints)} checkpoint(s), {len(complete)} "
               "complete.")
    message += (f" A person downloads one with: {download} [--checkpoint NAME]." if download
                else " None complete yet: a run saves every save_every steps and at stop.")
    return CheckpointsResult(message=message, run_id=page.run_id,
                             checkpoints=page.checkpoints[-20:], download=download)


def compare_runs(bridge: Bridge, run_ids: Sequence[str] | None = None, *,
                 metric: str = "reward_mean") -> CompareResult:
    """Per run: code snapshot, when and where it ran, metric first/last/best; config
    fields that differ; which runs ran side by side. Without `run_ids`: the active runs
    (a sweep in progress).

    The comparison itself is `ajet.run_compare` (shared with `SwarmClient.compare_runs`);
    this shapes it for a context window.
    """
    ids = list(dict.fromkeys(r.strip() for r in run_ids or [] if r.strip()))
    if not ids:
        with swarm_errors(f"call {ToolName.LIST_RUNS} and pass run ids"):
            active = bridge.client.list_runs(state="active", limit=6).runs
        ids = [r.run_id for r in active if r.status != "queued"]
        if len(ids) < 2:
            raise tool_error(
                f"compare_runs without run_ids compares the active runs, and {len(ids)} "
                "run(s) are running",
                f"call {ToolName.LIST_RUNS} and pass two or more run ids or names")
    if not 2 <= len(ids) <= 6:
        raise tool_error(f"compare_runs needs 2 to 6 distinct run ids, got {len(ids)}",
                         f"call {ToolName.LIST_RUNS} and pass two or more of its run ids")
    with swarm_errors(f"call {ToolName.LIST_RUNS} for valid run ids"):
        got = Comparison.model_validate(compare(bridge.client, ids, metric))
    if len(got.runs) < 2:
        raise tool_error(f"{', '.join(ids)} name one run ({got.runs[0].run_id})",
                         f"call {ToolName.LIST_RUNS} and pass two different runs")
    label = {r.run_id: r.name or r.run_id for r in got.runs}
    rows = [RunComparison(
        run_id=r.run_id, name=r.name, snapshot_id=r.snapshot_id[:16], status=r.status,
        experiment_name=r.experiment_name, started=_iso(r.started_at), ended=_iso(r.ended_at),
        devices=r.devices, steps=r.metric.points,
        first=_round(r.metric.first), last=_round(r.metric.last), best=_round(r.metric.best),
        best_step=r.metric.best_step,
    ) for r in got.runs]
    differences = {k: {rid: _round(v) for rid, v in vals.items()}
                   for k, vals in list(got.config_differences.items())[:30]}
    side = [RunOverlap(runs=list(o.runs), seconds=o.seconds) for o in got.overlaps[:15]]
    best = label.get(got.best_run or "") or (
        f"n/a (no values: check the metric name with {ToolName.READ_METRICS})")
    message = (f"Compared {len(rows)} runs on {metric} "
               f"({'higher' if got.higher_is_better else 'lower'} is better); best: {best}.")
    if side:
        together = {rid for o in got.overlaps for rid in o.runs}
        message += (" Side by side: " + "; ".join(
            f"{label[o.runs[0]]} and {label[o.runs[1]]} ({o.seconds:g}s together)"
            for o in got.overlaps[:4]) + ".")
        apart = [label[r.run_id] for r in got.runs if r.run_id not in together]
        if apart:
            message += f" Ran apart from the others: {', '.join(apart)}."
    else:
        message += " No two of them ran at the same time (one after another)."
    if not got.same_code:
        message += " The runs used different code snapshots."
    if differences:
        message += f" Config differs in: {', '.join(list(differences)[:8])}."
    message += (" Judge by last and best over the same number of steps. Next: keep the better "
                f"one and {ToolName.STOP_ENGINE} the others (run_id=<name>), or "
                f"{ToolName.ACTIVATE_SNAPSHOT} to roll back.")
    return CompareResult(message=message, metric=metric, runs=rows, same_code=got.same_code,
                         config_differences=differences, best_run=got.best_run,
                         side_by_side=side)


# ---------------------------------------------------------------------------- snapshots


def list_snapshots(bridge: Bridge, *, limit: int = 10) -> SnapshotsResult:
    """Code snapshots on the server, newest first, and which one is active."""
    limit = max(1, min(limit, 50))
    with swarm_errors(f"call {ToolName.ENGINE_STATUS}"):
        page = bridge.client.list_snapshots()
    snaps = sorted(page.snapshots, key=lambda s: s.created, reverse=True)
    rows = [SnapshotRow(snapshot_id=s.snapshot_id, created=_iso(s.created) or "",
                        files=s.file_count, bytes=s.total_bytes, active=s.active,
                        git_head=(s.provenance.git_head or None) and s.provenance.git_head[:12],
                        dirty=s.provenance.dirty, approved_by=s.approved_by)
            for s in snaps[:limit]]
    message = (f"{len(rows)} of {len(snaps)} snapshot(s); active: {page.active[:16]}. "
               f"Next: {ToolName.ACTIVATE_SNAPSHOT} with a snapshot_id (or 'server') to roll back.")
    return SnapshotsResult(message=message, active=page.active, snapshots=rows, total=len(snaps))


def activate_snapshot(bridge: Bridge, snapshot_id: str, *,
                      force_restart: bool = False) -> ActivateResult:
    """Make an earlier snapshot (or 'server') the active code, without an upload."""
    with swarm_errors(f"call {ToolName.LIST_SNAPSHOTS} for valid ids; {ToolName.STOP_ENGINE} "
                      "first or pass force_restart=true if the engine runs"):
        result = bridge.client.activate_snapshot(snapshot_id, force_restart=force_restart)
    if result.restarted:
        bridge.last_run = None  # the restarted run is the default run: 'current' again
        message = (f"Snapshot {result.snapshot_id[:16]} is active and run {result.run_id} "
                   f"restarted on it. Next: {ToolName.ENGINE_STATUS}, then "
                   f"{ToolName.START_ROLLOUTS}.")
    else:
        message = (f"Snapshot {result.snapshot_id[:16]} is active. Next: {ToolName.START_ENGINE}.")
    return ActivateResult(message=message, snapshot_id=result.snapshot_id, path=result.path,
                          activated=result.activated, restarted=result.restarted,
                          run_id=result.run_id, engine_state=result.state.value)


# ---------------------------------------------------------------------------- rollouts


def _rollout_info(job: RolloutHandle) -> RolloutInfo:
    error: str | None = None
    try:
        raw = job.stats()
    except Exception as exc:  # the runner's stats must never break a status call
        raw, error = {}, f"stats unavailable: {exc}"
    stats = {k: (v if isinstance(v, (int, float, bool, type(None))) else str(v)[:400])
             for k, v in list(raw.items())[:20]}
    return RolloutInfo(handle=job.handle, run=job.run, workflow=job.workflow,
                       running=job.running(),
                       n_workers=job.n_workers, num_repeat=job.num_repeat, tasks=job.tasks,
                       started=_iso(job.started_at) or "", stats=stats,
                       error=job.error or error)


def start_rollouts(bridge: Bridge, workflow: str, *, n_workers: int = 4,
                   num_repeat: int | None = None, max_episodes: int | None = None,
                   run_id: str | None = None) -> RolloutStartResult:
    """Run `workflow` ('package.module:function' in the repo) with N background workers,
    sending episodes to run `run_id` (an id or name; default: the agent's latest run,
    else the default run)."""
    if not re.fullmatch(r"[A-Za-z0-9_][\w./-]*:[A-Za-z_]\w*", workflow):
        raise tool_error(
            f"workflow {workflow!r} is not 'package.module:function' or 'path/file.py:function'",
            f"call {ToolName.START_ROLLOUTS} with e.g. 'examples/digits_workflow.py:workflow'")
    n_workers = max(1, min(n_workers, 64))
    ref = bridge.run_ref(run_id)
    target: RunPublic | None = None
    if ref != CURRENT_RUN:
        with swarm_errors(f"call {ToolName.LIST_RUNS} state='active' for run ids and names, "
                          f"or {ToolName.START_ENGINE} with name={ref} first"):
            target = bridge.client.get_run(ref)
        if target.status in ("ended", "failed"):
            raise tool_error(f"run {ref} ({target.run_id}) has {target.status}; it takes no "
                             "more episodes",
                             f"{ToolName.START_ENGINE} with name={target.name or ref} to start "
                             f"it again, or {ToolName.LIST_RUNS} state='active'")
    # A default run is followed across restarts (no run id on begin_episode); any other
    # run is addressed as given.
    run = None if target is None or target.default_run else ref
    if num_repeat is None:
        config = (_load_yaml(target.config_yaml) if target is not None and target.config_yaml
                  else current_config(bridge)[0])
        num_repeat = int((config or default_job_values()).get("num_repeat", 1))
    try:
        job = bridge.rollouts.start(workflow, n_workers=n_workers, num_repeat=num_repeat,
                                    max_episodes=max_episodes, run=run,
                                    run_id=target.run_id if target is not None else None)
    except Exception as exc:  # importing user code can raise anything; report it
        raise tool_error(
            f"cannot load workflow {workflow!r} from {bridge.repo}: {type(exc).__name__}: "
            f"{str(exc)[:800]}",
            "make sure the module is importable from the repo root and defines the function "
            f"and TASKS (or tasks()); then call {ToolName.START_ROLLOUTS} again",
        ) from exc
    with swarm_errors(f"call {ToolName.ROLLOUT_STATUS}"):
        status = (bridge.client.run_status(ref) if run is not None
                  else bridge.client.engine_status())
    which = f" for run {ref}" if run is not None else ""
    message = (f"Rollouts {job.handle} started{which}: {n_workers} worker(s), {job.tasks} "
               f"task(s) x {num_repeat}.")
    if status.queue_position is not None:
        message += (f" Run {ref} is queued (#{status.queue_position}): workers wait until it "
                    "boots and serves.")
    elif status.state not in SERVING_STATES:
        message += (f" The engine is {status.state}: workers wait until it serves; call "
                    f"{ToolName.START_ENGINE}.")
    message += (f" Next: {ToolName.READ_METRICS}{' with run_id=' + ref if run else ''} or "
                f"{ToolName.ROLLOUT_STATUS} with handle={job.handle}.")
    return RolloutStartResult(message=message, handle=job.handle, workflow=workflow,
                              n_workers=n_workers, num_repeat=num_repeat, tasks=job.tasks,
                              run=run)


def _load_yaml(text: str) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def rollout_status(bridge: Bridge, *, handle: str | None = None) -> RolloutStatusResult:
    """One rollout job, or all of this bridge's jobs (running first, at most 10)."""
    if handle:
        job = bridge.rollouts.get(handle)
        if job is None:
            raise tool_error(f"no rollouts with handle {handle!r}",
                             f"call {ToolName.ROLLOUT_STATUS} without a handle to list them")
        jobs = [job]
    else:
        jobs = sorted(bridge.rollouts.all(), key=lambda j: (not j.running(), -j.started_at))[:10]
    infos = [_rollout_info(j) for j in jobs]
    running = sum(1 for i in infos if i.running)
    message = f"{running} running, {len(infos) - running} stopped rollout job(s) shown."
    failing = next((i for i in infos if _rollout_failure(i)), None)
    if failing is not None:
        message += (f" Rollouts {failing.handle} are failing: {_rollout_failure(failing)} "
                    f"Next: fix the workflow, {ToolName.STOP_ROLLOUTS} if it still runs, then "
                    f"{ToolName.START_ROLLOUTS} again.")
    else:
        message += (f" Next: {ToolName.READ_METRICS}." if running else
                    f" Next: {ToolName.START_ROLLOUTS} to send episodes.")
    return RolloutStatusResult(message=message, rollouts=infos)


def _rollout_failure(info: RolloutInfo) -> str | None:
    """Why a rollout job produces no episodes: it stopped on a repeated error, or every
    episode so far failed in the workflow."""
    stats = info.stats
    if stats.get("stopped_reason") and not stats.get("run_ended"):  # not the run's end
        return str(stats["stopped_reason"])
    if info.error and not info.running:
        return info.error
    if stats.get("workflow_errors") and not stats.get("episodes_ended"):
        return (f"{stats['workflow_errors']} workflow error(s) and no episode ended; last: "
                f"{stats.get('last_error')}.")
    return None


def stop_rollouts(bridge: Bridge, *, handle: str | None = None) -> RolloutStopResult:
    """Stop one rollout job, or all of them; idempotent."""
    if handle:
        if bridge.rollouts.get(handle) is None:
            raise tool_error(f"no rollouts with handle {handle!r}",
                             f"call {ToolName.ROLLOUT_STATUS} to list handles")
        targets = [handle]
    else:
        targets = [j.handle for j in bridge.rollouts.all() if j.running()]
    stopped = [_rollout_info(job) for h in targets if (job := bridge.rollouts.stop(h)) is not None]
    message = (f"Stopped {len(stopped)} rollout job(s). Next: {ToolName.STOP_ENGINE} or "
               f"{ToolName.SYNC_TRAIN_CODE}.")
    return RolloutStopResult(message=message, stopped=stopped)
