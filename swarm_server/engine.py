"""`EngineController`: the training engine's state machine, its runs, and its process.

One controller per server. It owns the engine state (`ajet.protocol.EngineState`), the
current run, and the engine process (through a `supervisor.Spawner`). The rules:

- Every state change goes through `change_state(expected_from, to)`: a compare-and-set
  under one lock that also checks the edge is legal (`_EDGES`). A request in the wrong
  state gets `EngineStateConflict` (HTTP 409) naming the state and what to call next.
- Lifecycle operations (config, start, stop, code swap) also hold `_lifecycle`, so they
  never interleave: twenty concurrent starts launch exactly one engine.
- Every start is a run in the ledger. Two threads watch a run: one blocks on the process
  exit (a crash is noticed at once), one polls `GET /status` on the engine's socket
  every `settings.status_poll_s` and moves BOOTING -> the reported state, after checking
  the engine runs the active snapshot's code (every rank's content id, not its path).
  Any exit ends in OFFLINE with the run finalised; an exit nobody asked for also sets
  `last_error` with the log tail, and the engine's own `failure.json` (which rank
  failed, with which exception) in its reason and its traceback ahead of the tail.
- Stop = SIGTERM to the process group, grace, SIGKILL (`supervisor.stop_group`). The
  grace and the boot deadline are the run's: the job's `stop_grace_s` and
  `boot_timeout_s` (chosen by model size when unset) capped by the server's maxima, or
  the server's own values. A stop that finds a checkpoint being written says it waited
  for it; every run's end records its last complete checkpoint (`run_checkpoints`).
- A job with `resume_from` starts from the checkpoint it names (`--resume`); the run
  records the run and checkpoint it resumed from.
- A single-process start takes the warm standby when one is ready: an interpreter with
  torch and transformers imported that becomes the engine (`standby_keeper`); the
  next one is started once a config is accepted, and once an engine serves or ends.
- `recover()` at server start stops engines a killed server left behind (by pid and
  start time) and closes their runs.
- With approvers configured, no engine starts on code an approver has not approved,
  and no config is validated by it (`swarm_server.approvals`): every start goes through
  `_start_locked`, which asks first.

Lock order: `_lifecycle` before `_lock`; the ledger's own lock last. The exit and poll
threads take only `_lock`, so a stop holding `_lifecycle` can wait for them.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import yaml

from ajet.protocol import (
    ENGINE_FAILURE_FILE,
    SERVER_CODE,
    ConfigAccepted,
    EngineFailure,
    EngineReport,
    EngineState,
    EngineStatus,
    LastError,
    StopEngineResponse,
)
from ajet.errors import EngineStateConflict, SwarmHTTPError
from swarm_server.approvals import Approvals
from swarm_server.config_check import config_hash, is_inside, validate_job_yaml
from swarm_server.devices import DevicePool, devices_needed
from swarm_server.engine_user import EngineUser
from swarm_server.ledger import Ledger, RunRecord
from swarm_server.run_checkpoints import (
    ResumePoint,
    discard_partials,
    last_checkpoint,
    resolve_resume,
    saves_in_progress,
)
from swarm_server.run_files import (
    read_log_lines,
    read_metrics,
    read_trackers,
    redact_secrets,
    summarize,
)
from swarm_server.run_info import write_run_info
from swarm_server.server_code import ServerCode
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotRecord, SnapshotStore
from swarm_server.standby_keeper import StandbyKeeper
from swarm_server.supervisor import (
    EngineProbe,
    PosixSpawner,
    ProbeFactory,
    ProcessHandle,
    SocketProbe,
    Spawner,
    SpawnSpec,
    engine_env,
    stop_group,
)

__all__ = ["LAST_CONFIG_KEY", "SERVING_STATES", "EngineController", "PinnedJob",
           "engine_command", "job_fields"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Ledger meta key holding the last accepted job YAML (normalised); survives restarts.
LAST_CONFIG_KEY = "last_config_yaml"
#: States in which the engine serves the episode plane.
SERVING_STATES = (EngineState.ROLLING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING)
#: States with an engine process.
_ACTIVE_STATES = (EngineState.BOOTING, *SERVING_STATES)
#: Legal edges. OFFLINE -> BOOTING is a start; BOOTING -> serving is the first good
#: report; serving <-> serving follows the engine's reports; anything -> OFFLINE is an exit.
_EDGES: dict[EngineState, frozenset[EngineState]] = {
    EngineState.OFFLINE: frozenset({EngineState.BOOTING}),
    EngineState.BOOTING: frozenset({EngineState.OFFLINE, *SERVING_STATES}),
    **{s: frozenset({EngineState.OFFLINE, *SERVING_STATES} - {s}) for s in SERVING_STATES},
}
#: Lines of engine.log kept in `last_error.log_tail`.
LOG_TAIL_LINES = 50
#: AF_UNIX paths longer than this (bytes) do not bind on every platform.
_MAX_SOCKET_PATH = 100
#: How long a stop waits for the exit thread to finalise the run after the group is gone.
_FINISH_WAIT_S = 30.0
#: The most of `<run_dir>/failure.json` read (the engine bounds it well below this).
_FAILURE_FILE_BYTES = 256 * 1024


def engine_command(settings: Settings, *, run_id: str, run_dir: Path, socket_path: Path,
                   job: dict[str, object] | None = None, resume: Path | None = None
                   ) -> list[str]:
    """The engine's command line (docs/internals.md, "The engine process").

    A job with more than one process (`n_gpu` > 1, or `n_proc` > 1 on CPU, or `nnodes`
    > 1) runs under torchrun (docs/distributed.md); the engine's own arguments are the same.
    """
    engine_args = [
        "--config", str(run_dir / "job.yaml"), "--run-dir", str(run_dir),
        "--socket", str(socket_path), "--run-id", run_id, "--workdir", str(settings.workdir),
    ]
    if resume is not None:
        engine_args += ["--resume", str(resume)]
    fields: dict[str, object] = job or {}

    def number(key: str, default: int) -> int:  # the job was validated: ints or absent
        value = fields.get(key)
        return value if isinstance(value, int) else default

    n_gpu, n_proc, nnodes = number("n_gpu", 0), number("n_proc", 1), number("nnodes", 1)
    per_node = n_gpu if n_gpu > 0 else n_proc
    # Under Ray the launcher wraps the engine in each node's torchrun (ajet_ray_job)
    if (per_node <= 1 and nnodes <= 1) or settings.launcher == "ray":
        return [settings.engine_python, "-m", settings.engine_module, *engine_args]
    launcher = [settings.engine_python, "-m", "torch.distributed.run",
                f"--nproc_per_node={per_node}", "--max_restarts=0"]
    if nnodes <= 1:
        launcher.append("--standalone")
    else:  # static rendezvous: node 0 (rank 0, the episode plane) hosts it
        host, _, port = str(fields.get("rdzv_endpoint") or "").rpartition(":")
        launcher += [f"--nnodes={nnodes}", f"--node_rank={number('node_rank', 0)}",
                     f"--master_addr={host}", f"--master_port={port}"]
    return [*launcher, "-m", settings.engine_module, *engine_args]


def job_fields(yaml_text: str) -> dict[str, object]:
    """The top-level fields of a job YAML that was validated (a mapping, else empty)."""
    data = yaml.safe_load(yaml_text)
    return data if isinstance(data, dict) else {}


def run_limits(settings: Settings, job: dict[str, object]) -> tuple[float, float]:
    """(boot deadline, stop grace) in seconds of a run of `job`: the job's own, capped by
    the server's maxima, or the server's defaults where the job has none."""
    def pick(key: str, default: float, cap: float) -> float:
        value = job.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return min(float(value), cap)
        return default

    return (pick("boot_timeout_s", settings.boot_timeout_s, settings.max_boot_timeout_s),
            pick("stop_grace_s", settings.stop_grace_s, settings.max_stop_grace_s))


@dataclass(frozen=True)
class PinnedJob:
    """What a run of `POST /runs` runs: one snapshot and one validated job, fixed at its
    start request (the default run instead follows the active snapshot and the stored
    config)."""

    run_id: str
    snapshot_id: str  # SERVER_CODE for the server's own code
    yaml_text: str
    name: str | None = None


@dataclass
class _Run:
    """The run the controller is driving now (at most one)."""

    run_id: str
    run_dir: Path
    snapshot_base: Path | None
    boot_deadline: float  # time.monotonic() by which the engine must serve
    #: the active snapshot's id when the run started (None: the server's own code)
    snapshot_id: str | None = None
    boot_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    socket_path: Path | None = None
    socket_tmpdir: Path | None = None
    handle: ProcessHandle | None = None
    report: EngineReport | None = None
    served: bool = False  # a good report was accepted; the run is "running"
    stop_reason: str | None = None  # the server was asked to stop it (user, swap, shutdown)
    failure: str | None = None  # the server killed it for a fault (boot timeout, wrong code)
    finished: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    devices: list[int] = field(default_factory=list)


class EngineController:
    """State machine + runs + engine process. See the module docstring for the rules."""

    def __init__(self, settings: Settings, ledger: Ledger, snapshots: SnapshotStore, *,
                 spawner: Spawner | None = None, probe: ProbeFactory | None = None,
                 approvals: Approvals | None = None,
                 engine_user: EngineUser | None = None, devices: DevicePool | None = None,
                 pinned: PinnedJob | None = None,
                 on_run_end: Callable[[str], None] | None = None,
                 standby: bool = True) -> None:
        self.settings = settings
        #: the server's device slots, shared by every controller (None: no accounting)
        self.devices = devices
        #: a run of POST /runs: its snapshot and job; None: the default run's controller
        self.pinned = pinned
        #: called with the run id once a run has ended and its devices are free
        self.run_end_listener = on_run_end
        self.engine_user = engine_user  # --engine-user: every engine process runs as it
        self.ledger = ledger
        self.snapshots = snapshots
        self.approvals = approvals or Approvals(settings, ledger, snapshots,
                                                ServerCode(_installed_ajet_dir()))
        self.spawner: Spawner = spawner or PosixSpawner(as_user=engine_user)
        self.probe_factory: ProbeFactory = probe or (lambda path: SocketProbe(path))
        # The warm standby for the next start (real processes only). Built even with
        # settings.warm_standby off, so that recover() stops one an earlier server left.
        self._standby: StandbyKeeper | None = (
            StandbyKeeper(settings, ledger, self.spawner, engine_user=engine_user)
            if spawner is None and standby else None)
        self._lock = threading.RLock()  # guards the fields below; held only briefly
        self._lifecycle = threading.Lock()  # serialises config/start/stop/swap
        self._state = EngineState.OFFLINE
        self._since = time.time()
        self._run: _Run | None = None
        self._last_error: LastError | None = None
        self._last_run_id: str | None = None
        self._config_cache: tuple[str, str] = ("", "")  # (yaml, experiment_name)

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> EngineState:
        with self._lock:
            return self._state

    def change_state(self, expected_from: EngineState | tuple[EngineState, ...],
                     to: EngineState, *, hint: str = "", run: _Run | None = None) -> None:
        """Compare-and-set: move to `to` only if the state is one of `expected_from`.

        With `run`, also only if that run is still the current one (a late report of an
        old run must not move a new one). Raises `EngineStateConflict` (409) otherwise.
        """
        expected = (expected_from,) if isinstance(expected_from, EngineState) else expected_from
        with self._lock:
            current = self._state
            if current not in expected or (run is not None and run is not self._run):
                raise EngineStateConflict(
                    409,
                    f"engine is {current}; this needs {' or '.join(s.value for s in expected)}",
                    hint or _hint_for(current),
                )
            if to not in _EDGES[current]:
                raise EngineStateConflict(409, f"engine cannot go from {current} to {to}",
                                          hint or _hint_for(current))
            log.info("engine state %s -> %s", current, to)
            self._state = to
            self._since = time.time()

    def status(self) -> EngineStatus:
        with self._lock:
            state, since, run, last_error = self._state, self._since, self._run, self._last_error
            report = run.report if run else None
            pid = run.handle.pid if run and run.handle else None
        snapshot, yaml_text = self._source()
        source_id = snapshot.id if snapshot else SERVER_CODE
        return EngineStatus(
            approvals_enforced=self.approvals.enforced,
            snapshot_approval=self.approvals.state(source_id).state,
            state=state,
            run_id=run.run_id if run else (self.pinned.run_id if self.pinned else None),
            name=self.pinned.name if self.pinned else None,
            devices=list(run.devices) if run else [],
            snapshot_id=source_id,
            snapshot_path=snapshot.path if snapshot else None,
            pid=pid,
            step=report.step if report else None,
            # engine-written text a caller reads: a token in it is redacted
            ajet_file=redact_secrets(report.ajet_file, self.settings.secret_values())
            if report else None,
            trackers=read_trackers(run.run_dir) if run else {},
            has_config=bool(yaml_text),
            experiment_name=self._experiment_name(yaml_text) if yaml_text else None,
            last_error=last_error,
            since=since,
        )

    @property
    def last_error(self) -> LastError | None:
        """Why this controller's last run failed (None: it did not, or none ran yet)."""
        with self._lock:
            return self._last_error

    def serving_socket_of(self, run_id: str) -> Path | None:
        """The Unix socket of run `run_id`'s engine while it serves, else None (one lock:
        the episode plane asks on every call)."""
        with self._lock:
            run = self._serving_locked(run_id)
            return run.socket_path if run is not None else None

    def step_of(self, run_id: str) -> int | None:
        """Run `run_id`'s training step (updates done) at its last report while it
        serves, else None."""
        with self._lock:
            run = self._serving_locked(run_id)
            return run.report.step if run is not None and run.report else None

    def _serving_locked(self, run_id: str | None = None) -> _Run | None:
        """The serving run (`run_id`'s, if given), else None. Caller holds `_lock`."""
        run = self._run
        if run is None or self._state not in SERVING_STATES:
            return None
        return run if run_id is None or run.run_id == run_id else None

    def current_run_id(self) -> str | None:
        """The serving engine's run id, else None."""
        with self._lock:
            run = self._serving_locked()
            return run.run_id if run is not None else None

    def latest_run_id(self) -> str | None:
        """The run of the engine process if there is one, else the newest run ever."""
        with self._lock:
            if self._run is not None:
                return self._run.run_id
            if self._last_run_id is not None:
                return self._last_run_id
        runs, _ = self.ledger.list_runs(limit=1)
        return runs[0].id if runs else None

    def run_dir(self, run_id: str) -> Path:
        return self.settings.runs_dir / run_id

    # ------------------------------------------------------------------ config

    def set_config(self, yaml_text: str, *, role: str, check_only: bool = False
                   ) -> ConfigAccepted:
        """Validate with the active code's validator and store; only while OFFLINE.

        `check_only` validates and stores nothing, in any state: clients check a config
        before they stop a run for it, so a refused config leaves the run as it was.
        """
        action = "check_config" if check_only else "sync_config"
        if self.pinned is not None:
            raise EngineStateConflict(409, f"run {self.pinned.run_id} keeps the job it was "
                                      "started with", "start a new run with POST /runs")
        with self._lifecycle:
            try:
                state = self.state
                if state is not EngineState.OFFLINE and not check_only:
                    raise EngineStateConflict(
                        409, f"engine is {state}; the config can change only while ENGINE.OFFLINE",
                        "call stop_engine first, then sync_train_config; or use "
                        "auto_sync_train_config_and_start_engine(job, force_restart=True)",
                    )
                snapshot = self.snapshots.active()
                # the snapshot's own validator runs its code: only approved code may run
                self.approvals.require_runnable(
                    snapshot.id if snapshot else SERVER_CODE,
                    doing="validate the config with the active snapshot's code")
                base = self.snapshots.base_dir(snapshot) if snapshot else None
                checked = validate_job_yaml(self.settings, yaml_text, base_dir=base,
                                            engine_user=self.engine_user,
                                            extra_env=self.planner_env())
                self._resume_point(job_fields(checked.yaml_text))  # refused now, not at start
            except SwarmHTTPError as exc:
                self.ledger.audit(action, role, f"refused: {_short(exc.detail)}",
                                  {"status": exc.status})
                raise
            if not check_only:
                self.ledger.set_meta(LAST_CONFIG_KEY, checked.yaml_text)
            self.ledger.audit(action, role, "ok",
                              {"config_hash": checked.config_hash,
                               "experiment_name": checked.experiment_name})
        log.info("config %s: experiment %s, hash %s", "checked" if check_only else "accepted",
                 checked.experiment_name, checked.config_hash[:12])
        if not check_only:
            self._replenish_standby()  # a start is likely to follow
        return ConfigAccepted(config_hash=checked.config_hash,
                              experiment_name=checked.experiment_name, config=checked.config,
                              notes=checked.notes, memory=checked.memory)

    def planner_env(self) -> dict[str, str]:
        """What the memory planner is told about the devices a run can get: the memory of
        the nodes, from a launcher that knows them (Ray), or of the smallest of this
        server's GPU slots (`DevicePool.planner_env`)."""
        launcher = getattr(self.spawner, "planner_env", None)
        env = dict(launcher()) if launcher is not None else {}
        if self.devices is not None:
            env.update(self.devices.planner_env())
        return env

    def current_config(self) -> ConfigAccepted | None:
        """The stored job (what the next start uses), or None if none was ever sent."""
        text = self.ledger.get_meta(LAST_CONFIG_KEY)
        if text is None:
            return None
        data = job_fields(text)
        return ConfigAccepted(config_hash=config_hash(text),
                              experiment_name=str(data.get("experiment_name") or ""),
                              config=data)

    # ------------------------------------------------------------------ start / stop

    def start(self, *, role: str, force_restart: bool = False) -> str:
        """Start an engine on the last config; returns the new run id.

        409 without a config, or when not OFFLINE unless `force_restart` (which stops the
        running engine first). A spawn failure still returns the run id: the run is then
        `failed` and `status().last_error` says why.
        """
        with self._lifecycle:
            stopped: str | None = None
            try:
                state = self.state
                if state is not EngineState.OFFLINE and not force_restart:
                    raise EngineStateConflict(
                        409, f"engine is {state} (run {self.latest_run_id()}); it starts only from "
                        "ENGINE.OFFLINE",
                        "call stop_engine first, or start_engine(force_restart=True)",
                    )
                yaml_text = self._require_config()
                # before stopping anything: a refused start must not end the running run
                snapshot, _ = self._source()
                self.approvals.require_runnable(snapshot.id if snapshot else SERVER_CODE,
                                                doing="start the engine")
                self._require_devices(job_fields(yaml_text))
                if state is not EngineState.OFFLINE:
                    previous = self._stop_locked("restarted by start_engine(force_restart=True)")
                    stopped = previous.run_id
                run_id = self._start_locked(role)
            except SwarmHTTPError as exc:
                self.ledger.audit("start_engine", role, f"refused: {_short(exc.detail)}",
                                  {"status": exc.status, "force_restart": force_restart})
                raise
            rec = self.ledger.get_run(run_id)
            outcome = "ok" if rec is None or rec.status != "failed" else f"failed: {rec.reason}"
            self.ledger.audit("start_engine", role, outcome,
                              {"run_id": run_id, "force_restart": force_restart,
                               "stopped_run": stopped})
            return run_id

    def stop(self, *, role: str, reason: str) -> StopEngineResponse:
        """Stop the engine's process group (TERM, grace, KILL). Idempotent."""
        with self._lifecycle:
            result = self._stop_locked(reason)
        self.ledger.audit("stop_engine", role, "ok",
                          {"stopped": result.stopped, "run_id": result.run_id, "reason": reason})
        return result

    def swap_code(self, activate: Callable[[], T], *, force_restart: bool, role: str
                  ) -> tuple[T, bool, str | None]:
        """Change the active code with the engine down (docs/internals.md).

        Not OFFLINE and not `force_restart`: 409. Otherwise stop the engine if it runs,
        call `activate()`, and start again on the last config if it was running. Returns
        (activate's result, restarted, new run id or None). The caller audits the action.
        """
        with self._lifecycle:
            state = self.state
            if state is not EngineState.OFFLINE and not force_restart:
                raise EngineStateConflict(
                    409, f"engine is {state}; code can change only while ENGINE.OFFLINE",
                    "stop_engine first or pass force_restart=True",
                )
            was_running = state is not EngineState.OFFLINE
            if was_running:
                self._stop_locked("code swap (force_restart=True)")
            result = activate()
            if not was_running:
                return result, False, None
            run_id = self._start_locked(role)
            return result, True, run_id

    def recover(self) -> None:
        """Reconcile the ledger with reality after a server (re)start.

        Open runs whose engine still lives (same pid and start time) get their process
        group stopped and are marked ended; runs whose process is gone are marked failed.
        The last config stays in the ledger (meta `last_config_yaml`) and is used as is.
        """
        for rec in self.ledger.open_runs():
            handle = None
            if rec.pid is not None and rec.pid_start_time is not None:
                handle = self.spawner.adopt(rec.pid, rec.pid_start_time)
            if handle is not None:
                log.warning("stopping engine pid %s of run %s left by a previous server",
                            rec.pid, rec.id)
                grace_s = run_limits(self.settings, job_fields(rec.config_yaml))[1]
                stop_group(self.spawner, handle, grace_s=grace_s)
                status, reason = "ended", (f"server restarted: the engine (pid {rec.pid}) the "
                                           "previous server left running was stopped")
            else:
                status, reason = "failed", ("server restarted: the engine process was already "
                                            "gone (exit code unknown)")
            points = read_metrics(Path(rec.run_dir) / "metrics.jsonl")
            discard_partials(Path(rec.run_dir), run_id=rec.id)
            last = last_checkpoint(Path(rec.run_dir))
            self.ledger.update_run(
                rec.id, status=status, reason=reason, ended_at=time.time(),
                final_state=EngineState.OFFLINE.value,
                last_step=points[-1]["step"] if points else rec.last_step,
                summary=summarize(points), last_checkpoint=str(last.path) if last else None,
            )
            self.ledger.audit("recover", "server", "ok",
                              {"run_id": rec.id, "status": status, "reason": reason})
        runs, _ = self.ledger.list_runs(limit=1)
        with self._lock:
            self._last_run_id = runs[0].id if runs else None
        if self.ledger.get_meta(LAST_CONFIG_KEY):
            log.info("restored the last training config (experiment %s)",
                     self._experiment_name(self.ledger.get_meta(LAST_CONFIG_KEY) or ""))
        if self._standby is not None:  # after the runs: a standby-born engine is a run's
            self._standby.recover()
            if self.ledger.get_meta(LAST_CONFIG_KEY):  # else nothing can start before a config
                self._standby.ensure()

    def shutdown(self) -> None:
        """Stop the engine: the server never leaves an orphan behind on a clean exit."""
        if self._standby is not None:
            self._standby.close()  # first, so the engine's end does not start another
        with self._lifecycle:
            result = self._stop_locked("server shutdown")
        if result.stopped:
            log.info("stopped engine run %s at server shutdown", result.run_id)

    # ------------------------------------------------------------------ internals

    def _source(self) -> tuple[SnapshotRecord | None, str | None]:
        """(snapshot, job YAML) the next start runs: the pinned ones, or the active
        snapshot and the stored config."""
        if self.pinned is not None:
            snapshot = (None if self.pinned.snapshot_id == SERVER_CODE
                        else self.snapshots.get(self.pinned.snapshot_id))
            return snapshot, self.pinned.yaml_text
        return self.snapshots.active(), self.ledger.get_meta(LAST_CONFIG_KEY)

    def _require_config(self) -> str:
        _, yaml_text = self._source()
        if not yaml_text:
            raise EngineStateConflict(409, "no training config on the server",
                                      "call sync_train_config(job) first, then start_engine")
        return yaml_text

    def _require_devices(self, job: dict[str, object]) -> None:
        """409 unless the job's devices are free (counting the ones this controller's
        own run holds, which a restart gives back first)."""
        if self.devices is None:
            return
        need = devices_needed(job, self.devices.kind)
        with self._lock:
            own = len(self._run.devices) if self._run is not None else 0
        if need > len(self.devices.free()) + own:
            raise self.devices.busy(need, own)

    def _start_locked(self, role: str) -> str:
        """Create the run and spawn its engine. Caller holds `_lifecycle`."""
        yaml_text = self._require_config()
        snapshot, _ = self._source()
        snapshot_ref = snapshot.id if snapshot else SERVER_CODE
        if self.pinned is not None and self.pinned.snapshot_id != SERVER_CODE \
                and snapshot is None:
            raise SwarmHTTPError(404, f"snapshot {self.pinned.snapshot_id[:12]} is no longer "
                                      "stored", "sync the code again and start a new run")
        # The one gate every start passes (start, force_restart, restart after a swap).
        self.approvals.require_runnable(snapshot_ref, doing="start the engine")
        base = self.snapshots.base_dir(snapshot).resolve() if snapshot else None
        job = job_fields(yaml_text)
        resume = self._resume_point(job)
        boot_s, grace_s = run_limits(self.settings, job)
        run_id = (self.pinned.run_id if self.pinned is not None else
                  f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}")
        devices: list[int] = []
        if self.devices is not None:
            need = devices_needed(job, self.devices.kind)
            granted = self.devices.acquire(run_id, need)
            if granted is None:
                raise self.devices.busy(need)
            devices = granted
        run = _Run(run_id=run_id, run_dir=self.run_dir(run_id), snapshot_base=base,
                   boot_deadline=time.monotonic() + boot_s, boot_timeout_s=boot_s,
                   stop_grace_s=grace_s, snapshot_id=snapshot.id if snapshot else None,
                   devices=devices)
        with self._lock:
            # OFFLINE -> BOOTING: the compare-and-set that makes concurrent starts safe
            try:
                self.change_state(EngineState.OFFLINE, EngineState.BOOTING,
                                  hint="call stop_engine first, or start_engine"
                                       "(force_restart=True)")
            except EngineStateConflict:
                if self.devices is not None:
                    self.devices.release(run_id)
                raise
            self._run = run
            self._last_error = None
            self._last_run_id = run_id
        record = dict(
            snapshot_id=snapshot_ref, config_yaml=yaml_text,
            config_hash=config_hash(yaml_text), experiment_name=self._experiment_name(yaml_text),
            started_by=role, started_at=time.time(), run_dir=str(run.run_dir), status="booting",
            resumed_from=resume.checkpoint.run_id if resume else None,
            resume_checkpoint=str(resume.checkpoint.path) if resume else None,
            resume_step=resume.checkpoint.step if resume else None,
            name=self.pinned.name if self.pinned else None,
            default_run=self.pinned is None, devices=devices)
        if self.pinned is not None and self.ledger.get_run(run_id) is not None:
            self.ledger.update_run(run_id, **record)  # it waited in the queue
        else:
            self.ledger.create_run(RunRecord(id=run_id, **record))
        if resume is not None:
            log.info("run %s resumes from %s (step %d, run %s)", run_id,
                     resume.checkpoint.path, resume.checkpoint.step, resume.checkpoint.run_id)
        try:
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "job.yaml").write_text(yaml_text, encoding="utf-8")
            write_run_info(run.run_dir, snapshot=snapshot,
                           approval=self.approvals.state(snapshot.id if snapshot else SERVER_CODE),
                           mlflow_tracking_uri=self.settings.mlflow_uri())
            run.socket_path, run.socket_tmpdir = _socket_path(run.run_dir, run_id)
            log_path = run.run_dir / "engine.log"
            if base is not None:
                line = ("[start_engine] Using synced training code from "
                        f"./{_relative(base / 'ajet', self.settings.workdir)}")
                log.info("%s", line)
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            if self.engine_user is not None:  # the engine writes there as its own user
                self.engine_user.share_run_dir(run.run_dir)
                if run.socket_tmpdir is not None:
                    self.engine_user.share(run.socket_tmpdir, 0o770)
            env = engine_env(self.settings, base, user=self.engine_user)
            if self.devices is not None:
                env.update(self.devices.environment(devices))
            spec = SpawnSpec(
                argv=engine_command(self.settings, run_id=run_id, run_dir=run.run_dir,
                                    socket_path=run.socket_path, job=job,
                                    resume=resume.checkpoint.path if resume else None),
                cwd=run.run_dir, env=env, log_path=log_path,
            )
            handle = self._standby.take(spec) if self._standby is not None else None
            warm = handle is not None
            if handle is None:
                handle = self.spawner.start(spec)
        except OSError as exc:
            self._finish(run, exit_code=None, spawn_error=f"could not start the engine: {exc}")
            return run_id
        except SwarmHTTPError as exc:  # the launcher refused it (a Ray cluster too full)
            self._finish(run, exit_code=None, spawn_error=f"the launcher refused the run: "
                                                          f"{exc.detail}")
            raise
        with self._lock:
            run.handle = handle
        self.ledger.update_run(run_id, pid=handle.pid, pid_start_time=handle.start_time)
        log.info("engine run %s started: pid %s, snapshot %s%s%s", run_id, handle.pid,
                 snapshot_ref, f", devices {devices}" if self.devices is not None else "",
                 " (warm standby)" if warm else "")
        threading.Thread(target=self._watch_exit, args=(run, handle), daemon=True,
                         name=f"engine-exit-{run_id}").start()
        threading.Thread(target=self._poll_status, args=(run, handle, run.socket_path),
                         daemon=True,
                         name=f"engine-poll-{run_id}").start()
        return run_id

    def _stop_locked(self, reason: str) -> StopEngineResponse:
        """Stop the current run's process group. Caller holds `_lifecycle`."""
        with self._lock:
            run = self._run
            if run is None:
                return StopEngineResponse(stopped=False, run_id=None, state=self._state)
            if run.stop_reason is None and run.failure is None:
                run.stop_reason = reason
            handle = run.handle
        stopped = False
        saving = saves_in_progress(run.run_dir)
        if saving:
            log.info("run %s is writing checkpoint(s) %s: the stop waits for them (up to "
                     "%g s)", run.run_id, ", ".join(saving), run.stop_grace_s)
        if handle is not None:
            stopped = stop_group(self.spawner, handle, grace_s=run.stop_grace_s)
        if not run.done.wait(_FINISH_WAIT_S):
            log.error("run %s not finalised %ss after its process group was stopped",
                      run.run_id, _FINISH_WAIT_S)
        last = last_checkpoint(run.run_dir)
        message = (f"stopped run {run.run_id}" if stopped else f"run {run.run_id} was not running")
        if saving:
            message += f"; waited for the checkpoint(s) being written: {', '.join(saving)}"
        message += (f"; last complete checkpoint: {last.path} (step {last.step})" if last
                    else "; no complete checkpoint")
        return StopEngineResponse(stopped=stopped, run_id=run.run_id, state=self.state,
                                  waited_for=saving, message=message,
                                  last_checkpoint=str(last.path) if last else None)

    def _resume_point(self, job: dict[str, object]) -> ResumePoint | None:
        """The checkpoint the job's `resume_from` names (422 when there is none)."""
        value = job.get("resume_from")
        if not isinstance(value, str) or not value:
            return None
        return resolve_resume(value, ledger=self.ledger,
                              experiment_name=str(job.get("experiment_name") or ""),
                              runs_dir=self.settings.runs_dir)

    def _watch_exit(self, run: _Run, handle: ProcessHandle) -> None:
        """Thread: block until the engine exits, clear its group, finalise the run."""
        self.spawner.wait(handle, None)
        with self._lock:
            stopping = run.stop_reason is not None or run.failure is not None
        if not stopping and self.spawner.group_alive(handle):
            # The leader died on its own; what it left in its group goes too.
            stop_group(self.spawner, handle, grace_s=0.0, kill_wait_s=5.0)
        self._finish(run, exit_code=handle.returncode)

    def _poll_status(self, run: _Run, handle: ProcessHandle, socket_path: Path) -> None:
        """Thread: poll the engine's report while it lives; enforce boot timeout and code."""
        probe: EngineProbe = self.probe_factory(socket_path)
        try:
            while not run.done.is_set() and not handle.exited:
                report = probe.get_report()
                if report is not None:
                    self._on_report(run, handle, report)
                with self._lock:
                    booting = self._run is run and self._state is EngineState.BOOTING
                if booting and time.monotonic() > run.boot_deadline:
                    self._fail(run, handle,
                               f"boot timeout: the engine did not serve within "
                               f"{run.boot_timeout_s:g}s (the job's boot_timeout_s, capped "
                               "by settings.max_boot_timeout_s, else settings.boot_timeout_s)")
                run.done.wait(self.settings.status_poll_s)
        except Exception as exc:  # noqa: BLE001 - a dead watcher would leave BOOTING forever
            log.exception("run %s: status watcher failed", run.run_id)
            self._fail(run, handle, f"the server's status watcher failed: {exc!r}")
        finally:
            probe.close()

    def _on_report(self, run: _Run, handle: ProcessHandle, report: EngineReport) -> None:
        problem: str | None = None
        became_running = False
        with self._lock:
            if self._run is not run or run.finished or run.stop_reason or run.failure:
                return
            run.report = report
            if not run.served:
                problem = self._code_problem(run, report)
                if problem is None and report.state in SERVING_STATES:
                    run.served = became_running = True
            if problem is None and run.served and report.state is not self._state \
                    and report.state in SERVING_STATES:
                try:
                    self.change_state(_ACTIVE_STATES, report.state, run=run)
                except EngineStateConflict:
                    return  # the run ended between the report and now
        if problem is not None:
            self._fail(run, handle, problem)
        elif became_running:
            self.ledger.update_run(run.run_id, status="running", last_step=report.step)
            self._replenish_standby()  # now, not while the engine boots: 2 cores are few

    def _code_problem(self, run: _Run, report: EngineReport) -> str | None:
        """Why the engine does not run the active snapshot's code, or None if it does.

        Every rank reports the content id of the ajet/ tree it imported; each must be
        the active snapshot's id, wherever that node keeps its copy. Code from before
        content ids reports none: then rank 0's node is checked by path.
        """
        if run.snapshot_base is None or run.snapshot_id is None:
            return None
        if report.snapshot_id is None:
            for path in [report.ajet_file, *report.ranks_ajet_files]:
                if not is_inside(Path(path), run.snapshot_base):
                    return (f"the engine imported ajet from {path}, not from the active "
                            f"snapshot {run.snapshot_base}; refusing to train on stale code")
            return None
        for rank, ident in enumerate(report.ranks_snapshot_ids or [report.snapshot_id]):
            if ident != run.snapshot_id:
                files = report.ranks_ajet_files
                where = files[rank] if rank < len(files) else report.ajet_file
                return (f"rank {rank} imported ajet {(ident or 'of unknown content')[:12]} "
                        f"from {where}, not from the active snapshot {run.snapshot_id[:12]}; "
                        "refusing to train on stale code (sync the same code to every node)")
        return None

    def _fail(self, run: _Run, handle: ProcessHandle, reason: str) -> None:
        """The server stops a run for a fault; `_finish` records it as failed."""
        with self._lock:
            if run.finished or run.failure or run.stop_reason:
                return
            run.failure = reason
        log.error("run %s: %s; stopping the engine", run.run_id, reason)
        stop_group(self.spawner, handle, grace_s=run.stop_grace_s)

    def _finish(self, run: _Run, *, exit_code: int | None, spawn_error: str | None = None
                ) -> None:
        """Finalise a run once: OFFLINE, ledger row closed, `last_error` on a fault."""
        if self.engine_user is not None and not run.finished:
            # what escaped the process group goes too, before the folder is sealed
            standby = self._standby.pid if self._standby is not None else None
            self.engine_user.stop_strays(keep={standby} if standby else set())
            if run.run_dir.is_dir():
                self.engine_user.seal_run_dir(run.run_dir)
        points = read_metrics(run.run_dir / "metrics.jsonl")
        tail, _, _ = read_log_lines(run.run_dir / "engine.log", tail=LOG_TAIL_LINES,
                                    redact=self.settings.secret_values())
        if not run.finished:  # the engine is gone: what it left half-written goes
            discard_partials(run.run_dir, run_id=run.run_id)
        with self._lock:
            if run.finished:
                return
            run.finished = True
            final_state = self._state if self._run is run else EngineState.OFFLINE
            if spawn_error is not None:
                failed, reason = True, spawn_error
            elif run.failure is not None:
                failed, reason = True, run.failure
            elif run.stop_reason is not None:
                failed, reason = False, run.stop_reason
            elif exit_code == 0:
                failed, reason = False, "the engine exited by itself (code 0)"
            else:
                failed, reason = True, (f"the engine {_describe_exit(exit_code)} while "
                                        f"{final_state}")
                if run.handle is not None and run.handle.detail:  # the launcher's word
                    reason += f"; {run.handle.detail}"  # on the node and rank that ended it
                failure = _engine_failure(run.run_dir)
                if failure is not None:  # its own word on which rank failed, and how
                    reason += f": {failure.describe()}"
                    tail = [f"[rank {failure.rank}] {line}" for line in failure.traceback
                            ] + ["..."] + tail
            if failed:
                self._last_error = LastError(run_id=run.run_id, exit_code=exit_code,
                                             reason=reason, log_tail=tail, at=time.time())
            if self._run is run:
                if self._state is not EngineState.OFFLINE:
                    self.change_state(_ACTIVE_STATES, EngineState.OFFLINE, run=run)
                self._run = None
            last_step = points[-1]["step"] if points else (run.report.step if run.report else None)
            last = last_checkpoint(run.run_dir)
            try:
                self.ledger.update_run(
                    run.run_id, status="failed" if failed else "ended", ended_at=time.time(),
                    final_state=final_state.value, exit_code=exit_code, reason=reason,
                    last_step=last_step, summary=summarize(points),
                    last_checkpoint=str(last.path) if last else None,
                )
            except Exception:  # noqa: BLE001 - the engine is gone either way; never block stop
                log.exception("run %s: could not record its end in the ledger", run.run_id)
        (log.error if failed else log.info)("run %s ended: %s (exit code %s)", run.run_id,
                                            reason, exit_code)
        if run.socket_tmpdir is not None:
            shutil.rmtree(run.socket_tmpdir, ignore_errors=True)
        if self.devices is not None:
            self.devices.release(run.run_id)
        run.done.set()
        self._replenish_standby()
        if self.run_end_listener is not None:
            self.run_end_listener(run.run_id)

    def _replenish_standby(self) -> None:
        if self._standby is not None:
            self._standby.ensure()

    def _experiment_name(self, yaml_text: str) -> str:
        cached_text, cached_name = self._config_cache
        if yaml_text == cached_text:
            return cached_name
        try:
            data = yaml.safe_load(yaml_text)
        except yaml.YAMLError:
            data = None
        name = str(data.get("experiment_name") or "") if isinstance(data, dict) else ""
        self._config_cache = (yaml_text, name)
        return name


