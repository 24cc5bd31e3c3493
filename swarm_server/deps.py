"""FastAPI dependencies as `Annotated` aliases, so handlers read
`def start(ctx: Ctx, role: ControlAuth)`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from swarm_server.auth import (
    Role,
    bearer_token,
    require_approver,
    require_control,
    require_reader,
    require_reviewer,
)
from swarm_server.context import ServerContext
from swarm_server.ui.sessions import COOKIE, ConsoleSession

__all__ = ["ROLE_CHECKS", "ApproverAuth", "ConsoleAuth", "ControlAuth", "Ctx", "ReaderAuth",
           "ReviewerAuth", "WorkerAuth", "get_ctx"]


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


async def _approver(ctx: Ctx, authorization: Annotated[str | None, Header()] = None) -> str:
    return require_approver(ctx.settings, bearer_token(authorization))


async def _reviewer(ctx: Ctx, authorization: Annotated[str | None, Header()] = None) -> str:
    return require_reviewer(ctx.settings, bearer_token(authorization))


#: Approve, deny, revoke, and the approver's review: a named approver token only (the
#: handler gets the approver's name). The control token is refused (403).
ApproverAuth = Annotated[str, Depends(_approver)]
#: Code to review (the server's own ajet/ manifest and files): control token or approver.
ReviewerAuth = Annotated[str, Depends(_reviewer)]

async def _console(request: Request) -> ConsoleSession:
    session = request.app.state.console_sessions.get(request.cookies.get(COOKIE))
    if session is None:  # not signed in, signed out, or expired: to the sign-in page
        raise HTTPException(status_code=303, detail="sign in first",
                            headers={"Location": "/ui/login"})
    return session


#: A web console page: a live cookie session (approver: may decide; control: looks only).
#: The ASGI gate lets `/ui` through without a bearer token; this is the check there.
ConsoleAuth = Annotated[ConsoleSession, Depends(_console)]

#: Which token check each auth dependency stands for, for the ASGI gate
#: (`swarm_server.limits`), which must decide before any body is read. A route with none
#: of these needs a reader token there.
ROLE_CHECKS = {
    _control: require_control,
    _approver: require_approver,
    _reviewer: require_reviewer,
}
