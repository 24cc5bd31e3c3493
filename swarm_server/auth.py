"""Bearer-token roles: `control` (everything but approving), `worker` (episodes and
read-only routes) and named `approver`s (the approval routes, and the server-side review).

With no token configured the server is open (it then only binds loopback; see
`Settings`). Tokens are compared in constant time. An approver token opens only the
approval routes and the code-review routes; the control token never approves
(DESIGN.md point 8). Episode API keys for `/v1/chat/completions` are a separate
mechanism (`swarm_server.episode_keys`).
"""

from __future__ import annotations

import hmac
from typing import Literal

from swarm_server.errors import Forbidden, Unauthorized
from swarm_server.settings import Settings

__all__ = ["APPROVER_PREFIX", "Role", "approver_of", "bearer_token", "require_approver",
           "require_control", "require_reader", "require_reviewer", "role_of"]

Role = Literal["control", "worker", "open"]

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
#: Audit-log role of an approver: `approver:<name>`.
APPROVER_PREFIX = "approver:"


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
    _refuse_approver(settings, token)
    raise Unauthorized(_missing_or_wrong(token), "send 'Authorization: Bearer $AJET_SWARM_TOKEN'",
                       headers=_CHALLENGE)


def require_reader(settings: Settings, token: str | None) -> Role:
    role = role_of(settings, token)
    if role is not None:
        return role
    _refuse_approver(settings, token)
    raise Unauthorized(
        _missing_or_wrong(token),
        "send 'Authorization: Bearer <token>' with AJET_SWARM_TOKEN or AJET_SWARM_WORKER_TOKEN",
        headers=_CHALLENGE,
    )


def _refuse_approver(settings: Settings, token: str | None) -> None:
    if approver_of(settings, token) is not None:
        raise Forbidden("an approver token opens only the approval routes (/approvals) and "
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
            raise Forbidden("approvals are not enforced on this server: it has no approver "
                            "tokens", "set AJET_SWARM_APPROVER_TOKENS (name=token,...) on the "
                                      "server to make every snapshot need an approver")
        raise Forbidden(f"the {role} token cannot approve; approval routes take an approver "
                        "token only", "an approver uses their own token "
                                      "(AJET_SWARM_APPROVER_TOKEN) or the web console")
    raise Unauthorized(_missing_or_wrong(token),
                       "send 'Authorization: Bearer $AJET_SWARM_APPROVER_TOKEN'",
                       headers=_CHALLENGE)


def require_reviewer(settings: Settings, token: str | None) -> str:
    """Control token (or an open server) or an approver: `control`, `open` or
    `approver:<name>`. For reading code to review: manifests and file contents."""
    name = approver_of(settings, token)
    if name is not None:
        return APPROVER_PREFIX + name
    return require_control(settings, token)
