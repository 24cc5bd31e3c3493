"""Routes: runs (start several at once, stop, status), the runs ledger (list, one run,
metrics, logs, checkpoints) and the audit log.

A run is named by its id, by the name it was started with (the active run of that name,
else the newest), or `current`: the default run's engine (the one `start_engine` drives),
or the last run if none is live. `POST /runs` starts a run beside the others, on its own
snapshot, job and devices (`swarm_server.run_pool`); it may wait in a queue.
Metrics and logs are read from the run directory on every request, so they stay
available after the run (and the server) ended. A run's checkpoints are listed, hashed
and handed out as a tar (`swarm_server/checkpoint_files.py`) with the control token:
the archive is the same bytes at every request, so a `Range` request resumes a download.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from ajet.protocol import (
    SERVER_CODE,
    AuditEntry,
    AuditPage,
    CheckpointFileHash,
    CheckpointInfo,
    CheckpointManifest,
    CheckpointsPage,
    ErrorBody,
    LogsResponse,
    MetricsResponse,
    Provenance,
    RunPublic,
    RunsPage,
    EngineStatus,
    StartRunRequest,
    StopEngineRequest,
    StopEngineResponse,
    SamplePublic,
    SamplesPage,
)
from ajet.errors import (
    EngineStateConflict,
    PayloadTooLarge,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmValidationError,
)
from swarm_server.context import ServerContext
from swarm_server.checkpoint_files import TarLayout, checkpoint_dir, checkpoint_manifest, \
    list_checkpoints
from swarm_server.deps import ControlAuth, Ctx, ReaderAuth
from swarm_server.ledger import ACTIVE_RUN_STATUSES, OPEN_RUN_STATUSES, RunRecord
from swarm_server.run_checkpoints import last_checkpoint
from swarm_server.run_files import (
    LogPattern,
    LogSearchTimeout,
    compile_log_regex,
    downsample,
    read_log_lines,
    read_metrics,
    read_samples,
    read_trackers,
    sample_steps,
    summarize,
)

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["runs"])

#: A regex `grep` longer than this is refused (keeps pathological patterns small).
MAX_REGEX_CHARS = 200
#: Paging offsets stay far inside SQLite's 64-bit integers (a larger one was a 500).
MAX_OFFSET = 1_000_000_000
#: A samples page: at most this many samples, and about this many bytes of them.
MAX_SAMPLES_PAGE = 200
MAX_SAMPLES_BYTES = 4 * 1024 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong token"},
    404: {"model": ErrorBody, "description": "No such run"},
}
RunId = Annotated[str, Path(max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
                            description="A run id, a run's name, or 'current' (the default "
                                        "run's live or last run)")]
#: `GET /runs?state=`: the statuses each state word covers.
_STATE_STATUSES: dict[str, tuple[str, ...]] = {
    "active": ACTIVE_RUN_STATUSES, "ended": ("ended", "failed"),
}
_START_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    403: {"model": ErrorBody, "description": "The worker token cannot start or stop runs"},
    409: {"model": ErrorBody, "description": "Approval pending, name taken, no config, or "
                                             "the devices can never hold it; see `hint`"},
    422: {"model": ErrorBody, "description": "Invalid job; `detail` names the fields"},
}


@router.get("/runs", responses=_ERRORS)
def list_runs(
    ctx: Ctx, _: ReaderAuth,
    experiment_name: Annotated[str | None, Query(max_length=200)] = None,
    status: Literal["queued", "booting", "running", "ended", "failed"] | None = None,
    state: Annotated[Literal["active", "ended", "all"], Query(
        description="active: queued, booting or running; ended: ended or failed")] = "all",
    name: Annotated[str | None, Query(max_length=64)] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
) -> RunsPage:
    """Runs, newest first, optionally filtered by experiment name, status, state and name;
    with the server's device slots and who holds them."""
    records, total = ctx.ledger.list_runs(experiment_name=experiment_name, status=status,
                                          statuses=_STATE_STATUSES.get(state), name=name,
                                          offset=offset, limit=limit)
    return RunsPage(runs=[_public(ctx, r, full=False) for r in records], total=total,
                    offset=offset, limit=limit, devices=ctx.runs.devices_status())


