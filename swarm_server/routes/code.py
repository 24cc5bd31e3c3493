"""Routes: code snapshots. Sync (incremental or one-shot zip), inspect, activate, GC.

Incremental sync, as `ajet.code_sync.push_tree` drives it:

    POST /code/manifest  {files, provenance}   -> {snapshot_id, missing, exists, active}
    POST /code/blobs     blob stream           (only the missing blobs; format in
                                                swarm_server.uploads)
    POST /code/commit    {snapshot_id, files, provenance, force_restart}
                                               -> CodeSyncResult

`POST /sync_train_code?force_restart=` takes a zip body and does all three in one call.
Activation (commit, zip sync, `POST /code/activate`) goes through
`EngineController.swap_code`: refused with 409 unless the engine is OFFLINE or
`force_restart` is set. Uploading, extracting and compiling happen before that, so a
forced restart keeps the engine down only for stop plus start. Every route needs the
control token; sync, activate and GC are written to the audit log.

With approvers configured (`swarm_server.approvals`), a snapshot no approver approved is
stored but never activated: commit and zip sync store it, then answer 409
(`ApprovalPending`, `detail.approval_state`, where to approve); `activate: false` on a
commit stores it for review without asking to activate. The server's own code is listed
and served (`GET /code/server`, `GET /code/server/blobs/{sha256}`) to the control token and
approvers, so the other side of a first sync's review is the server's real files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from starlette.requests import ClientDisconnect

import ajet
from ajet.packaging import snapshot_id_of
from ajet.protocol import (
    SERVER_CODE,
    ActivateRequest,
    BlobsUploaded,
    CodeSyncResult,
    CommitRequest,
    EngineState,
    ErrorBody,
    FileEntry,
    GCResult,
    ManifestRequest,
    ManifestResponse,
    Provenance,
    ServerCodePublic,
    SnapshotPublic,
    SnapshotsPage,
)
from ajet.errors import (
    EngineStateConflict,
    PayloadTooLarge,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmValidationError,
)
from swarm_server.context import ServerContext
from swarm_server.deps import ControlAuth, Ctx, ReviewerAuth
from swarm_server.ledger import SnapshotRecord
from swarm_server.limits import STREAMED_BODY
from swarm_server.safe_zip import SafeZip, ZipLimits
from swarm_server.uploads import (
    BlobStreamParser,
    StagedBlob,
    check_free_disk,
    declared_length,
    disk_full_is_507,
    spool_body,
)

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["code"])

_SHA256 = r"^[0-9a-f]{64}$"
_DISK_RECHECK_BYTES = 16 * 1024 * 1024


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Malformed or forbidden content; `detail` says which",
            401: "Missing or wrong token", 403: "The worker token cannot call this route",
            404: "Unknown snapshot or blob",
            409: "The engine is not OFFLINE, or the snapshot is not approved; see `hint`",
            413: "An upload limit was passed", 422: "Validation failed; `detail` names it",
            507: "The server's disk is too full"}
    return {c: {"model": ErrorBody, "description": text[c]} for c in (401, 403, *codes)}


_BINARY = {"schema": {"type": "string", "format": "binary"}}
# The zip route reads any content type; octet-stream is listed for generic clients.
_ZIP_BODY = {"requestBody": {"required": True, "content": {
    "application/zip": _BINARY, "application/octet-stream": _BINARY}}}
_BLOB_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": _BINARY}}}


# ---------------------------------------------------------------------------- sync


@router.post("/sync_train_code", response_model=CodeSyncResult, openapi_extra=_ZIP_BODY,
             responses=_errors(400, 409, 413, 422, 507), dependencies=[Depends(STREAMED_BODY)],
             summary="One-shot sync: a zip of ajet/ as the body")
async def sync_train_code(
    request: Request, ctx: Ctx, role: ControlAuth,
    force_restart: Annotated[bool, Query(description="Stop a running engine, activate, "
                                                     "restart it with its last config")] = False,
) -> CodeSyncResult:
    """Extract the zip safely into a new snapshot and activate it."""
    settings, store = ctx.settings, ctx.snapshots
    detail: dict[str, Any] = {"source": "zip", "force_restart": force_restart}
    started = time.perf_counter()
    with _audited(ctx, "sync_code", role, detail):
        declared = declared_length(request.headers.get("content-length"),
                                   limit=settings.max_upload_bytes)
        check_free_disk(store.incoming_dir, needed=declared or 0,
                        keep_free=settings.min_free_disk_bytes)
        with disk_full_is_507(), store.incoming() as tmp:
            body = tmp / "upload.zip"
            try:
                received = await spool_body(request.stream(), body,
                                            limit=settings.max_upload_bytes)
            except ClientDisconnect as exc:
                raise SwarmValidationError(400, "upload interrupted", "send the zip again") from exc
            upload_s = time.perf_counter() - started
            host = request.client.host if request.client else None
            result = await run_in_threadpool(_sync_zip, ctx, body, tmp / "staging",
                                             force_restart=force_restart, role=role, host=host,
                                             detail=detail)
        result.bytes_uploaded = received
        result.timings = {"upload_s": round(upload_s, 4), **result.timings,
                          "server_total_s": round(time.perf_counter() - started, 4)}
        detail.update(snapshot_id=result.snapshot_id, reused=result.reused,
                      restarted=result.restarted, bytes=received)
    return result


@router.post("/code/manifest", response_model=ManifestResponse, responses=_errors(400, 413, 422),
             summary="Which blobs of this manifest the server lacks")
def code_manifest(body: ManifestRequest, ctx: Ctx, role: ControlAuth) -> ManifestResponse:
    """Validate a manifest, name its snapshot id and the blobs to upload. Writes nothing
    except refreshing the age of blobs it already has (so GC spares them)."""
    store = ctx.snapshots
    entries = store.validate_manifest(body.files)
    snapshot_id = snapshot_id_of(entries)
    rec = store.get(snapshot_id)
    return ManifestResponse(
        snapshot_id=snapshot_id,
        missing=[] if rec else store.missing_blobs(entries),
        exists=rec is not None,
        active=rec is not None and store.active_id() == snapshot_id,
        path=rec.path if rec else None,
        state=ctx.engine.state,
        approval=ctx.approvals.state(snapshot_id) if rec else None,
    )


@router.post("/code/blobs", response_model=BlobsUploaded, openapi_extra=_BLOB_BODY,
             responses=_errors(400, 413, 507), dependencies=[Depends(STREAMED_BODY)],
             summary="Upload blobs: records of '<sha256> <size>\\n' + bytes")
async def code_blobs(request: Request, ctx: Ctx, role: ControlAuth) -> BlobsUploaded:
    """Store the blobs of the body, each verified against its sha256; all or nothing."""
    settings, store = ctx.settings, ctx.snapshots
    declared = declared_length(request.headers.get("content-length"),
                               limit=settings.max_upload_bytes)
    check_free_disk(store.incoming_dir, needed=declared or 0,
                    keep_free=settings.min_free_disk_bytes)
    with disk_full_is_507(), store.incoming() as tmp:
        parser = BlobStreamParser(tmp, max_blob_bytes=settings.max_file_bytes,
                                  max_blobs=settings.max_files, have=store.has_blob)
        received = checked = 0
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > settings.max_upload_bytes:
                    raise _too_large(settings.max_upload_bytes)
                if received - checked > _DISK_RECHECK_BYTES:  # chunked bodies declare no size
                    check_free_disk(store.incoming_dir, needed=0,
                                    keep_free=settings.min_free_disk_bytes)
                    checked = received
                parser.feed(chunk)
            staged = parser.finish()
        except ClientDisconnect as exc:
            raise SwarmValidationError(
                400, "upload interrupted", "upload the missing blobs again") from exc
        finally:
            parser.close()
        stored = await run_in_threadpool(store.adopt_blobs, staged)
    present = list(dict.fromkeys(parser.already_present + [b.sha256 for b in staged
                                                          if b.sha256 not in stored]))
    return BlobsUploaded(stored=stored, already_present=present, bytes_received=received)


@router.post("/code/commit", response_model=CodeSyncResult,
             responses=_errors(400, 409, 413, 422, 507),
             summary="Build the snapshot of a manifest whose blobs are uploaded; activate it")
def code_commit(body: CommitRequest, ctx: Ctx, role: ControlAuth) -> CodeSyncResult:
    store = ctx.snapshots
    detail: dict[str, Any] = {"source": "manifest", "snapshot_id": body.snapshot_id,
                              "force_restart": body.force_restart,
                              "approved_by": body.approved_by}
    started = time.perf_counter()
    with _audited(ctx, "sync_code", role, detail):
        entries = store.validate_manifest(body.files)
        snapshot_id = snapshot_id_of(entries)
        if snapshot_id != body.snapshot_id:
            raise SwarmValidationError(
                400, f"snapshot_id {body.snapshot_id} does not match the manifest ({snapshot_id})",
                "compute it with ajet.packaging.snapshot_id_of over the same files",
            )
        # Unapproved content is stored whatever the engine does (an approver reviews the
        # stored files), then refused activation; approved content needs OFFLINE as ever.
        if body.activate and store.active_id() != snapshot_id \
                and ctx.approvals.runnable(snapshot_id):
            _require_offline_or_restart(ctx, body.force_restart)
        with disk_full_is_507():
            rec, reused, timings = store.materialise(entries, body.provenance,
                                                     approved_by=body.approved_by)
        detail.update(path=rec.path, reused=reused, activate=body.activate)
        if body.activate:
            result = _activate(ctx, rec, force_restart=body.force_restart, role=role,
                               reused=reused, timings=timings)
        else:
            result = CodeSyncResult(snapshot_id=rec.id, path=rec.path, reused=reused,
                                    activated=False, state=ctx.engine.state, timings=timings,
                                    approval=ctx.approvals.state(rec.id))
        result.untracked_left_out = list(body.provenance.untracked_left_out)
        result.timings["total_s"] = round(time.perf_counter() - started, 4)
        detail.update(path=result.path, reused=reused, restarted=result.restarted,
                      run_id=result.run_id)
    if not reused:
        _auto_gc(ctx, role)
    return result


# ---------------------------------------------------------------------------- inspect


@router.get("/code", response_model=SnapshotPublic | None, responses=_errors(),
            summary="The active snapshot with its manifest; null = the server's own code")
def get_code(ctx: Ctx, role: ControlAuth) -> SnapshotPublic | None:
    rec = ctx.snapshots.active()
    return _public(ctx, rec, files=True) if rec else None


@router.get("/code/snapshots", response_model=SnapshotsPage, responses=_errors(422),
            summary="Snapshots, newest first")
def list_snapshots(ctx: Ctx, role: ControlAuth,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> SnapshotsPage:
    store = ctx.snapshots
    records = store.records()[:limit]
    states = ctx.approvals.states([r.id for r in records])
    return SnapshotsPage(active=store.active_id(), snapshots=[
        store.public(r).model_copy(update={"approval": states[r.id]}) for r in records])


@router.get("/code/snapshots/{snapshot_ref}", response_model=SnapshotPublic,
            responses=_errors(400, 404, 422),
            summary="One snapshot (id or unique prefix) with its manifest")
def get_snapshot(snapshot_ref: Annotated[str, PathParam(max_length=64)], ctx: Ctx,
                 role: ControlAuth) -> SnapshotPublic:
    rec = ctx.snapshots.resolve(snapshot_ref)
    if rec is None:
        raise SwarmNotFound(404, "the server's own code is not a snapshot",
                            "GET /code/server lists the server's own ajet/; GET /code/snapshots "
                            "lists snapshots")
    return _public(ctx, rec, files=True)


@router.get("/code/server", response_model=ServerCodePublic, responses=_errors(),
            summary="The server's own ajet/ (snapshot id 'server'): its manifest")
def get_server_code(ctx: Ctx, role: ReviewerAuth) -> ServerCodePublic:
    """What runs when no snapshot is active, and what a first sync is compared with.
    Control token or an approver token."""
    code = ctx.approvals.server_code
    return ServerCodePublic(ajet_dir=str(code.ajet_dir), files=code.manifest())


@router.get("/code/server/blobs/{sha256}", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}}, **_errors(404, 422)},
            summary="One file of the server's own ajet/, by content hash")
def get_server_blob(sha256: Annotated[str, PathParam(pattern=_SHA256)], ctx: Ctx,
                    role: ReviewerAuth) -> FileResponse:
    path = ctx.approvals.server_code.path_of(sha256)
    if path is None:
        raise SwarmNotFound(404, f"no file with sha256 {sha256} in the server's own ajet/",
                            "GET /code/server lists its files and their sha256")
    return FileResponse(path, media_type="application/octet-stream")


@router.get("/code/blobs/{sha256}", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}}, **_errors(404, 422)},
            summary="One file's bytes by content hash")
def get_blob(sha256: Annotated[str, PathParam(pattern=_SHA256)], ctx: Ctx,
             role: ControlAuth) -> FileResponse:
    path = ctx.snapshots.blob_path(sha256)
    if not path.is_file():
        raise SwarmNotFound(404, f"no blob {sha256} on this server",
                            "GET /code lists the active snapshot's files and their sha256")
    return FileResponse(path, media_type="application/octet-stream")


# ---------------------------------------------------------------------------- change


@router.post("/code/activate", response_model=CodeSyncResult,
             responses=_errors(400, 404, 409, 422),
             summary="Re-activate an earlier snapshot, or 'server' (rollback, no upload)")
def activate(body: ActivateRequest, ctx: Ctx, role: ControlAuth) -> CodeSyncResult:
    detail: dict[str, Any] = {"requested": body.snapshot_id, "force_restart": body.force_restart}
    with _audited(ctx, "activate", role, detail):
        rec = ctx.snapshots.resolve(body.snapshot_id)
        target = rec.id if rec else SERVER_CODE
        ctx.approvals.require_runnable(target, doing=f"activate snapshot {target[:12]}")
        if ctx.snapshots.active_id() != target:
            _require_offline_or_restart(ctx, body.force_restart)
        result = _activate(ctx, rec, force_restart=body.force_restart, role=role, reused=True,
                           timings={})
        detail.update(snapshot_id=result.snapshot_id, restarted=result.restarted,
                      run_id=result.run_id)
    return result


@router.post("/code/gc", response_model=GCResult, responses=_errors(422),
             summary="Remove old snapshots and unreferenced blobs")
def gc(ctx: Ctx, role: ControlAuth,
       keep: Annotated[int | None, Query(ge=1, le=100_000, description=(
           "Newest snapshots to keep (default: the server's keep_snapshots); the active one "
           "and any a run used are always kept"))] = None) -> GCResult:
    detail: dict[str, Any] = {"keep": keep}
    with _audited(ctx, "gc", role, detail):
        result = ctx.snapshots.gc(keep)
        detail.update(removed=result.removed_snapshots, removed_blobs=result.removed_blobs)
    return result


# ---------------------------------------------------------------------------- helpers


def _sync_zip(ctx: ServerContext, body: Path, staging: Path, *, force_restart: bool, role: str,
              host: str | None, detail: dict[str, Any]) -> CodeSyncResult:
    """Judge and extract the zip, then materialise and activate like a commit.

    `detail` (the audit entry's) gains the snapshot stored, so the log says who stored
    it even when its activation is then refused."""
    settings, store = ctx.settings, ctx.snapshots
    t0 = time.perf_counter()
    with SafeZip.open(body, ZipLimits.from_settings(settings)) as archive:
        check_free_disk(store.incoming_dir, needed=archive.total_bytes,
                        keep_free=settings.min_free_disk_bytes)
        members = archive.extract(staging)
    entries = store.validate_manifest(
        [FileEntry(path=m.path, sha256=m.sha256, size=m.size, mode=m.mode) for m in members])
    snapshot_id = snapshot_id_of(entries)
    if store.active_id() != snapshot_id and ctx.approvals.runnable(snapshot_id):
        _require_offline_or_restart(ctx, force_restart)
    t1 = time.perf_counter()
    unique = {m.sha256: StagedBlob(m.sha256, m.size, m.staged) for m in members}
    added = store.adopt_blobs(list(unique.values()))
    provenance = Provenance(host=host, created_at=time.time(), source="zip")
    try:
        rec, reused, timings = store.materialise(entries, provenance)
    except BaseException:
        # A refused zip (code that does not compile, a full disk) leaves the blob store
        # as it found it; nothing but its own blobs were added.
        store.discard_blobs(added)
        raise
    detail.update(snapshot_id=rec.id, path=rec.path, reused=reused)
    result = _activate(ctx, rec, force_restart=force_restart, role=role, reused=reused,
                       timings={"extract_s": round(t1 - t0, 4), **timings})
    result.files = len(members)
    if not reused:
        _auto_gc(ctx, role)
    return result


def _activate(ctx: ServerContext, rec: SnapshotRecord | None, *, force_restart: bool, role: str,
              reused: bool, timings: dict[str, float]) -> CodeSyncResult:
    """Make `rec` (None = the server's own code) active through the engine's swap_code."""
    store = ctx.snapshots
    target = rec.id if rec else SERVER_CODE
    # Unapproved code is stored but never made active (a 409 that says where to approve).
    ctx.approvals.require_runnable(target, doing=f"activate snapshot {target[:12]}")
    restarted, run_id = False, None
    # Lock order: the store, then the engine's lifecycle (the engine never takes the
    # store's lock while holding its own, except through activate() in this thread).
    with store.held():
        if store.active_id() != target:
            t0 = time.perf_counter()
            _, restarted, run_id = ctx.engine.swap_code(
                lambda: store.activate(target), force_restart=force_restart, role=role)
            timings["activate_s"] = round(time.perf_counter() - t0, 4)
    return CodeSyncResult(
        snapshot_id=target,
        path=rec.path if rec else str(Path(ajet.__file__).resolve().parent),
        reused=reused, activated=True, restarted=restarted, run_id=run_id,
        state=ctx.engine.state, timings=timings, approval=ctx.approvals.state(target),
    )


def _public(ctx: ServerContext, rec: SnapshotRecord, *, files: bool) -> SnapshotPublic:
    return ctx.snapshots.public(rec, files=files).model_copy(
        update={"approval": ctx.approvals.state(rec.id)})


def _require_offline_or_restart(ctx: ServerContext, force_restart: bool) -> None:
    # An early, cheap refusal; swap_code checks again under the engine's lock.
    state = ctx.engine.state
    if state != EngineState.OFFLINE and not force_restart:
        raise EngineStateConflict(
            409, f"engine is {state}; code can change only while {EngineState.OFFLINE}",
            "call stop_engine first or pass force_restart=True",
        )


def _auto_gc(ctx: ServerContext, role: str) -> None:
    """Keep disk bounded as an agent syncs again and again."""
    try:
        result = ctx.snapshots.gc()
    except (SwarmHTTPError, OSError) as exc:
        log.warning("automatic snapshot GC failed: %s", exc)
        return
    if result.removed_snapshots or result.removed_blobs:
        ctx.ledger.audit("gc", role, "ok", {"auto": True, "removed": result.removed_snapshots,
                                            "removed_blobs": result.removed_blobs})


def _too_large(limit: int) -> SwarmHTTPError:
    return PayloadTooLarge(413, f"upload passed the server's {limit}-byte limit",
                           "upload in several requests, or raise AJET_SWARM_MAX_UPLOAD_BYTES")


@contextmanager
def _audited(ctx: ServerContext, action: str, role: str, detail: dict[str, Any]
             ) -> Iterator[None]:
    """Append the action's outcome to the audit log, whatever it is."""
    try:
        yield
    except SwarmHTTPError as exc:
        kind = "refused" if exc.status < 500 else "failed"
        ctx.ledger.audit(action, role, f"{kind}: {_short(exc.detail)}", detail)
        raise
    except Exception as exc:
        ctx.ledger.audit(action, role, f"failed: {type(exc).__name__}: {_short(exc)}", detail)
        raise
    ctx.ledger.audit(action, role, "ok", detail)


def _short(value: object, limit: int = 300) -> str:
    text = value.get("message", value) if isinstance(value, dict) else value
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."
