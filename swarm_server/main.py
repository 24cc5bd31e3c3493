"""`create_app(settings)`: assemble the swarm server's FastAPI application.

Builds the `ServerContext` (ledger, snapshot store, engine controller, episode gateway),
reconciles it with what is on disk and what is still running (recovery after a crash),
and mounts one router per resource.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pathlib import Path

from fastapi import FastAPI

import ajet
from swarm_server.approvals import Approvals

from swarm_server.context import ServerContext
from swarm_server.engine import EngineController
from swarm_server.episode_lane import EpisodeLane
from swarm_server.episodes import EpisodeGateway
from swarm_server.errors import install_error_handlers
from swarm_server.ledger import Ledger
from swarm_server.limits import LIMIT_RESPONSES, LimitsMiddleware
from swarm_server.routes import approvals, code, control, docs, episodes, original, runs
from swarm_server.server_code import ServerCode
from swarm_server.ui import SessionStore
from swarm_server.ui.routes import router as console_router
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore
from swarm_server.workdir import prepare_workdir

__all__ = ["build_context", "create_app"]

log = logging.getLogger(__name__)


def build_context(settings: Settings) -> ServerContext:
    prepare_workdir(settings.workdir)  # umask 077 before the first file is created
    ledger = Ledger(settings.ledger_path)
    snapshots = SnapshotStore(settings, ledger)
    gate = Approvals(settings, ledger, snapshots, ServerCode(Path(ajet.__file__).parent))
    engine = EngineController(settings, ledger, snapshots, approvals=gate)
    gateway = EpisodeGateway(settings, engine)
    return ServerContext(settings=settings, ledger=ledger, snapshots=snapshots, engine=engine,
                         episodes=gateway, approvals=gate)


def create_app(settings: Settings) -> FastAPI:
    ctx = build_context(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.snapshots.recover()
        ctx.engine.recover()
        log.info("swarm server ready on %s:%s (workdir %s); approvals %s", settings.host,
                 settings.port, settings.workdir,
                 f"enforced ({len(settings.approvers)} approver(s))"
                 if settings.approvals_enforced else "not enforced (no approver tokens)")
        try:
            yield
        finally:
            await ctx.episodes.aclose()
            ctx.engine.shutdown()
            ctx.ledger.close()

    app = FastAPI(
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
    install_error_handlers(app)
    app.include_router(control.router)
    app.include_router(code.router)
    app.include_router(runs.router)
    app.include_router(episodes.router)
    app.include_router(approvals.router)
    app.include_router(console_router)
    app.include_router(original.router)
    app.include_router(docs.router)
    # The hot episode routes without FastAPI's routing (swarm_server.episode_lane), inside
    # the limits gate: it sees only requests that passed the first gate.
    app.add_middleware(EpisodeLane, rows=episodes.EPISODE_ROUTES, router=episodes.router)
    # Auth, header/body/depth caps and body timeouts before any route parses a byte.
    app.add_middleware(LimitsMiddleware, ctx=ctx)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentjet-swarm")
    except PackageNotFoundError:
        return "0.0.0"
