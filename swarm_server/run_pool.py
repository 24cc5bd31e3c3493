"""`RunPool`: several runs at once, each on its own snapshot, job and devices.

A run is the unit. Each active run has its own `EngineController` (its state machine,
process, private socket and `last_error`):

- the **default run**'s controller is the single-engine surface (`/start_engine`,
  `/get_engine_status`, `/begin_episode` without a run, the original client): it follows
  the active snapshot and the stored config, as before concurrent runs;
- a run of `POST /runs` gets a controller of its own, pinned to the snapshot and the job
  it was started with (`engine.PinnedJob`), and is dropped from the pool when it ends
  (the ledger keeps its record).

Devices come from one `DevicePool`. A run whose devices are busy waits in a FIFO queue
(a ledger row with status `queued`, so a server restart re-queues it); the head starts
when enough slots are free, and nothing behind it jumps ahead (no backfill: a position
only ever moves forward). A run that needs more slots than the server has is refused.
Under the Ray launcher the pool counts nothing and Ray decides: a run its cluster cannot
hold now (`supervisor.PlacementRefused`) waits in the same queue, tried again when a run
ends and every `PLACEMENT_RETRY_S` (the cluster may be shared); one that not even the idle
cluster could hold is refused.

Approvals stay per snapshot: every start passes the controller's approval gate, and
`stop_unrunnable` (after a revoke or a denial) stops every active run, and drops every
queued one, whose snapshot may no longer run.

Lock order: the pool's `_lock`, then a controller's locks. Controllers call back
(`_on_run_end`) from their exit threads without the pool's lock; the queue is drained in
a thread of its own.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ajet.errors import EngineStateConflict, SwarmHTTPError, SwarmNotFound
from ajet.protocol import (
    SERVER_CODE,
    DevicePoolStatus,
    EngineState,
    EngineStatus,
    LastError,
    StartRunRequest,
    StopEngineResponse,
)
from swarm_server.approvals import Approvals
from swarm_server.config_check import config_hash, validate_job_yaml
from swarm_server.devices import DevicePool, devices_needed
from swarm_server.engine import (
    LAST_CONFIG_KEY,
    LOG_TAIL_LINES,
    EngineController,
    PinnedJob,
    job_fields,
)
from swarm_server.engine_user import EngineUser
from swarm_server.ledger import ACTIVE_RUN_STATUSES, Ledger, RunRecord
from swarm_server.run_checkpoints import resolve_resume
from swarm_server.run_files import read_log_lines
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore
from swarm_server.supervisor import PlacementRefused

__all__ = ["RunPool"]

log = logging.getLogger(__name__)

ControllerFactory = Callable[[PinnedJob], EngineController]

#: The `last_error`s of ended runs kept in memory (with the controller's log tail and the
#: failing rank's traceback); older ones are rebuilt from the ledger and engine.log.
_ENDED_ERRORS_KEPT = 256
#: Seconds between tries of a queued run the launcher could not place (Ray), besides the
#: try after each run's end: resources other users of the cluster free are seen too.
PLACEMENT_RETRY_S = 30.0


@dataclass
class _Queued:
    job: PinnedJob
    need: int
    queued_at: float
    role: str
    #: the launcher's last refusal to place it (Ray), else None (it waits for slots)
    placement: str | None = None


class RunPool:
    """The active runs: the default run's controller, the runs of `POST /runs`, the queue."""

    def __init__(self, settings: Settings, ledger: Ledger, snapshots: SnapshotStore,
                 approvals: Approvals, default: EngineController, devices: DevicePool, *,
                 engine_user: EngineUser | None = None,
                 controller_factory: ControllerFactory | None = None) -> None:
        self.settings = settings
        self.ledger = ledger
        self.snapshots = snapshots
        self.approvals = approvals
        self.default = default
        self.devices = devices
        self.engine_user = engine_user
        default.run_end_listener = self._on_run_end
        self._make = controller_factory or self._controller
        self._lock = threading.RLock()
        self._lanes: dict[str, EngineController] = {}  # run id -> controller (POST /runs)
        self._queue: list[_Queued] = []
        #: run id -> its controller's `last_error`, once the run ended (its lane is gone)
        self._ended_errors: OrderedDict[str, LastError] = OrderedDict()
        self._placing: str | None = None  # the run being launched (a refusal is no end)
        self._retry: threading.Timer | None = None  # the next try of an unplaced run
        self.placement_retry_s = PLACEMENT_RETRY_S

    # ------------------------------------------------------------------ start / stop

    def start(self, request: StartRunRequest, *, role: str) -> str:
        """Validate, then start the run now or queue it; returns its run id.

        404 unknown snapshot, 409 approval pending / name taken / no config / can never
        fit / busy with `queue=False`, 422 an invalid job. Nothing is recorded on a refusal.
        """
        try:
            job, need = self._admit(request)
        except SwarmHTTPError as exc:
            self.ledger.audit("start_run", role, f"refused: {str(exc.detail)[:200]}",
                              {"status": exc.status, "name": request.name})
            raise
        with self._lock:
            if self._queue or need > len(self.devices.free()):
                if not request.queue:
                    raise self.devices.busy(need)
                self._enqueue(job, need, role)
                return job.run_id
            try:
                self._launch(job, role)
            except PlacementRefused as exc:
                if exc.never or not request.queue:
                    raise
                queued = _Queued(job, need, time.time(), role, placement=str(exc.detail))
                self._queue.append(queued)
                self._requeued(queued)
        return job.run_id

    def stop(self, ref: str, *, role: str, reason: str) -> StopEngineResponse:
        """Stop a run by id or name (a queued one leaves the queue). Idempotent."""
        run_id = self.resolve(ref)
        with self._lock:
            queued = next((q for q in self._queue if q.job.run_id == run_id), None)
            if queued is not None:
                self._queue.remove(queued)
                self.ledger.update_run(run_id, status="ended", ended_at=time.time(),
                                       reason=f"stopped while queued: {reason}",
                                       final_state=EngineState.OFFLINE.value)
                self.ledger.audit("stop_run", role, "ok", {"run_id": run_id, "queued": True})
                return StopEngineResponse(stopped=False, run_id=run_id,
                                          state=EngineState.OFFLINE,
                                          message=f"run {run_id} left the queue; it never "
                                                  "started")
            lane = self._lanes.get(run_id)
        if lane is not None:
            result = lane.stop(role=role, reason=reason)
        elif self.default.latest_run_id() == run_id and \
                self.default.state is not EngineState.OFFLINE:
            result = self.default.stop(role=role, reason=reason)
        else:
            rec = self.ledger.get_run(run_id)
            return StopEngineResponse(stopped=False, run_id=run_id, state=EngineState.OFFLINE,
                                      message=f"run {run_id} is not running (status "
                                              f"{rec.status if rec else 'unknown'})",
                                      last_checkpoint=rec.last_checkpoint if rec else None)
        return result

    def stop_unrunnable(self, *, role: str, why: Callable[[str], str]) -> list[str]:
        """Stop every active run, and drop every queued one, whose snapshot may no longer
        run (`why(snapshot_id)` is the reason recorded). Returns the run ids affected."""
        affected: list[str] = []
        with self._lock:
            for queued in list(self._queue):
                if not self.approvals.runnable(queued.job.snapshot_id):
                    self._queue.remove(queued)
                    self.ledger.update_run(queued.job.run_id, status="failed",
                                           ended_at=time.time(),
                                           final_state=EngineState.OFFLINE.value,
                                           reason=f"dropped from the queue: "
                                                  f"{why(queued.job.snapshot_id)}")
                    affected.append(queued.job.run_id)
            controllers = [self.default, *self._lanes.values()]
        for controller in controllers:
            status = controller.status()
            if status.state is not EngineState.OFFLINE and \
                    not self.approvals.runnable(status.snapshot_id):
                controller.stop(role=role, reason=why(status.snapshot_id))
                affected.append(str(status.run_id))
        return affected

    def shutdown(self) -> None:
        """Stop every run's engine; queued runs stay queued for the next server."""
        with self._lock:
            lanes = list(self._lanes.values())
            self._queue.clear()
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
        for lane in lanes:
            lane.shutdown()
        self.default.shutdown()

    def recover(self) -> None:
        """After a server start: reconcile what an earlier server left (the default
        controller does it for every run with a process), then re-queue its queued runs."""
        self.default.recover()
        records, _ = self.ledger.list_runs(statuses=("queued",), limit=1000)
        with self._lock:
            for rec in sorted(records, key=lambda r: r.started_at):
                job = PinnedJob(run_id=rec.id, snapshot_id=rec.snapshot_id,
                                yaml_text=rec.config_yaml, name=rec.name)
                need = devices_needed(job_fields(rec.config_yaml), self.devices.kind)
                self._queue.append(_Queued(job, need, rec.started_at, rec.started_by))
        if records:
            log.info("re-queued %d run(s) an earlier server had queued", len(records))
            self._drain()

    # ------------------------------------------------------------------ lookup

    def resolve(self, ref: str) -> str:
        """The run id `ref` names: a run id, a name (the active run with it, else the
        newest run with it), or `current` (the default run, else the newest run)."""
        if ref == "current":
            run_id = self.default.latest_run_id()
            if run_id is None:
                raise SwarmNotFound(404, "no run yet",
                                    "call sync_train_config and start_engine (or POST /runs)")
            return run_id
        with self._lock:
            if ref in self._lanes or any(q.job.run_id == ref for q in self._queue):
                return ref
            for run_id, lane in self._lanes.items():
                if lane.pinned is not None and lane.pinned.name == ref:
                    return run_id
            for queued in self._queue:
                if queued.job.name == ref:
                    return queued.job.run_id
        if self.ledger.get_run(ref) is not None:
            return ref
        named, _ = self.ledger.list_runs(name=ref, limit=1)
        if named:
            return named[0].id
        raise SwarmNotFound(404, f"no run {ref!r}",
                            "call list_runs (GET /runs) for the run ids and names")

    def controller(self, run_id: str) -> EngineController | None:
        """The controller driving `run_id` now, if it is active and not queued."""
        with self._lock:
            lane = self._lanes.get(run_id)
        if lane is not None:
            return lane
        return self.default if self.default.latest_run_id() == run_id and \
            self.default.state is not EngineState.OFFLINE else None

    def status(self, ref: str) -> EngineStatus:
        """One run's engine status: live for an active run, from the ledger otherwise."""
        run_id = self.resolve(ref)
        controller = self.controller(run_id)
        if controller is not None:
            return controller.status()
        rec = self.ledger.get_run(run_id)
        if rec is None:
            raise SwarmNotFound(404, f"no run {run_id!r}", "GET /runs lists the runs")
        position, reason = self.queue_place(run_id)
        last_error = self._last_error(rec) if rec.status == "failed" else None
        return EngineStatus(
            state=EngineState.OFFLINE, run_id=rec.id, name=rec.name,
            snapshot_id=rec.snapshot_id, step=rec.last_step, has_config=True,
            experiment_name=rec.experiment_name, last_error=last_error,
            since=rec.ended_at or rec.started_at,
            approvals_enforced=self.approvals.enforced,
            snapshot_approval=self.approvals.state(rec.snapshot_id).state,
            queue_position=position, queue_reason=reason)

    def _last_error(self, rec: RunRecord) -> LastError:
        """A failed run's own `last_error`: its controller's, kept when it ended, else
        rebuilt from its record and the tail of its engine.log (after a server restart)."""
        with self._lock:
            kept = self._ended_errors.get(rec.id)
        if kept is not None:
            return kept
        tail, _, _ = read_log_lines(Path(rec.run_dir) / "engine.log", tail=LOG_TAIL_LINES,
                                    redact=self.settings.secret_values())
        return LastError(run_id=rec.id, exit_code=rec.exit_code, reason=rec.reason or "",
                         log_tail=tail, at=rec.ended_at or rec.started_at)

    def queue_place(self, run_id: str) -> tuple[int | None, str | None]:
        """(position, reason) of a queued run; (None, None) for any other."""
        with self._lock:
            for position, queued in enumerate(self._queue, start=1):
                if queued.job.run_id == run_id:
                    ahead = position - 1
                    free = len(self.devices.free())
                    reason = (f"needs {queued.need} device slot(s); {free} of "
                              f"{self.devices.total} free")
                    if queued.placement is not None:
                        reason = (f"the launcher cannot place it now ({queued.placement}); "
                                  f"tried again when a run ends and every "
                                  f"{self.placement_retry_s:g} s")
                    elif self.devices.kind == "ray":
                        reason = "the runs ahead of it are placed first (Ray, in order)"
                    if ahead:
                        reason += f"; {ahead} run(s) ahead of it"
                    return position, reason
        return None, None

    def live_state(self, run_id: str | None) -> EngineState | None:
        """An active run's engine state (`None`: the default controller's), else None."""
        if run_id is None:
            return self.default.state
        controller = self.controller(run_id)
        return controller.state if controller is not None else None

    def devices_status(self) -> DevicePoolStatus:
        with self._lock:
            queued = [q.job.run_id for q in self._queue]
        return self.devices.status(queued)

    def active_snapshot_ids(self) -> set[str]:
        """Snapshots an active or queued run uses: garbage collection keeps them."""
        with self._lock:
            ids = {q.job.snapshot_id for q in self._queue}
            ids |= {lane.pinned.snapshot_id for lane in self._lanes.values() if lane.pinned}
        return ids

    # ------------------------------------------------------------------ gateway view

    def default_run_id(self) -> str | None:
        """The default run's id while it serves episodes."""
        return self.default.current_run_id()

    def serving_socket(self, run_id: str) -> Path | None:
        """The serving engine's socket of `run_id`, else None (hot path: one lookup)."""
        lane = self._lanes.get(run_id)  # dict reads are atomic; no lock on the hot path
        return (lane if lane is not None else self.default).serving_socket_of(run_id)

    def run_step(self, run_id: str) -> int | None:
        lane = self._lanes.get(run_id)
        return (lane if lane is not None else self.default).step_of(run_id)

    def describe(self, run_id: str | None) -> str:
        """A run's state in words, for an error that it does not serve."""
        if run_id is None:
            return f"engine is {self.default.state}"
        state = self.live_state(run_id)
        if state is not None:
            return f"run {run_id} is {state}"
        position, _ = self.queue_place(run_id)
        if position is not None:
            return f"run {run_id} is queued (position {position})"
        rec = self.ledger.get_run(run_id)
        return f"run {run_id} is {rec.status if rec else 'unknown'}"

    # ------------------------------------------------------------------ internals

    def _admit(self, request: StartRunRequest) -> tuple[PinnedJob, int]:
        """The checks a start request passes before anything is recorded."""
        snapshot_id = self._snapshot_id(request.snapshot_id)
        self.approvals.require_runnable(snapshot_id, doing="start a run")
        if request.name is not None:
            with self._lock:
                taken = any(lane.pinned is not None and lane.pinned.name == request.name
                            for lane in self._lanes.values()) or any(
                    q.job.name == request.name for q in self._queue)
            if taken:
                raise EngineStateConflict(409, f"an active run is already named "
                                               f"{request.name!r}",
                                          "pick another name, or stop that run first "
                                          "(POST /runs/{name}/stop)")
        yaml_text = request.yaml or self.ledger.get_meta(LAST_CONFIG_KEY)
        if not yaml_text:
            raise EngineStateConflict(409, "no job: the request has no yaml and no config "
                                           "was stored", "send yaml in the request, or call "
                                                         "sync_train_config first")
        record = self.snapshots.get(snapshot_id) if snapshot_id != SERVER_CODE else None
        base = self.snapshots.base_dir(record) if record is not None else None
        # the planner checks the job against the devices it may be given (the Ray nodes'
        # memory, or the smallest GPU slot), as for the default run's config
        checked = validate_job_yaml(self.settings, yaml_text, base_dir=base,
                                    engine_user=self.engine_user,
                                    extra_env=self.default.planner_env())
        job = job_fields(checked.yaml_text)
        if isinstance(job.get("resume_from"), str) and job["resume_from"]:
            resolve_resume(str(job["resume_from"]), ledger=self.ledger,
                           experiment_name=str(job.get("experiment_name") or ""),
                           runs_dir=self.settings.runs_dir)
        need = devices_needed(job, self.devices.kind)
        if need > self.devices.total:
            raise EngineStateConflict(
                409, f"the job needs {need} device slot(s) per node; this server has "
                     f"{self.devices.total} ({self.devices.kind}) and the run could never start",
                "lower n_gpu / n_proc, or start the server with more devices (--devices)")
        run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
        return PinnedJob(run_id=run_id, snapshot_id=snapshot_id, yaml_text=checked.yaml_text,
                         name=request.name), need

    def _snapshot_id(self, ref: str | None) -> str:
        if ref is None:
            return self.snapshots.active_id()
        if ref == SERVER_CODE:
            return SERVER_CODE
        record = self.snapshots.resolve(ref)
        if record is None:
            raise SwarmNotFound(404, f"no snapshot {ref[:64]!r} is stored (or the prefix is "
                                     "not unique)", "GET /snapshots lists them; sync the "
                                                    "code first (sync_code)")
        return record.id

    def _enqueue(self, job: PinnedJob, need: int, role: str) -> None:
        """Record a queued run. Caller holds `_lock`."""
        now = time.time()
        self.ledger.create_run(RunRecord(
            id=job.run_id, snapshot_id=job.snapshot_id, config_yaml=job.yaml_text,
            config_hash=config_hash(job.yaml_text),
            experiment_name=str(job_fields(job.yaml_text).get("experiment_name") or ""),
            started_by=role, started_at=now, run_dir=str(self.settings.runs_dir / job.run_id),
            status="queued", name=job.name, default_run=False))
        self._queue.append(_Queued(job, need, now, role))
        self.ledger.audit("start_run", role, "queued",
                          {"run_id": job.run_id, "name": job.name, "need": need,
                           "position": len(self._queue)})
        log.info("run %s (%s) queued at position %d: needs %d device slot(s)", job.run_id,
                 job.name or "unnamed", len(self._queue), need)

    def _launch(self, job: PinnedJob, role: str) -> None:
        """Start a run's controller. Caller holds `_lock`."""
        lane = self._make(job)
        self._lanes[job.run_id] = lane
        self._placing = job.run_id
        try:
            lane.start(role=role)
        except SwarmHTTPError:
            self._lanes.pop(job.run_id, None)
            raise
        finally:
            self._placing = None
        self.ledger.audit("start_run", role, "ok", {"run_id": job.run_id, "name": job.name})

    def _requeued(self, queued: _Queued) -> None:
        """A run the launcher could not place is queued again: its record (which the
        refused start closed as failed) says so, and a try is scheduled. Caller holds
        `_lock`."""
        run_id = queued.job.run_id
        self._ended_errors.pop(run_id, None)
        self.ledger.update_run(run_id, status="queued", ended_at=None, final_state=None,
                               exit_code=None, reason=None, pid=None, pid_start_time=None)
        self.ledger.audit("start_run", queued.role, "queued",
                          {"run_id": run_id, "name": queued.job.name,
                           "placement": (queued.placement or "")[:200]})
        log.info("run %s waits: the launcher cannot place it now (%s)", run_id,
                 queued.placement)
        if self._retry is None:
            self._retry = threading.Timer(self.placement_retry_s, self._retry_drain)
            self._retry.daemon = True
            self._retry.start()

    def _retry_drain(self) -> None:
        with self._lock:
            self._retry = None  # a refusal in this try schedules the next
            self._drain()

    def _controller(self, job: PinnedJob) -> EngineController:
        # the default controller's spawner and probe: the same processes, or in tests the
        # same fakes; never a standby (docs/internals.md, "Concurrent runs")
        return EngineController(self.settings, self.ledger, self.snapshots,
                                spawner=self.default.spawner, probe=self.default.probe_factory,
                                approvals=self.approvals, engine_user=self.engine_user,
                                devices=self.devices, pinned=job,
                                on_run_end=self._on_run_end, standby=False)

    def _on_run_end(self, run_id: str) -> None:
        """A controller's run ended (its exit thread): forget its lane, start the next."""
        with self._lock:
            lane = self._lanes.pop(run_id, None)
            error = (lane or self.default).last_error
            if error is not None and error.run_id == run_id:
                self._ended_errors[run_id] = error
                while len(self._ended_errors) > _ENDED_ERRORS_KEPT:
                    self._ended_errors.popitem(last=False)
            # a start the launcher refused is no end that frees anything
            waiting = bool(self._queue) and run_id != self._placing
        if waiting:
            threading.Thread(target=self._drain, daemon=True, name="run-queue").start()

    def _drain(self) -> None:
        """Start queued runs from the head while their devices are free."""
        with self._lock:
            while self._queue and self._queue[0].need <= len(self.devices.free()):
                queued = self._queue.pop(0)
                try:
                    self._launch(queued.job, queued.role)
                except PlacementRefused as exc:
                    if not exc.never:
                        queued.placement = str(exc.detail)
                        self._queue.insert(0, queued)  # still the head: none jumps ahead
                        self._requeued(queued)
                        break
                    self._drop(queued, exc)  # the cluster shrank: it would wait forever
                except SwarmHTTPError as exc:  # its snapshot lost its approval, say
                    self._drop(queued, exc)

    def _drop(self, queued: _Queued, exc: SwarmHTTPError) -> None:
        """A queued run that could not start is recorded as failed. Caller holds `_lock`."""
        log.warning("queued run %s could not start: %s", queued.job.run_id, exc.detail)
        self.ledger.update_run(queued.job.run_id, status="failed", ended_at=time.time(),
                               final_state=EngineState.OFFLINE.value,
                               reason=f"could not start from the queue: {exc.detail}")
