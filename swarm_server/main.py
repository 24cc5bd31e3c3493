"""`create_app(settings)`: assemble the swarm server's FastAPI application.

Builds the `ServerContext` (ledger, snapshot store, engine controller, episode gateway),
reconciles it with what is on disk and what is still running (recovery after a crash),
and mounts one router per resource.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI
from starlette.types import Receive, Scope, Send

import ajet
from swarm_server.approvals import Approvals

from swarm_server.context import ServerContext
from swarm_server.engine import EngineController
from swarm_server.devices import DevicePool
from swarm_server.engine_user import resolve_engine_user
from swarm_server.episode_lane import EpisodeLane, PlaneRoute
from swarm_server.episodes import EpisodeGateway
from swarm_server.errors import StartupRefused, install_error_handlers
from swarm_server.ledger import Ledger, LedgerUnusable, check_ledger_file, set_ledger_aside
from swarm_server.limits import LIMIT_RESPONSES, LimitsMiddleware
from swarm_server.routes import approvals, code, control, docs, episodes, original, runs
from swarm_server.run_pool import RunPool
from swarm_server.server_code import ServerCode
from swarm_server.ui import SessionStore
from swarm_server.ui.sessions import SignInThrottle
from swarm_server.ui.routes import router as console_router
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore
from swarm_server.workdir import prepare_workdir

if TYPE_CHECKING:
    from swarm_server.launchers.ray_launcher import RaySpawner

__all__ = ["SwarmApp", "build_context", "create_app"]

log = logging.getLogger(__name__)


def build_context(settings: Settings) -> ServerContext:
    engine_user = resolve_engine_user(settings)
    # umask 077 before the first file is created
    prepare_workdir(settings.workdir, shared=engine_user is not None)
    if engine_user is not None:  # after the tightening: what the engine must reach
        try:
            engine_user.share_workdir(settings)
        except OSError as exc:
            raise StartupRefused(f"--engine-user {engine_user.name}: cannot share "
                                 f"{exc.filename} with its group: {exc.strerror}") from exc
        engine_user.check(settings)
    ledger = Ledger(open_ledger_path(settings))
    snapshots = SnapshotStore(settings, ledger)
    if engine_user is not None:
        snapshots.share = engine_user.share_snapshot
    gate = Approvals(settings, ledger, snapshots, ServerCode(Path(ajet.__file__).parent))
    launcher = _launcher(settings, engine_user)
    # under Ray, Ray's placement groups hand out the devices; locally, the pool does
    devices = (DevicePool.for_ray() if launcher is not None
               else DevicePool.for_host(settings.devices))
    log.info("device slots: %d %s (%s)", devices.total, devices.kind,
             ",".join(map(str, devices.slots)))
    engine = EngineController(settings, ledger, snapshots, approvals=gate,
                              engine_user=engine_user, devices=devices,
                              spawner=launcher, probe=launcher.probe if launcher else None)
    pool = RunPool(settings, ledger, snapshots, gate, engine, devices, engine_user=engine_user)
    # GC never removes a snapshot pending review, nor one a run uses or waits for
    snapshots.pinned = lambda: gate.pending_ids() | pool.active_snapshot_ids()
    gateway = EpisodeGateway(settings, pool,
                             channel_target=launcher.channel_target if launcher else None)
    return ServerContext(settings=settings, ledger=ledger, snapshots=snapshots, engine=engine,
                         runs=pool, episodes=gateway, approvals=gate)


def _launcher(settings: Settings, engine_user: object | None) -> RaySpawner | None:
    """The Ray launcher under `--launcher ray` (None: the local one, the controller's
    default); refused at start when Ray is missing or its cluster unreachable."""
    if settings.launcher != "ray":
        return None
    if engine_user is not None:
        raise StartupRefused("--engine-user does not apply under --launcher ray: the ranks "
                             "run as the Ray cluster's user; leave --engine-user unset")
    from swarm_server.launchers.ray_launcher import RaySpawner  # the `ray` extra

    try:
        spawner = RaySpawner.connect(settings)
    except OSError as exc:
        raise StartupRefused(str(exc)) from exc
    spawner.stop_strays()  # a killed server's runs: recover() then closes their rows
    return spawner


def open_ledger_path(settings: Settings) -> Path:
    """The ledger's path once it is known sound, absent, or set aside by `--new-ledger`.

    A ledger that is missing while runs are on disk is refused too: the history would
    otherwise start over without a word.
    """
    path = settings.ledger_path
    try:
        check_ledger_file(path)
        if not path.exists() and _has_runs(settings.runs_dir):
            raise LedgerUnusable(
                f"the ledger {path} is missing but {settings.runs_dir} holds runs: the "
                "history of runs, approvals and the audit log is gone; restore the ledger "
                "from a backup, or start with --new-ledger to begin a fresh one")
    except LedgerUnusable:
        if not settings.new_ledger:
            raise
        if path.exists():
            aside = set_ledger_aside(path)
            log.warning("--new-ledger: the unusable ledger was moved to %s; starting a fresh "
                        "one at %s", aside, path)
        else:
            log.warning("--new-ledger: starting a fresh ledger at %s", path)
    return path


def _has_runs(runs_dir: Path) -> bool:
    try:
        return any(entry.is_dir() for entry in runs_dir.iterdir())
    except OSError:
        return False


def create_app(settings: Settings) -> SwarmApp:
    ctx = build_context(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.snapshots.recover()
        ctx.runs.recover()
        log.info("swarm server ready on %s:%s (workdir %s); approvals %s", settings.host,
                 settings.port, settings.workdir,
                 f"enforced ({len(settings.approvers)} approver(s))"
                 if settings.approvals_enforced else "not enforced (no approver tokens)")
        try:
            yield
        finally:
            await ctx.episodes.aclose()
            ctx.runs.shutdown()
            ctx.ledger.close()

    app = SwarmApp(
        title="AgentJet Swarm server",
        version=_version(),
        lifespan=lifespan,
        description="Control plane of the AgentJet training engine. See docs/api.md.",
        responses=LIMIT_RESPONSES,  # swarm_server.limits may refuse any request
        # served by routes/docs.py, which declare their requirement like every route
        openapi_url=None, docs_url=None, redoc_url=None,
    )
    app.state.ctx = ctx
    app.state.console_sessions = SessionStore(settings.ui_session_ttl_s)
    app.state.sign_in_throttle = SignInThrottle(
        per_source=settings.ui_sign_ins_per_source, overall=settings.ui_sign_ins_overall,
        window_s=60.0)
    install_error_handlers(app)
    app.include_router(control.router)
    app.include_router(code.router)
    app.include_router(runs.router)
    app.include_router(episodes.router)
    app.include_router(approvals.router)
    app.include_router(console_router)
    app.include_router(original.router)
    app.include_router(docs.router)
    # Auth, header/body/depth caps and body timeouts before any route parses a byte.
    app.add_middleware(LimitsMiddleware, ctx=ctx)
    app.put_lane_in_front(episodes.EPISODE_ROUTES, episodes.router, ctx)
    return app


class SwarmApp(FastAPI):
    """The server's FastAPI app, with `lane` (`episode_lane.EpisodeLane`) in front of it.

    The lane's rows are the calls every rollout worker makes per episode; in front, they
    skip what the middleware stack spends on each request (FastAPI's telemetry check,
    Starlette's error, telemetry and body-limit layers: a tenth of their CPU per call),
    and the lane does what those do for them (the limits gate, the 500 handler). While
    FastAPI's OpenTelemetry instrumentation is on, every request takes the stack, so that
    it is traced.
    """

    lane: EpisodeLane | None = None
    _traced = False
    _traced_checked_at = -1.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.lane
        if lane is not None:
            hit = lane.lookup(scope)
            if hit is not None and not self.root_path and not self._telemetry_on():
                scope["app"] = self  # as Starlette sets it
                await lane.serve(hit, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def put_lane_in_front(self, rows: Sequence[PlaneRoute], router: APIRouter,
                          ctx: ServerContext) -> None:
        """Serve `rows` (built into `router` by `plane_router`) without FastAPI's routing
        or middleware stack, through a limits gate of their own."""
        self.lane = EpisodeLane(rows=rows, router=router,
                                gate=LimitsMiddleware(self.stack, ctx=ctx))

    async def stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app without the lane in front (what the lane passes on)."""
        await FastAPI.__call__(self, scope, receive, send)

    def _telemetry_on(self) -> bool:
        """FastAPI's native telemetry (newer FastAPI) is configured; asked once a second,
        not per request (the question reads the environment and OpenTelemetry's globals)."""
        telemetry = getattr(self, "_native_telemetry", None)
        if telemetry is None:
            return False
        now = time.monotonic()
        if now - self._traced_checked_at >= 1.0:
            self._traced, self._traced_checked_at = bool(telemetry.enabled()), now
        return self._traced


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentjet-swarm")
    except PackageNotFoundError:
        return "0.0.0"
