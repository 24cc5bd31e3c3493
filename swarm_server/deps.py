"""FastAPI dependencies as `Annotated` aliases, so handlers read
`def start(ctx: Ctx, role: ControlAuth)`.

The auth aliases are the routes' access declarations (`swarm_server.auth.Requirement`):
the middleware reads them off the matched route, so a route needs nothing else.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from swarm_server.auth import ControlRequirement, ReaderRequirement, Role
from swarm_server.context import ServerContext

__all__ = ["ControlAuth", "Ctx", "ReaderAuth", "WorkerAuth", "get_ctx"]


# `async def` although it does no I/O: FastAPI runs plain `def` dependencies in its thread
# pool, a hop that costs about a millisecond per request on the episode plane's hot path.
async def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]

#: Code, config, engine lifecycle, audit: the control token only.
ControlAuth = Annotated[Role, Depends(ControlRequirement())]
#: Read-only status, runs, metrics, logs: control or worker token.
ReaderAuth = Annotated[Role, Depends(ReaderRequirement())]
#: The episode plane (begin/end/abort): control or worker token.
WorkerAuth = ReaderAuth