@router.post("/runs", responses=_START_ERRORS)
def start_run(body: StartRunRequest, ctx: Ctx, role: ControlAuth) -> RunPublic:
    """Start a run beside the ones already running: on a snapshot (default: the active
    one) and a job (default: the stored config), on device slots of its own.

    Returns at once: `booting` with its devices, or `queued` with its position while the
    devices it needs are busy (`queue: false` refuses instead). Follow it with
    `GET /runs/{id}/status`; begin its episodes with `begin_episode(run_id=...)`.
    """
    run_id = ctx.runs.start(body, role=role)
    return _public(ctx, _resolve(ctx, run_id), full=False)


@router.post("/runs/{run_id}/stop", responses=_START_ERRORS)
def stop_run(ctx: Ctx, role: ControlAuth, run_id: RunId,
             body: StopEngineRequest | None = None) -> StopEngineResponse:
    """Stop one run (TERM, grace, KILL), or take a queued one out of the queue.
    Idempotent; the other runs go on."""
    return ctx.runs.stop(run_id, role=role,
                         reason=body.reason if body else "stopped by request")


@router.get("/runs/{run_id}/status", responses=_ERRORS)
def get_run_status(ctx: Ctx, _: ReaderAuth, run_id: RunId) -> EngineStatus:
    """One run's engine status: its own state, step, devices and `last_error` (or its
    place in the queue)."""
    return ctx.runs.status(run_id)


@router.get("/runs/{run_id}", responses=_ERRORS)
def get_run(ctx: Ctx, role: ReaderAuth, run_id: RunId) -> RunPublic:
    """One run: config YAML, snapshot and its provenance, status, metric summary.

    With the worker token the provenance withholds the diff, the untracked file names and
    the host (`Provenance.withheld`, with their sizes instead): workers never see code.
    """
    run = _public(ctx, _resolve(ctx, run_id), full=True)
    if role == "worker" and run.provenance is not None:
        run.provenance = run.provenance.for_worker()
    return run


@router.get("/runs/{run_id}/metrics", responses=_ERRORS)
def get_metrics(
    ctx: Ctx, _: ReaderAuth, run_id: RunId,
    since_step: Annotated[int | None, Query(description="Only steps after this one")] = None,
    fields: Annotated[str | None, Query(
        max_length=2000, description="Comma-separated field names; `step` is always included")
    ] = None,
    max_points: Annotated[int | None, Query(
        ge=1, le=100_000, description="Evenly downsample to at most this many; keeps the last")
    ] = None,
) -> MetricsResponse:
    """Per-step metrics from the run's `metrics.jsonl`."""
    rec = _resolve(ctx, run_id)
    points = read_metrics(ctx.engine.run_dir(rec.id) / "metrics.jsonl")
    total = len(points)
    last_step = points[-1]["step"] if points else None
    if since_step is not None:
        points = [p for p in points if p["step"] > since_step]
    if fields:
        wanted = {"step", *(f.strip() for f in fields.split(",") if f.strip())}
        points = [{k: v for k, v in p.items() if k in wanted} for p in points]
    selected = len(points)
    if max_points is not None:
        points = downsample(points, max_points)
    return MetricsResponse(run_id=rec.id, points=points, total_steps=total, last_step=last_step,
                           downsampled=len(points) < selected)


