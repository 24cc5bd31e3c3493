"""FastAPI dependencies as `Annotated` aliases, so handlers read
`def start(ctx: Ctx, role: ControlAuth)`.

The auth aliases are the routes' access declarations (`swarm_server.auth.Requirement`):
the middleware reads them off the matched route, so a route needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from starlette.datastructures import Headers, State
from starlette.requests import cookie_parser

from swarm_server.auth import (
    ApproverRequirement,
    ControlRequirement,
    IndexRequirement,
    ReaderRequirement,
    Requirement,
    ReviewerRequirement,
    Role,
)
from swarm_server.context import ServerContext
from swarm_server.ui.sessions import COOKIE, ConsoleSession

__all__ = ["ApproverAuth", "ConsoleAuth", "ConsoleRequirement", "ControlAuth", "Ctx",
           "IndexAuth", "ReaderAuth", "ReviewerAuth", "WorkerAuth", "get_ctx"]


# `async def` although it does no I/O: FastAPI runs plain `def` dependencies in its thread
# pool, a hop that costs about a millisecond per request on the episode plane's hot path.
async def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]


@dataclass(frozen=True)
class ConsoleRequirement(Requirement):
    """A web console page: a live cookie session (approver: may decide; control: looks).

    Not signed in, signed out or expired: a 303 to the sign-in page, before any form
    body is read. The first gate lets `/ui` through without a bearer token; this is the
    check there.
    """

    access: str = "console"

    def check(self, state: State, headers: Headers) -> ConsoleSession:
        sid = cookie_parser(headers.get("cookie", "")).get(COOKIE)
        session: ConsoleSession | None = state.console_sessions.get(sid)
        if session is None:
            raise HTTPException(status_code=303, detail="sign in first",
                                headers={"Location": "/ui/login"})
        return session


#: Code, config, engine lifecycle, audit: the control token only.
ControlAuth = Annotated[Role, Depends(ControlRequirement())]
#: Read-only status, runs, metrics, logs: control or worker token.
ReaderAuth = Annotated[Role, Depends(ReaderRequirement())]
#: The episode plane (begin/end/abort): control or worker token.
WorkerAuth = ReaderAuth
#: Approve, deny, revoke, and the approver's review: a named approver token only (the
#: handler gets the approver's name). The control token is refused (403).
ApproverAuth = Annotated[str, Depends(ApproverRequirement())]
#: Code to review (the server's own ajet/ manifest and files): control token or approver.
ReviewerAuth = Annotated[str, Depends(ReviewerRequirement())]
#: The server's index: a reader token or an episode key (`auth.IndexRequirement`).
IndexAuth = Annotated[str, Depends(IndexRequirement())]
#: A web console page (see `ConsoleRequirement`).
ConsoleAuth = Annotated[ConsoleSession, Depends(ConsoleRequirement())]
