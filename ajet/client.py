"""`SwarmClient`: the synchronous Python client of the swarm server's HTTP API.

Small typed surface, one name per action, private helpers behind it (httpx's model).
Every request has a timeout, every wait a deadline; server errors become
`ajet.errors.SwarmHTTPError` subclasses carrying the server's `detail` and `hint`.

The original AgentJet client's methods (`get_engine_status`, `begin_episode`, ...) are
not here: `ajet.tuner_lib.experimental.swarm_client.SwarmClient` (ajet/compat/client.py)
is this class plus those methods, for scripts written for the original (docs/compat.md
says which to use when).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar, overload
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel

from ajet.copilot.job import AgentJetJob
from ajet.errors import (
    EngineStateConflict,
    SwarmConnectionError,
    SwarmError,
    SwarmNotFound,
    SwarmTimeout,
    error_for_status,
)
from ajet.protocol import (
    ApprovalDecisionPublic,
    ApprovalsPage,
    AuditPage,
    BeginEpisodeResponse,
    BlobsUploaded,
    CheckpointManifest,
    CheckpointsPage,
    CodeSyncResult,
    CommitRequest,
    ConfigAccepted,
    EndEpisodeResponse,
    EngineState,
    EngineStatus,
    FileEntry,
    GCResult,
    LogsResponse,
    ManifestResponse,
    MetricsResponse,
    Provenance,
    ReviewPage,
    RunPublic,
    RunsPage,
    SamplesPage,
    ServerCodePublic,
    SnapshotPublic,
    SnapshotsPage,
    StartRunRequest,
    StopEngineResponse,
    VersionResponse,
)

__all__ = ["SwarmClient"]

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)

#: States in which the engine serves episodes.
SERVING_STATES = (EngineState.ROLLING, EngineState.ROLLING_POST, EngineState.WEIGHT_SYNCING)
_LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}
#: Longest wait for one blob batch or commit of a code sync (large trees, slow links).
_UPLOAD_TIMEOUT_S = 300.0


#: Read timeout of a stop: the server's largest stop grace (max_stop_grace_s, 1800 s), the
#: SIGKILL wait and the run's finalisation.
_STOP_TIMEOUT_S = 1900.0


class SwarmClient:
    """Drive a swarm server: code, config, engine lifecycle, runs, metrics and episodes.

    `token` defaults to `AJET_SWARM_TOKEN`, else `AJET_SWARM_WORKER_TOKEN`. With
    `auto_start_swarm_server=True` and a loopback URL with a port, a local server is
    started when none answers, and stopped again by `close()` (or the `with` block).
    `transport` replaces httpx's network transport, for example with one that calls an
    ASGI app in the same process (tests: `fastapi.testclient.TestClient`'s transport).
    """

    def __init__(
        self,
        server_url: str,
        *,
        auto_start_swarm_server: bool = False,
        token: str | None = None,
        timeout: float = 30.0,
        swarm_workdir: str | os.PathLike[str] | None = None,
        server_start_timeout: float = 30.0,
        server_env: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        if token is None:
            token = os.environ.get("AJET_SWARM_TOKEN") or os.environ.get("AJET_SWARM_WORKER_TOKEN")
        self._token = token or None
        self._timeout = timeout
        self._server_process: subprocess.Popen[bytes] | None = None
        self._server_log: Path | None = None
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._http = httpx.Client(base_url=self.server_url, headers=headers, timeout=timeout,
                                  transport=transport)
        if auto_start_swarm_server:
            self._ensure_local_server(
                workdir=Path(swarm_workdir) if swarm_workdir else Path.cwd(),
                deadline_s=server_start_timeout,
                env=server_env,
            )

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the connection; stop the server if this client started it."""
        self._http.close()
        proc, self._server_process = self._server_process, None
        if proc is not None and proc.poll() is None:
            log.info("stopping the local swarm server this client started (pid %s)", proc.pid)
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def started_server_pid(self) -> int | None:
        """Pid of the local server this client started, if any."""
        return self._server_process.pid if self._server_process else None

    # ------------------------------------------------------------------ control

    def health(self) -> bool:
        """True if the server answers `/health`."""
        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def version(self) -> VersionResponse:
        return self._call("GET", "/version", model=VersionResponse)

    def engine_status(self) -> EngineStatus:
        """The engine state (`ENGINE.*`), current run, active snapshot and last error."""
        return self._call("GET", "/get_engine_status", model=EngineStatus)

    def submit_config(self, job: AgentJetJob | str) -> ConfigAccepted:
        """Send a job (model or YAML text). Accepted only while the engine is OFFLINE.

        A job sends only the fields its user set: the server chooses the rest for the
        model (`ConfigAccepted.notes` says which and why)."""
        text = job.submit_yaml() if isinstance(job, AgentJetJob) else job
        return self._call("POST", "/sync_train_config", json={"yaml": text}, model=ConfigAccepted)

    def check_config(self, job: AgentJetJob | str) -> ConfigAccepted:
        """Validate a job with the active code's validator; the server stores nothing.

        Allowed in any engine state: check before stopping a run for a new config.
        """
        text = job.submit_yaml() if isinstance(job, AgentJetJob) else job
        return self._call("POST", "/sync_train_config", json={"yaml": text, "check_only": True},
                          model=ConfigAccepted)

    def get_train_config(self) -> ConfigAccepted | None:
        """The job the next start runs with, or None if the server has none yet."""
        try:
            return self._call("GET", "/sync_train_config", model=ConfigAccepted)
        except SwarmNotFound:
            return None

    @overload
    def start_run(self, job: None = None, *, force_restart: bool = False, wait: bool = False,
                  wait_timeout: float = 300.0) -> EngineStatus: ...

    @overload
    def start_run(self, job: AgentJetJob | str | None = None, *, snapshot_id: str | None = None,
                  name: str | None = None, queue: bool = True, wait: bool = False,
                  wait_timeout: float = 300.0) -> RunPublic: ...

    def start_run(self, job: AgentJetJob | str | None = None, *, snapshot_id: str | None = None,
                  name: str | None = None, queue: bool = True, force_restart: bool = False,
                  wait: bool = False, wait_timeout: float = 300.0) -> EngineStatus | RunPublic:
        """Start a run; optionally wait until it serves episodes.

        With none of `job`, `snapshot_id` and `name`: the default run (`/start_engine`),
        with the stored config on the active snapshot; returns its `EngineStatus`.

        With any of them: a run beside the ones already running (`POST /runs`), pinned
        to `snapshot_id` (default: the active snapshot) and `job` (default: the stored
        config), on device slots of its own; returns its `RunPublic`. `name` (unique
        among active runs) addresses it in every other call. While the devices it needs
        are busy it waits in the server's queue (`queue_position`, `queue_reason`), or,
        with `queue=False`, is refused with `EngineStateConflict`. With `wait`, returns
        once it serves (queue time counts against `wait_timeout`).
        """
        if job is None and snapshot_id is None and name is None:
            status = self._call("POST", "/start_engine", json={"force_restart": force_restart},
                                model=EngineStatus, timeout=max(self._timeout, 60.0))
            if wait:
                return self.wait_for_state(SERVING_STATES, timeout=wait_timeout)
            return status
        if force_restart:
            raise ValueError("force_restart applies to the default run only; stop_run(name) "
                             "a concurrent run first, then start it again")
        text = job.submit_yaml() if isinstance(job, AgentJetJob) else job
        body = StartRunRequest(snapshot_id=snapshot_id, yaml=text, name=name, queue=queue)
        run = self._call("POST", "/runs", json=body.model_dump(exclude_none=True),
                         model=RunPublic, timeout=max(self._timeout, 60.0))
        if wait:
            self.wait_for_state(SERVING_STATES, run=run.run_id, timeout=wait_timeout)
            return self.get_run(run.run_id)
        return run

    def stop_run(self, run: str | None = None, *,
                 reason: str = "stopped by request") -> StopEngineResponse:
        """Stop a run (idempotent); says whether anything was running, which checkpoint
        the stop waited for and the run's last complete one.

        `run` is a run id or name (`POST /runs/{run}/stop`; a queued run leaves the
        queue); without it, the default run (`/stop_engine`). Waits as long as the
        server may (a run's stop grace covers its final checkpoint: minutes for a 7B
        model, at most the server's max_stop_grace_s)."""
        path = "/stop_engine" if run is None else f"/runs/{_ref(run)}/stop"
        return self._call("POST", path, json={"reason": reason},
                          model=StopEngineResponse, timeout=max(self._timeout, _STOP_TIMEOUT_S))

    def run_status(self, run: str = "current") -> EngineStatus:
        """One run's own state, step, last error, device slots and, while it waits, its
        queue position and reason (`run`: a run id, a name, or 'current')."""
        return self._call("GET", f"/runs/{_ref(run)}/status", model=EngineStatus)

    def configure_and_start(
        self, job: AgentJetJob, force_restart: bool = False, *, wait_timeout: float = 300.0
    ) -> EngineStatus:
        """Send `job` and start the engine, waiting until it serves episodes.

        If the engine runs already: with `force_restart` it is stopped, reconfigured and
        restarted; without, `EngineStateConflict` is raised.
        """
        status = self.engine_status()
        if status.state != EngineState.OFFLINE:
            if not force_restart:
                raise EngineStateConflict(
                    409, f"engine is {status.state}",
                    "call stop_run() first or pass force_restart=True",
                    method="POST", path="/sync_train_config",
                )
            self.check_config(job)  # a refused config must not stop the run
            self.stop_run(reason="configure_and_start(force_restart=True)")
        self.submit_config(job)
        return self.start_run(wait=True, wait_timeout=wait_timeout)

    def wait_for_state(self, states: EngineState | tuple[EngineState, ...], *,
                       run: str | None = None, timeout: float = 300.0,
                       poll_interval: float = 0.1) -> EngineStatus:
        """Poll until the engine (of `run`, a run id or name; default: the default run)
        is in one of `states`.

        Raises `SwarmError` with the engine's `last_error` if it falls back to OFFLINE
        while waiting for another state, and `SwarmTimeout` past the deadline. A queued
        run is OFFLINE without an error: the wait goes on through the queue.
        """
        wanted = (states,) if isinstance(states, EngineState) else tuple(states)
        deadline = time.monotonic() + timeout
        seen_other = False
        while True:
            status = self.engine_status() if run is None else self.run_status(run)
            if status.state in wanted:
                return status
            if status.state == EngineState.OFFLINE and EngineState.OFFLINE not in wanted:
                if seen_other or status.last_error is not None:
                    err = status.last_error
                    reason = err.reason if err else "engine is OFFLINE"
                    tail = "\n".join(err.log_tail[-20:]) if err else ""
                    raise SwarmError(f"engine went OFFLINE while waiting: {reason}\n{tail}".strip())
            else:
                seen_other = True
            if time.monotonic() > deadline:
                queued = (f" (queued #{status.queue_position}: {status.queue_reason})"
                          if status.queue_position is not None else "")
                raise SwarmTimeout(
                    f"engine{'' if run is None else ' of run ' + run} still {status.state}"
                    f"{queued} after {timeout:.0f}s waiting for "
                    f"{', '.join(s.value for s in wanted)}; check get_run_logs()"
                )
            time.sleep(poll_interval)

    # ------------------------------------------------------------------ code

    def push_code(self, path: str | os.PathLike[str],
                  force_restart: bool = False) -> CodeSyncResult:
        """Sync the git-tracked files under `<path>/ajet` incrementally (manifest, blobs, commit)."""
        from ajet.code_sync import push_tree

        return push_tree(self, Path(path), force_restart=force_restart)

    def push_code_zip(self, zip_path: str | os.PathLike[str],
                      force_restart: bool = False) -> CodeSyncResult:
        """One-shot upload of a zip whose members all live under `ajet/`."""
        data = Path(zip_path).read_bytes()
        return self._call(
            "POST", "/sync_train_code", content=data,
            params={"force_restart": str(force_restart).lower()},
            headers={"Content-Type": "application/zip"},
            model=CodeSyncResult, timeout=max(self._timeout, 300.0),
        )

    def get_active_code(self) -> SnapshotPublic | None:
        """The active snapshot, or None when the server runs its own code."""
        data = self._call("GET", "/code")
        return SnapshotPublic.model_validate(data) if data else None

    def check_manifest(self, files: list[FileEntry],
                       provenance: Provenance | None = None) -> ManifestResponse:
        """Which blobs of this manifest the server lacks, and its snapshot id; writes nothing."""
        body = {"files": [f.model_dump() for f in files],
                "provenance": (provenance or Provenance()).model_dump(mode="json")}
        return self._call("POST", "/code/manifest", json=body, model=ManifestResponse)

    def upload_blob_batch(self, records: bytes) -> BlobsUploaded:
        """Store blobs: `records` is `<sha256> <size>\\n` then `size` bytes, per blob;
        the server verifies each hash (`ajet.code_sync.upload_blobs` builds the batches)."""
        return self._call("POST", "/code/blobs", content=records,
                          headers={"Content-Type": "application/octet-stream"},
                          model=BlobsUploaded, timeout=max(self._timeout, _UPLOAD_TIMEOUT_S))

    def commit_snapshot(self, request: CommitRequest) -> CodeSyncResult:
        """Make a snapshot of blobs the server holds and (with `activate`) run on it."""
        return self._call("POST", "/code/commit", json=request.model_dump(mode="json"),
                          model=CodeSyncResult, timeout=max(self._timeout, _UPLOAD_TIMEOUT_S))

    def list_snapshots(self) -> SnapshotsPage:
        return self._call("GET", "/code/snapshots", model=SnapshotsPage)

    def activate_snapshot(self, snapshot_id: str, *, force_restart: bool = False) -> CodeSyncResult:
        """Re-activate an earlier snapshot (or 'server' for the server's own code)."""
        return self._call("POST", "/code/activate",
                          json={"snapshot_id": snapshot_id, "force_restart": force_restart},
                          model=CodeSyncResult, timeout=max(self._timeout, 120.0))

    def get_blob(self, sha256: str) -> bytes:
        """One file's bytes from the server's blob store, by content hash."""
        return self._call_raw("GET", f"/code/blobs/{sha256}").content

    def get_snapshot(self, snapshot_ref: str) -> SnapshotPublic:
        """One snapshot (id or unique prefix) with its manifest and approval."""
        return self._call("GET", f"/code/snapshots/{snapshot_ref}", model=SnapshotPublic)

    def get_server_code(self) -> ServerCodePublic:
        """The server's own ajet/ manifest (snapshot id 'server'); control or approver token."""
        return self._call("GET", "/code/server", model=ServerCodePublic)

    def get_server_blob(self, sha256: str) -> bytes:
        """One file of the server's own ajet/, by content hash."""
        return self._call_raw("GET", f"/code/server/blobs/{sha256}").content

    # ------------------------------------------------------------------ approvals (approver token)

    def list_approvals(self, *, recent: int = 20) -> ApprovalsPage:
        """Pending snapshots and recent decisions (an approver token)."""
        return self._call("GET", "/approvals", params={"recent": recent}, model=ApprovalsPage)

    def get_review(self, snapshot_ref: str, *, offset: int = 0, limit: int = 500,
                   base: str | None = None) -> ReviewPage:
        """One page of a snapshot's review, computed by the server (an approver token)."""
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if base:
            params["base"] = base
        return self._call("GET", f"/approvals/{snapshot_ref}", params=params, model=ReviewPage,
                          timeout=max(self._timeout, 120.0))

    def decide_approval(self, snapshot_id: str, decision: str, *, note: str = "",
                        base_id: str | None = None) -> ApprovalDecisionPublic:
        """`decision` is approve, deny or revoke; `snapshot_id` is the full id (an approver
        token); `base_id` the base of the review that was read (`ReviewPage.base_id`)."""
        if decision not in ("approve", "deny", "revoke"):
            raise ValueError(f"decision {decision!r} is not approve, deny or revoke")
        body: dict[str, str] = {"snapshot_id": snapshot_id, "note": note}
        if base_id is not None:
            body["base_id"] = base_id
        return self._call("POST", f"/approvals/{snapshot_id}/{decision}", json=body,
                          model=ApprovalDecisionPublic, timeout=max(self._timeout, 120.0))

    def gc_snapshots(self, *, keep: int | None = None) -> GCResult:
        params = {"keep": keep} if keep is not None else None
        return self._call("POST", "/code/gc", params=params, model=GCResult)

    # ------------------------------------------------------------------ runs

    def list_runs(self, *, state: Literal["active", "ended", "all"] | None = None,
                  experiment_name: str | None = None, status: str | None = None,
                  offset: int = 0, limit: int = 20) -> RunsPage:
        """Runs, newest first; `state='active'` the queued and running ones only. The page
        carries the server's device pool (`devices`: slots free, held per run, queue)."""
        params: dict[str, Any] = {"offset": offset, "limit": limit}
        if state:
            params["state"] = state
        if experiment_name:
            params["experiment_name"] = experiment_name
        if status:
            params["status"] = status
        return self._call("GET", "/runs", params=params, model=RunsPage)

    def get_run(self, run_id: str) -> RunPublic:
        """One run with its config (`run_id`: a run id, a name, or 'current')."""
        return self._call("GET", f"/runs/{_ref(run_id)}", model=RunPublic)

    def get_metrics(self, run_id: str = "current", *, since_step: int | None = None,
                    fields: list[str] | None = None, max_points: int | None = None
                    ) -> MetricsResponse:
        """Per-step metrics of a run (a run id, a name, or 'current': the default run)."""
        params: dict[str, Any] = {}
        if since_step is not None:
            params["since_step"] = since_step
        if fields:
            params["fields"] = ",".join(fields)
        if max_points is not None:
            params["max_points"] = max_points
        return self._call("GET", f"/runs/{_ref(run_id)}/metrics", params=params,
                          model=MetricsResponse)

    def get_samples(self, step: int, run_id: str = "current", *, offset: int = 0,
                    limit: int = 20) -> SamplesPage:
        """One page of a training step's samples (token ids, text, loss mask, log-probs,
        the completions each merged); `next_offset` names the next page."""
        return self._call("GET", f"/runs/{_ref(run_id)}/samples",
                          params={"step": step, "offset": offset, "limit": limit},
                          model=SamplesPage)

    def get_run_logs(self, run_id: str = "current", *, tail: int = 100,
                     grep: str | None = None, regex: bool = False) -> LogsResponse:
        """The last `tail` lines of a run's engine.log, keeping only lines containing `grep`
        (a regular expression of at most 200 characters with `regex=True`)."""
        params: dict[str, Any] = {"tail": tail}
        if grep:
            params["grep"] = grep
            if regex:
                params["regex"] = "true"
        return self._call("GET", f"/runs/{_ref(run_id)}/logs", params=params, model=LogsResponse)

    def list_checkpoints(self, run_id: str = "current") -> CheckpointsPage:
        """A run's checkpoints: name, step, kind, size, complete or not."""
        return self._call("GET", f"/runs/{_ref(run_id)}/checkpoints", model=CheckpointsPage)

    def checkpoint_manifest(self, run_id: str, name: str) -> CheckpointManifest:
        """Every file of a checkpoint with its sha256, and the archive's size and ETag."""
        return self._call("GET", f"/runs/{_ref(run_id)}/checkpoints/{name}",
                          model=CheckpointManifest, timeout=max(self._timeout, 600.0))

    @contextmanager
    def open_checkpoint_archive(self, run_id: str, name: str, *, start: int = 0,
                                if_range: str | None = None) -> Iterator[httpx.Response]:
        """The checkpoint's tar as a streamed response; from byte `start` (a 206) when
        `if_range` (the manifest's ETag) still matches, else the whole archive (a 200)."""
        path = f"/runs/{_ref(run_id)}/checkpoints/{name}/archive"
        headers = {"Range": f"bytes={start}-"} if start else {}
        if start and if_range:
            headers["If-Range"] = if_range
        try:
            with self._http.stream("GET", path, headers=headers,
                                   timeout=httpx.Timeout(self._timeout, read=600.0)) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_status(response, "GET", path)
                yield response
        except httpx.HTTPError as exc:
            raise SwarmConnectionError(f"GET {path}: the download broke off ({exc}); run it "
                                       "again to resume") from exc

    def download_checkpoint(self, run_id: str, dest: str | os.PathLike[str], *,
                            name: str | None = None) -> Path:
        """Download a checkpoint into `dest/<name>`, resumable, verified against its
        manifest of hashes (`ajet.checkpoint_download`). Default: the latest complete."""
        from ajet.checkpoint_download import download_checkpoint

        return download_checkpoint(self, run_id, Path(dest), name=name)

    def get_audit(self, *, offset: int = 0, limit: int = 100) -> AuditPage:
        return self._call("GET", "/audit", params={"offset": offset, "limit": limit},
                          model=AuditPage)

    def compare_runs(self, run_ids: list[str], metric: str = "reward_mean") -> dict[str, Any]:
        """Per run: snapshot id, config differences between the runs, metric first/last/best."""
        from ajet.run_compare import compare_runs

        return compare_runs(self, run_ids, metric)

    # ------------------------------------------------------------------ episodes

    def open_episode(self, discard_episode_timeout: float | None = None, *,
                     episode_type: str = "train", client_uuid: str | None = None,
                     task_id: str | None = None, run_id: str | None = None,
                     **metadata: Any) -> BeginEpisodeResponse:
        """Claim an episode; returns its uuid and an OpenAI base URL and key bound to it
        (and `anthropic_base_url`, the server root, for Anthropic clients: same key).

        `episode_type="eval"` episodes are served but never trained on; with
        `client_uuid`, only that client may end or abort the episode. `run_id` (a run id
        or name) claims it from that run, and its key works only there; without it, the
        default run's. Ending, aborting and chatting route by the episode itself.
        """
        body: dict[str, Any] = {"metadata": metadata, "episode_type": episode_type}
        if discard_episode_timeout is not None:
            body["discard_episode_timeout"] = discard_episode_timeout
        if client_uuid is not None:
            body["client_uuid"] = client_uuid
        if task_id is not None:
            body["task_id"] = task_id
        if run_id is not None:
            body["run_id"] = run_id
        return self._call("POST", "/begin_episode", json=body, model=BeginEpisodeResponse)

    def report_episode(self, episode_uuid: str, task_id: str, reward: float, *,
                       is_success: bool | None = None, metadata: dict[str, Any] | None = None,
                       log_metrics: dict[str, float] | None = None,
                       client_uuid: str | None = None,
                       declare_client_active: bool = True) -> EndEpisodeResponse:
        """Report an episode's reward; the engine trains on it (not on an eval episode)."""
        body = {"episode_uuid": episode_uuid, "task_id": str(task_id), "reward": reward,
                "is_success": is_success, "metadata": metadata or {},
                "log_metrics": log_metrics or {}, "client_uuid": client_uuid,
                "declare_client_active": declare_client_active}
        return self._call("POST", "/end_episode", json=body, model=EndEpisodeResponse)

    def cancel_episode(self, episode_uuid: str, *, reason: str = "aborted",
                       client_uuid: str | None = None,
                       declare_client_active: bool = True) -> None:
        """Give an episode up; its slot is re-queued for another worker."""
        self._call("POST", "/abort_episode",
                   json={"episode_uuid": episode_uuid, "reason": reason,
                         "client_uuid": client_uuid,
                         "declare_client_active": declare_client_active})

    # ------------------------------------------------------------------ private

    def _call(self, method: str, path: str, *, model: type[_M] | None = None,
              **kwargs: Any) -> Any:
        response = self._call_raw(method, path, **kwargs)
        if model is not None:
            return model.model_validate(response.json())
        return response.json() if response.content else None

    def _call_raw(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise SwarmConnectionError(
                f"{method} {path}: no answer from {self.server_url} in time ({exc})"
            ) from exc
        except httpx.HTTPError as exc:
            raise SwarmConnectionError(
                f"{method} {path}: cannot reach swarm server at {self.server_url} ({exc}); "
                "is `ajet-swarm start` running there?"
            ) from exc
        _raise_for_status(response, method, path)
        return response

    def _ensure_local_server(self, *, workdir: Path, deadline_s: float,
                             env: Mapping[str, str] | None) -> None:
        if self.health():
            return
        parts = urlsplit(self.server_url)
        if parts.hostname not in _LOOPBACK_HOSTS or parts.port is None:
            raise SwarmConnectionError(
                f"auto_start_swarm_server needs a localhost URL with a port, got {self.server_url}; "
                "start the server on the cluster with `ajet-swarm start --swarm-port=10086`"
            )
        missing = [m for m in ("fastapi", "uvicorn", "pydantic_settings") if not _importable(m)]
        if missing:
            raise SwarmConnectionError(
                f"no server answers at {self.server_url}, and auto_start_swarm_server cannot "
                f"start one here: {', '.join(missing)} is not installed (a laptop-only "
                "install). Install the server extra: pip install 'agentjet-swarm[server]', "
                "or start the server where it is installed (`ajet-swarm start`)")
        workdir.mkdir(parents=True, exist_ok=True)
        self._server_log = workdir / "swarm_server.log"
        cmd = [sys.executable, "-m", "swarm_server", "start", f"--swarm-port={parts.port}",
               "--host", "127.0.0.1", "--workdir", str(workdir)]
        child_env = {**os.environ, **(env or {})}
        if self._token and "AJET_SWARM_TOKEN" not in child_env:
            child_env["AJET_SWARM_TOKEN"] = self._token
        log.info("starting a local swarm server: %s (log: %s)", " ".join(cmd), self._server_log)
        with open(self._server_log, "ab") as log_file:
            self._server_process = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=child_env, cwd=workdir, start_new_session=True,
            )
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.health():
                return
            if self._server_process.poll() is not None:
                tail = _tail(self._server_log, 20)
                self._server_process = None
                raise SwarmConnectionError(
                    f"the local swarm server exited at start:\n{tail}"
                )
            time.sleep(0.1)
        self.close()
        raise SwarmTimeout(
            f"local swarm server not healthy after {deadline_s:.0f}s; see {self._server_log}"
        )


def _ref(run: str) -> str:
    """A run id or name as one path segment (names are plain, but never trust that)."""
    return quote(run, safe="")


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text("utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _importable(module: str) -> bool:
    """True when `module` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        return False


def _raise_for_status(response: httpx.Response, method: str, path: str) -> None:
    """The server's error as the client's exception, with its detail and hint."""
    if response.status_code < 400:
        return
    detail: Any = response.text
    hint, param = "", None
    try:
        body = response.json()
        if isinstance(body, dict):
            detail = body.get("detail", body)
            hint = str(body.get("hint", "") or "")
            param = body["param"] if isinstance(body.get("param"), str) else None
    except ValueError:
        pass
    retry = response.headers.get("retry-after", "")
    raise error_for_status(response.status_code, detail, hint, param=param,
                           retry_after_s=float(retry) if retry.isdigit() else None,
                           method=method, path=path)