@router.get("/runs/{run_id}/logs", responses={**_ERRORS, 400: {"model": ErrorBody}})
def get_logs(
    ctx: Ctx, _: ReaderAuth, run_id: RunId,
    tail: Annotated[int, Query(ge=0, le=10_000, description="Last N (matching) lines")] = 100,
    grep: Annotated[str | None, Query(
        max_length=1000, description="Keep lines containing this text (or matching it, regex)")
    ] = None,
    regex: Annotated[bool, Query(description=f"Treat grep as a regex (<= {MAX_REGEX_CHARS} chars)")
                     ] = False,
) -> LogsResponse:
    """The tail of the run's `engine.log`, optionally filtered.

    A plain `def`: FastAPI runs it in its thread pool, off the event loop. A regex search
    releases the GIL and has a time budget (`swarm_server.run_files`), so no pattern can
    keep the server from answering.
    """
    pattern: LogPattern | None = None
    if grep and regex:
        if len(grep) > MAX_REGEX_CHARS:
            raise SwarmValidationError(
                400, f"regex longer than {MAX_REGEX_CHARS} characters",
                "shorten the pattern, or search a plain substring (regex=false)")
        try:
            pattern = compile_log_regex(grep)
        except ValueError as exc:
            raise SwarmValidationError(
                400, f"invalid regex {grep!r}: {exc}",
                "fix the pattern, or search a plain substring (regex=false)") from exc
    rec = _resolve(ctx, run_id)
    budget = ctx.settings.log_regex_timeout_s
    try:
        lines, total, truncated = read_log_lines(
            ctx.engine.run_dir(rec.id) / "engine.log", tail=tail,
            grep=grep if grep and not regex else None, pattern=pattern, budget_s=budget,
            redact=ctx.settings.secret_values())
    except LogSearchTimeout as exc:
        raise SwarmValidationError(400, f"{exc} (AJET_SWARM_LOG_REGEX_TIMEOUT_S)",
                                   "use a simpler pattern (no nested or overlapping repetition), "
                                   "search a plain substring (regex=false), or lower tail") from exc
    return LogsResponse(run_id=rec.id, lines=lines, total_lines=total, truncated=truncated)


@router.get("/runs/{run_id}/samples", responses=_ERRORS)
def get_samples(
    ctx: Ctx, _: ReaderAuth, run_id: RunId,
    step: Annotated[int, Query(ge=1, le=MAX_OFFSET, description="The training step")],
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET, description="First sample to return")
                      ] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_SAMPLES_PAGE, description="Samples per page")
                     ] = 20,
) -> SamplesPage:
    """A step's training samples: each timeline's token ids, decoded text, loss mask,
    log-probs and the completions it merged (the engine's `samples/samples-<step>.jsonl`).

    A page holds at most `limit` samples and about `MAX_SAMPLES_BYTES` of them (always
    at least one); `next_offset` says where the next page starts.
    """
    rec = _resolve(ctx, run_id)
    folder = ctx.engine.run_dir(rec.id) / "samples"
    try:
        samples, total, next_offset = read_samples(folder / f"samples-{step}.jsonl",
                                                   offset=offset, limit=limit,
                                                   max_bytes=MAX_SAMPLES_BYTES)
    except FileNotFoundError:
        steps = sample_steps(folder)
        raise SwarmNotFound(404, f"run {rec.id} has no samples for step {step}",
                            f"steps with samples: {_ranges(steps)}" if steps else
                            "samples are written at each training step; read metrics for the "
                            "steps done (GET /runs/{id}/metrics)") from None
    return SamplesPage(run_id=rec.id, step=step, samples=[SamplePublic.model_validate(s)
                                                          for s in samples],
                       total=total, offset=offset, next_offset=next_offset)


