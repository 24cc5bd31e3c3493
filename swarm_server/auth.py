"""Bearer-token roles: `control` (everything) and `worker` (episodes and read-only routes).

With no token configured the server is open (it then only binds loopback; see
`Settings`). Tokens are compared in constant time. Episode API keys for
`/v1/chat/completions` are a separate mechanism (`swarm_server.episode_keys`).
"""

from __future__ import annotations

import hmac
from typing import Literal

from swarm_server.errors import Forbidden, Unauthorized
from swarm_server.settings import Settings

__all__ = ["Role", "bearer_token", "require_control", "require_reader", "role_of"]

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


def _missing_or_wrong(token: str | None) -> str:
    return "missing bearer token" if token is None else "invalid token"
