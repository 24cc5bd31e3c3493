"""Who may call what: bearer-token roles, and `Requirement`, a route's declared access rule.

Roles: `control` (everything) and `worker` (episodes and read-only routes). With no
token configured the server is open (it then only binds loopback; see `Settings`).
Tokens are compared in constant time. Episode API keys for the `/v1/*` routes are a
separate mechanism (`swarm_server.episode_keys`, checked by `swarm_server.limits`).

A route declares who may call it exactly once, with its auth dependency
(`deps.ControlAuth`, `deps.ReaderAuth`, ...), each an `Annotated` alias over a
`Requirement` instance. FastAPI calls the requirement like any dependency;
`swarm_server.limits` reads the same instance off the matched route and calls `check`
before a byte of the body is read, so the two gates can never disagree. A new kind of
caller (an approver token, the console's cookie session) is a `Requirement` subclass
whose `check` reads its credential from the headers (docs/internals.md, "Access").
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import Header, Request
from starlette.datastructures import Headers

from swarm_server.errors import Forbidden, Unauthorized
from swarm_server.settings import Settings

if TYPE_CHECKING:
    from swarm_server.context import ServerContext

__all__ = ["ControlRequirement", "ReaderRequirement", "Requirement", "Role", "authenticate",
           "bearer_token", "require_control", "require_reader", "role_of"]

Role = Literal["control", "worker", "open"]

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def _matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def role_of(settings: Settings, token: str | None) -> Role | None:
    """The role a presented token grants, or None if it grants nothing."""
    control = settings.token.get_secret_value() if settings.token else None
    worker = settings.worker_token.get_secret_value() if settings.worker_token else None
    if token is not None:
        if control and _matches(token, control):
            return "control"
        if worker and _matches(token, worker):
            return "worker"
    if control is None and worker is None:
        return "open"
    return None


def require_control(settings: Settings, token: str | None) -> Role:
    role = role_of(settings, token)
    if role in ("control", "open"):
        return role
    if settings.token is None:  # only a worker token is configured: control stays open
        return "open"
    if role == "worker":
        raise Forbidden("this route needs the control token; the worker token cannot call it",
                        "use AJET_SWARM_TOKEN (control) for code, config and engine lifecycle")
    raise Unauthorized(_missing_or_wrong(token), "send 'Authorization: Bearer $AJET_SWARM_TOKEN'",
                       headers=_CHALLENGE)


def require_reader(settings: Settings, token: str | None) -> Role:
    role = role_of(settings, token)
    if role is not None:
        return role
    raise Unauthorized(
        _missing_or_wrong(token),
        "send 'Authorization: Bearer <token>' with AJET_SWARM_TOKEN or AJET_SWARM_WORKER_TOKEN",
        headers=_CHALLENGE,
    )


def authenticate(settings: Settings, headers: Headers) -> Role:
    """The first gate (`swarm_server.limits`, before routing): some credential is valid.

    Every path but the open ones needs at least this, so an anonymous caller learns
    nothing (401, never 404 or 422). A new credential kind must be accepted here too.
    """
    return require_reader(settings, bearer_token(headers.get("authorization")))


def _missing_or_wrong(token: str | None) -> str:
    return "missing bearer token" if token is None else "invalid token"


@dataclass(frozen=True)
class Requirement:
    """A route's access rule: a FastAPI dependency that `swarm_server.limits` also reads.

    Subclasses implement `check` from the request headers alone (no body, no route
    parameters), because the middleware calls it before the body is read.
    """

    #: What the rule admits, for docs and the access walk (`tests/security`).
    access: str

    def check(self, ctx: ServerContext, headers: Headers) -> Role:
        """The caller's role, or raise `Unauthorized` (401) / `Forbidden` (403)."""
        raise NotImplementedError

    # `async`: FastAPI runs a plain `def` dependency in its thread pool, a hop that costs
    # about a millisecond on the episode plane's hot path. The `authorization` parameter
    # only documents the header in the OpenAPI schema; `check` reads the headers itself.
    async def __call__(self, request: Request,
                       authorization: Annotated[str | None, Header()] = None) -> Role:
        return self.check(request.app.state.ctx, request.headers)


@dataclass(frozen=True)
class ControlRequirement(Requirement):
    """Code, config, engine lifecycle, audit: the control token only."""

    access: str = "control"

    def check(self, ctx: ServerContext, headers: Headers) -> Role:
        return require_control(ctx.settings, bearer_token(headers.get("authorization")))


@dataclass(frozen=True)
class ReaderRequirement(Requirement):
    """Read-only routes and the episode plane: the worker or the control token."""

    access: str = "reader"

    def check(self, ctx: ServerContext, headers: Headers) -> Role:
        return require_reader(ctx.settings, bearer_token(headers.get("authorization")))
