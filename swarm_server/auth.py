"""Who may call what: bearer-token roles, and `Requirement`, a route's declared access rule.

Roles: `control` (everything but approving), `worker` (episodes and read-only routes) and
named `approver`s (the approval routes, and the server-side review). With no token
configured the server is open (it then only binds loopback; see `Settings`). Tokens are
compared in constant time. An approver token opens only the approval routes and the
code-review routes; the control token never approves (docs/design.md, "Approvals"). Episode API
keys for the `/v1/*` routes are a separate mechanism (`swarm_server.episode_keys`,
checked by `swarm_server.limits`).

A route declares who may call it exactly once, with its auth dependency
(`deps.ControlAuth`, `deps.ApproverAuth`, ...), each an `Annotated` alias over a
`Requirement` instance. FastAPI calls the requirement like any dependency;
`swarm_server.limits` reads the same instance off the matched route and calls `check`
before a byte of the body is read, so the two gates can never disagree. A new kind of
caller is a `Requirement` subclass whose `check` reads its credential from the headers
(the console's cookie session: `deps.ConsoleRequirement`; docs/internals.md, "Access").
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Header, Request
from starlette.datastructures import Headers, State
from starlette.types import Scope

from ajet.errors import SwarmAuthError
from swarm_server.settings import Settings

__all__ = ["APPROVER_PREFIX", "CREDENTIAL_SCOPE", "EPISODE_SCOPE", "ApproverRequirement",
           "ControlRequirement", "EpisodeKeyRequirement", "IndexRequirement",
           "ReaderRequirement", "Requirement", "ReviewerRequirement", "Role", "approver_of",
           "authenticate", "bearer_token", "episode_key", "require_approver",
           "require_control", "require_reader", "require_reviewer", "role_of"]

Role = Literal["control", "worker", "open"]

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
#: Audit-log role of an approver: `approver:<name>`.
APPROVER_PREFIX = "approver:"
#: Where the first gate (`swarm_server.limits`) leaves the episode id of a verified
#: episode key in the ASGI scope, so that the key is verified once per request.
EPISODE_SCOPE = "ajet.episode_uuid"
#: Where it leaves what `authenticate` found (a role, or `approver:<name>`).
CREDENTIAL_SCOPE = "ajet.credential"
_READER_ROLES = ("control", "worker", "open")


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def episode_key(headers: Headers) -> str | None:
    """The episode key of a `/v1/*` request: `Authorization: Bearer` (OpenAI clients, the
    Anthropic SDK's `auth_token`), else `x-api-key` (the Anthropic SDK's `api_key`,
    `ANTHROPIC_API_KEY` harnesses)."""
    return bearer_token(headers.get("authorization")) or headers.get("x-api-key") or None


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
        raise SwarmAuthError(
            403, "this route needs the control token; the worker token cannot call it",
            "use AJET_SWARM_TOKEN (control) for code, config and engine lifecycle")
    _refuse_approver(settings, token)
    raise SwarmAuthError(
        401, _missing_or_wrong(token), "send 'Authorization: Bearer $AJET_SWARM_TOKEN'",
        headers=_CHALLENGE)


def require_reader(settings: Settings, token: str | None) -> Role:
    role = role_of(settings, token)
    if role is not None:
        return role
    _refuse_approver(settings, token)
    raise SwarmAuthError(
        401, _missing_or_wrong(token),
        "send 'Authorization: Bearer <token>' with AJET_SWARM_TOKEN or AJET_SWARM_WORKER_TOKEN",
        headers=_CHALLENGE,
    )


def _refuse_approver(settings: Settings, token: str | None) -> None:
    if approver_of(settings, token) is not None:
        raise SwarmAuthError(
            403, "an approver token opens only the approval routes (/approvals) and "
            "the code to review (/code/server)",
            "use the control or worker token here, or the web console")


def _missing_or_wrong(token: str | None) -> str:
    return "missing bearer token" if token is None else "invalid token"


def approver_of(settings: Settings, token: str | None) -> str | None:
    """The name of the approver whose token this is, or None."""
    if token is None:
        return None
    found = None
    for name, expected in settings.approvers.items():
        if _matches(token, expected):  # no early exit: constant time over the list
            found = name
    return found


def require_approver(settings: Settings, token: str | None) -> str:
    """The approver's name; 401 without a valid token, 403 for the control/worker token."""
    name = approver_of(settings, token)
    if name is not None:
        return name
    role = role_of(settings, token) if token is not None else None
    if role in ("control", "worker"):
        if not settings.approvals_enforced:
            raise SwarmAuthError(
                403, "approvals are not enforced on this server: it has no approver "
                "tokens", "set AJET_SWARM_APPROVER_TOKENS (name=token,...) on the "
                "server to make every snapshot need an approver")
        raise SwarmAuthError(
            403, f"the {role} token cannot approve; approval routes take an approver "
            "token only", "an approver uses their own token "
            "(AJET_SWARM_APPROVER_TOKEN) or the web console")
    raise SwarmAuthError(401, _missing_or_wrong(token),
                         "send 'Authorization: Bearer $AJET_SWARM_APPROVER_TOKEN'",
                         headers=_CHALLENGE)