@router.get("/audit", responses={**_ERRORS, 403: {"model": ErrorBody}})
def get_audit(
    ctx: Ctx, _: ControlAuth,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditPage:
    """The append-only log of control actions, oldest first. Control token only."""
    records, total = ctx.ledger.list_audit(offset=offset, limit=limit)
    return AuditPage(
        entries=[AuditEntry(id=r.id, at=r.at, action=r.action, role=r.role, outcome=r.outcome,
                            detail=r.detail) for r in records],
        total=total,
    )


# ---------------------------------------------------------------------------- helpers


def _resolve(ctx: ServerContext, run_id: str) -> RunRecord:
    wanted = ctx.runs.resolve(run_id)
    rec = ctx.ledger.get_run(wanted)
    if rec is None:
        raise SwarmNotFound(404, f"no run {run_id!r}", "call list_runs (GET /runs) for the run ids")
    return rec


def _public(ctx: ServerContext, rec: RunRecord, *, full: bool) -> RunPublic:
    position, reason = ctx.runs.queue_place(rec.id) if rec.status == "queued" else (None, None)
    summary = rec.summary
    last_step = rec.last_step
    saved = rec.last_checkpoint
    if full or rec.status in OPEN_RUN_STATUSES:
        # live runs change under us; a full read always reflects the file
        points = read_metrics(ctx.engine.run_dir(rec.id) / "metrics.jsonl")
        if points:
            summary, last_step = summarize(points), points[-1]["step"]
    if rec.status in OPEN_RUN_STATUSES:  # the ledger has it once the run ends
        found = last_checkpoint(ctx.engine.run_dir(rec.id))
        saved = str(found.path) if found else None
    return RunPublic(
        run_id=rec.id, snapshot_id=rec.snapshot_id, experiment_name=rec.experiment_name,
        config_hash=rec.config_hash, config_yaml=rec.config_yaml if full else None,
        started_by=rec.started_by, started_at=rec.started_at, ended_at=rec.ended_at,
        status=rec.status, final_state=rec.final_state, exit_code=rec.exit_code,
        reason=rec.reason, last_step=last_step, summary=summary,
        provenance=_provenance(ctx, rec.snapshot_id) if full else None,
        resumed_from=rec.resumed_from, resume_checkpoint=rec.resume_checkpoint,
        resume_step=rec.resume_step, last_checkpoint=saved,
        trackers=read_trackers(ctx.engine.run_dir(rec.id)),
        name=rec.name, default_run=rec.default_run, devices=rec.devices,
        engine_state=ctx.runs.live_state(rec.id) if rec.status in ACTIVE_RUN_STATUSES else None,
        queue_position=position, queue_reason=reason,
    )


def _provenance(ctx: ServerContext, snapshot_id: str) -> Provenance | None:
    if snapshot_id == SERVER_CODE:
        return None
    snap = ctx.ledger.get_snapshot(snapshot_id)
    if snap is None:
        return None
    try:
        return Provenance.model_validate(snap.provenance)
    except ValidationError as exc:
        log.warning("snapshot %s has unreadable provenance: %s", snapshot_id, exc)
        return None


# ---------------------------------------------------------------------------- checkpoints

CheckpointName = Annotated[str, Path(max_length=40, pattern=r"^(final|step_\d{1,9})(\.partial)?$",
                                     description="final or step_<n> (GET .../checkpoints)")]


@router.get("/runs/{run_id}/checkpoints", responses=_ERRORS)
def get_checkpoints(ctx: Ctx, _: ReaderAuth, run_id: RunId) -> CheckpointsPage:
    """A run's checkpoints: name, step, kind, size, complete or not."""
    rec = _resolve(ctx, run_id)
    found = list_checkpoints(ctx.engine.run_dir(rec.id))
    return CheckpointsPage(run_id=rec.id, checkpoints=[CheckpointInfo(**c) for c in found])


@router.get("/runs/{run_id}/checkpoints/{name}", responses=_ERRORS)
def get_checkpoint_manifest(ctx: Ctx, _: ControlAuth, run_id: RunId,
                            name: CheckpointName) -> CheckpointManifest:
    """Every file of a checkpoint with its size and sha256: what a download is checked
    against (`ajet-swarm runs download`, `SwarmClient.download_checkpoint`)."""
    rec, folder = _checkpoint(ctx, run_id, name)
    files = checkpoint_manifest(folder, ctx.engine.run_dir(rec.id) / ".checkpoint_manifests")
    layout = TarLayout(folder, name)
    return CheckpointManifest(run_id=rec.id, name=name,
                              files=[CheckpointFileHash(**f) for f in files],
                              archive_bytes=layout.size, etag=_etag(files))


@router.get("/runs/{run_id}/checkpoints/{name}/archive",
            responses={**_ERRORS, 206: {"description": "The requested byte range"},
                       409: {"model": ErrorBody, "description": "Not complete yet"},
                       413: {"model": ErrorBody, "description": "Over the archive bound"},
                       416: {"model": ErrorBody, "description": "Range outside the archive"}},
            response_class=StreamingResponse)
def get_checkpoint_archive(
    ctx: Ctx, role: ControlAuth, run_id: RunId, name: CheckpointName,
    range_header: Annotated[str | None, Header(alias="Range", max_length=100)] = None,
    if_range: Annotated[str | None, Header(alias="If-Range", max_length=100)] = None,
) -> StreamingResponse:
    """A complete checkpoint as a tar (members under `<name>/`). Sorted entries, times
    and owners 0: the same bytes every time, so `Range: bytes=N-` resumes a download."""
    rec, folder = _checkpoint(ctx, run_id, name)
    if name.endswith(".partial") or not (folder / "ajet_checkpoint.json").is_file():
        raise EngineStateConflict(409, f"checkpoint {name} of run {rec.id} is not complete",
                                  f"download a complete one (GET /runs/{rec.id}/checkpoints)")
    layout = TarLayout(folder, name)
    if layout.size > ctx.settings.max_checkpoint_archive_bytes:
        raise PayloadTooLarge(
            413, f"checkpoint {name} is {layout.size} bytes, over the server's bound of "
            f"{ctx.settings.max_checkpoint_archive_bytes}",
            "copy it on the cluster, or raise AJET_SWARM_MAX_CHECKPOINT_ARCHIVE_BYTES")
    files = checkpoint_manifest(folder, ctx.engine.run_dir(rec.id) / ".checkpoint_manifests")
    etag = _etag(files)
    start, end = 0, layout.size
    status = 200
    if range_header and (if_range is None or if_range == etag):
        start, end = _byte_range(range_header, layout.size)
        status = 206
    headers = {"Accept-Ranges": "bytes", "ETag": etag, "Content-Length": str(end - start),
               "Content-Disposition": f'attachment; filename="{rec.id}-{name}.tar"'}
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{layout.size}"
    ctx.ledger.audit("download_checkpoint", role, "ok",
                     {"run_id": rec.id, "name": name, "start": start, "end": end})
    return StreamingResponse(layout.read(start, end), status_code=status, headers=headers,
                             media_type="application/x-tar")


def _checkpoint(ctx: ServerContext, run_id: str, name: str) -> tuple[RunRecord, Any]:
    rec = _resolve(ctx, run_id)
    folder = checkpoint_dir(ctx.engine.run_dir(rec.id), name)
    if folder is None:
        raise SwarmNotFound(404, f"run {rec.id} has no checkpoint {name!r}",
                            f"list them with GET /runs/{rec.id}/checkpoints")
    return rec, folder


def _etag(files: list[dict[str, Any]]) -> str:
    blob = json.dumps([[f["path"], f["size"], f["sha256"]] for f in files]).encode()
    return '"' + hashlib.sha256(blob).hexdigest()[:32] + '"'


def _byte_range(header: str, size: int) -> tuple[int, int]:
    """[start, end) of a single `bytes=a-b`, `bytes=a-` or `bytes=-n` range."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or match.groups() == ("", ""):
        raise SwarmHTTPError(416, f"Range {header!r} is not one byte range",
                             "send Range: bytes=START- (or START-END)",
                             headers={"Content-Range": f"bytes */{size}"})
    first, last = match.groups()
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise SwarmHTTPError(416, f"Range {header!r} is outside the archive ({size} bytes)",
                             "resume from a byte before the archive's size",
                             headers={"Content-Range": f"bytes */{size}"})
    return start, end


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