# ---------------------------------------------------------------------------- helpers


def _hint_for(state: EngineState) -> str:
    if state is EngineState.OFFLINE:
        return "call sync_train_config(job) if needed, then start_engine"
    return "call stop_engine first, or pass force_restart=True"


def _socket_path(run_dir: Path, run_id: str) -> tuple[Path, Path | None]:
    """`<run_dir>/engine.sock`, or a fresh 0700 temp dir when that path is too long."""
    path = run_dir / "engine.sock"
    if len(str(path).encode()) <= _MAX_SOCKET_PATH:
        return path, None
    tmpdir = Path(tempfile.mkdtemp(prefix="ajet-"))  # mkdtemp creates it 0700
    return tmpdir / f"ajet-{run_id}.sock", tmpdir


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"



def _engine_failure(run_dir: Path) -> EngineFailure | None:
    """The engine's record of its first failure (`<run_dir>/failure.json`), if any."""
    path = run_dir / ENGINE_FAILURE_FILE
    try:
        with open(path, "rb") as f:
            return EngineFailure.model_validate_json(f.read(_FAILURE_FILE_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # a torn or foreign file: the exit code stands alone
        log.warning("could not read %s: %s", path, exc)
        return None


def _installed_ajet_dir() -> Path:
    import ajet  # the server's own installed copy, never a snapshot

    return Path(ajet.__file__).resolve().parent


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _short(detail: object, limit: int = 200) -> str:
    if isinstance(detail, list):
        fields = [".".join(str(p) for p in e.get("loc", [])) for e in detail if isinstance(e, dict)]
        text = f"invalid field(s): {', '.join(f or '(job)' for f in fields)}"
    else:
        text = str(detail)
    return text if len(text) <= limit else text[: limit - 3] + "..."