def require_reviewer(settings: Settings, token: str | None) -> str:
    """Control token (or an open server) or an approver: `control`, `open` or
    `approver:<name>`. For reading code to review: manifests and file contents."""
    name = approver_of(settings, token)
    if name is not None:
        return APPROVER_PREFIX + name
    return require_control(settings, token)


def authenticate(settings: Settings, headers: Headers) -> str:
    """The first gate (`swarm_server.limits`, before routing): some credential is valid.

    Every path but the open ones, the console's and the episode plane's needs at least
    this, so an anonymous caller learns nothing (401, never 404 or 422). A new bearer
    credential must be accepted here too.
    """
    token = bearer_token(headers.get("authorization"))
    name = approver_of(settings, token)
    if name is not None:  # the approval routes' own requirement decides the rest
        return APPROVER_PREFIX + name
    return require_reader(settings, token)


def _token(headers: Headers) -> str | None:
    return bearer_token(headers.get("authorization"))


@dataclass(frozen=True)
class Requirement:
    """A route's access rule: a FastAPI dependency that `swarm_server.limits` also reads.

    Subclasses implement `check` from the app's state (`state.ctx` is the
    `ServerContext`) and the request headers alone, no body and no route parameters,
    because the middleware calls it before the body is read.
    """

    #: What the rule admits, for docs and the access walk (`tests/security`).
    access: str

    def check(self, state: State, headers: Headers) -> Any:
        """The caller's role (or identity), or raise 401/403."""
        raise NotImplementedError

    def check_request(self, scope: Scope, state: State, headers: Headers) -> Any:
        """`check` for one request; a requirement the first gate already proved for this
        request reads the proof from the scope instead of checking again."""
        return self.check(state, headers)

    # `async`: FastAPI runs a plain `def` dependency in its thread pool, a hop that costs
    # about a millisecond on the episode plane's hot path. The `authorization` parameter
    # only documents the header in the OpenAPI schema; `check` reads the headers itself.
    async def __call__(self, request: Request,
                       authorization: Annotated[str | None, Header()] = None) -> Any:
        return self.check_request(request.scope, request.app.state, request.headers)


@dataclass(frozen=True)
class ControlRequirement(Requirement):
    """Code, config, engine lifecycle, audit: the control token only."""

    access: str = "control"

    def check(self, state: State, headers: Headers) -> Role:
        return require_control(state.ctx.settings, _token(headers))


@dataclass(frozen=True)
class ReaderRequirement(Requirement):
    """Read-only routes and the episode plane: the worker or the control token."""

    access: str = "reader"

    def check(self, state: State, headers: Headers) -> Role:
        return require_reader(state.ctx.settings, _token(headers))

    def check_request(self, scope: Scope, state: State, headers: Headers) -> Role:
        # the first gate's `authenticate` is `require_reader` for every token but an
        # approver's: a reader role it found is this requirement, proven
        found = scope.get(CREDENTIAL_SCOPE)
        if found in _READER_ROLES:
            return found  # type: ignore[no-any-return]
        return self.check(state, headers)


@dataclass(frozen=True)
class IndexRequirement(Requirement):
    """The server's index (`GET /`): a reader token, or the key of a live episode, because
    harnesses given only a base URL and an API key (Claude Code) probe the root first."""

    access: str = "reader or episode key"

    def check(self, state: State, headers: Headers) -> str:
        try:
            return require_reader(state.ctx.settings, _token(headers))
        except SwarmAuthError as exc:
            if exc.status != 401:
                raise
            state.ctx.episodes.check_key(episode_key(headers))
            return "episode"


@dataclass(frozen=True)
class ApproverRequirement(Requirement):
    """Approve, deny, revoke: a named approver token only; `check` returns the name."""

    access: str = "approver"

    def check(self, state: State, headers: Headers) -> str:
        return require_approver(state.ctx.settings, _token(headers))


@dataclass(frozen=True)
class ReviewerRequirement(Requirement):
    """Code to review: the control token or an approver's (`approver:<name>`)."""

    access: str = "reviewer"

    def check(self, state: State, headers: Headers) -> str:
        return require_reviewer(state.ctx.settings, _token(headers))


@dataclass(frozen=True)
class EpisodeKeyRequirement(Requirement):
    """The OpenAI- and Anthropic-compatible routes (`/v1/*`): the signed key of a live
    episode, sent as the API key (`episode_key`, `EpisodeGateway.check_key`); `check`
    returns the episode id.

    The first gate verifies it before routing, for every `/v1/` path, and leaves the
    episode id under `EPISODE_SCOPE`; `check_request` takes it from there.
    """

    access: str = "episode key"

    def check(self, state: State, headers: Headers) -> str:
        episode: str = state.ctx.episodes.check_key(episode_key(headers))
        return episode

    def check_request(self, scope: Scope, state: State, headers: Headers) -> str:
        verified = scope.get(EPISODE_SCOPE)
        return verified if isinstance(verified, str) else self.check(state, headers)

    # both headers a key may come in, for the OpenAPI schema (`check` reads them itself)
    async def __call__(self, request: Request,  # type: ignore[override]
                       authorization: Annotated[str | None, Header()] = None,
                       x_api_key: Annotated[str | None, Header()] = None) -> Any:
        return self.check_request(request.scope, request.app.state, request.headers)
