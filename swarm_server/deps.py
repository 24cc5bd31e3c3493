"""FastAPI dependencies as `Annotated` aliases, so handlers read
`def start(ctx: Ctx, role: ControlAuth)`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from swarm_server.auth import Role, bearer_token, require_control, require_reader
from swarm_server.context import ServerContext

__all__ = ["ControlAuth", "Ctx", "ReaderAuth", "WorkerAuth", "get_ctx"]


# The dependencies are `async def` although they do no I/O: FastAPI runs plain `def`
# dependencies in its thread pool, a hop that costs about a millisecond per request on
# the episode plane's hot path.
async def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]


async def _control(ctx: Ctx, authorization: Annotated[str | None, Header()] = None) -> Role:
    return require_control(ctx.settings, bearer_token(authorization))


async def _reader(ctx: Ctx, authorization: Annotated[str | None, Header()] = None) -> Role:
    return require_reader(ctx.settings, bearer_token(authorization))


#: Code, config, engine lifecycle, audit: the control token only.
ControlAuth = Annotated[Role, Depends(_control)]
#: Read-only status, runs, metrics, logs: control or worker token.
ReaderAuth = Annotated[Role, Depends(_reader)]
#: The episode plane (begin/end/abort): control or worker token.
WorkerAuth = ReaderAuth
