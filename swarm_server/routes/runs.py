"""Routes: the runs ledger (list, one run, metrics, logs) and the audit log.

`current` as a run id means the engine's current run, or the last run if none is live.
Metrics and logs are read from the run directory on every request, so they stay
available after the run (and the server) ended.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import ValidationError

from ajet.protocol import (
    SERVER_CODE,
    AuditEntry,
    AuditPage,
    ErrorBody,
    LogsResponse,
    MetricsResponse,
    Provenance,
    RunPublic,
    RunsPage,
)
from swarm_server.context import ServerContext
from swarm_server.deps import ControlAuth, Ctx, ReaderAuth
from swarm_server.errors import BadRequest, NotFound
from swarm_server.ledger import OPEN_RUN_STATUSES, RunRecord
from swarm_server.run_files import (
    LogPattern,
    LogSearchTimeout,
    compile_log_regex,
    downsample,
    read_log_lines,
    read_metrics,
    summarize,
)

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["runs"])

#: A regex `grep` longer than this is refused (keeps pathological patterns small).
MAX_REGEX_CHARS = 200
CURRENT = "current"
#: Paging offsets stay far inside SQLite's 64-bit integers (a larger one was a 500).
MAX_OFFSET = 1_000_000_000

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong token"},
    404: {"model": ErrorBody, "description": "No such run"},
}
RunId = Annotated[str, Path(max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
                            description="A run id, or 'current' (the live or last run)")]


@router.get("/runs", responses=_ERRORS)
def list_runs(
    ctx: Ctx, _: ReaderAuth,
    experiment_name: Annotated[str | None, Query(max_length=200)] = None,
    status: Literal["booting", "running", "ended", "failed"] | None = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
) -> RunsPage:
    """Runs, newest first, optionally filtered by experiment name and status."""
    records, total = ctx.ledger.list_runs(experiment_name=experiment_name, status=status,
                                          offset=offset, limit=limit)
    return RunsPage(runs=[_public(ctx, r, full=False) for r in records], total=total,
                    offset=offset, limit=limit)


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
            raise BadRequest(f"regex longer than {MAX_REGEX_CHARS} characters",
                             "shorten the pattern, or search a plain substring (regex=false)")
        try:
            pattern = compile_log_regex(grep)
        except ValueError as exc:
            raise BadRequest(f"invalid regex {grep!r}: {exc}",
                             "fix the pattern, or search a plain substring (regex=false)") from exc
    rec = _resolve(ctx, run_id)
    budget = ctx.settings.log_regex_timeout_s
    try:
        lines, total, truncated = read_log_lines(
            ctx.engine.run_dir(rec.id) / "engine.log", tail=tail,
            grep=grep if grep and not regex else None, pattern=pattern, budget_s=budget)
    except LogSearchTimeout as exc:
        raise BadRequest(f"{exc} (AJET_SWARM_LOG_REGEX_TIMEOUT_S)",
                         "use a simpler pattern (no nested or overlapping repetition), "
                         "search a plain substring (regex=false), or lower tail") from exc
    return LogsResponse(run_id=rec.id, lines=lines, total_lines=total, truncated=truncated)


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
    wanted = ctx.engine.latest_run_id() if run_id == CURRENT else run_id
    rec = ctx.ledger.get_run(wanted) if wanted else None
    if rec is None:
        if run_id == CURRENT:
            raise NotFound("no run yet", "call sync_train_config and start_engine first")
        raise NotFound(f"no run {run_id!r}", "call list_runs (GET /runs) for the run ids")
    return rec


def _public(ctx: ServerContext, rec: RunRecord, *, full: bool) -> RunPublic:
    summary = rec.summary
    last_step = rec.last_step
    if full or rec.status in OPEN_RUN_STATUSES:
        # live runs change under us; a full read always reflects the file
        points = read_metrics(ctx.engine.run_dir(rec.id) / "metrics.jsonl")
        if points:
            summary, last_step = summarize(points), points[-1]["step"]
    return RunPublic(
        run_id=rec.id, snapshot_id=rec.snapshot_id, experiment_name=rec.experiment_name,
        config_hash=rec.config_hash, config_yaml=rec.config_yaml if full else None,
        started_by=rec.started_by, started_at=rec.started_at, ended_at=rec.ended_at,
        status=rec.status, final_state=rec.final_state, exit_code=rec.exit_code,
        reason=rec.reason, last_step=last_step, summary=summary,
        provenance=_provenance(ctx, rec.snapshot_id) if full else None,
        resumed_from=rec.resumed_from, resume_checkpoint=rec.resume_checkpoint,
        resume_step=rec.resume_step, last_checkpoint=rec.last_checkpoint,
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
