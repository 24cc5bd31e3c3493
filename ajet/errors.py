"""Exceptions raised by the AgentJet client side.

    SwarmError                       base of everything below
    ├── SwarmConnectionError         server unreachable, or a request timed out
    ├── SwarmTimeout                 a bounded wait (e.g. for ENGINE.ROLLING) ran past its deadline
    ├── SwarmServerOfflineError      the engine went ENGINE.OFFLINE while a call waited for it
    │                                (the original AgentJet name; carries the server's last_error)
    ├── SwarmStateError              an original-surface call found the engine in the wrong
    │                                state (also a RuntimeError, which the original raises)
    ├── PackagingError               the local tree cannot be packaged (not git, symlink, too big)
    └── SwarmHTTPError               the server answered with an error status
        ├── SwarmAuthError           401 / 403: token missing, wrong, or lacks the role
        ├── SwarmNotFound            404: unknown run, snapshot, episode or blob
        ├── EngineStateConflict      409: the engine is in the wrong state for this call
        │   └── ApprovalPending      409: the code is not approved by an approver (detail
        │                            has snapshot_id, approval_state, approve_with)
        ├── PayloadTooLarge          413: an upload passed a server limit
        └── SwarmValidationError     400 / 422: bad input; `detail` names the field

Every `SwarmHTTPError` carries the server's `detail` and `hint` (what to call next).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ApprovalPending",
    "EngineStateConflict",
    "PackagingError",
    "PayloadTooLarge",
    "SwarmAuthError",
    "SwarmConnectionError",
    "SwarmError",
    "SwarmHTTPError",
    "SwarmNotFound",
    "SwarmServerOfflineError",
    "SwarmStateError",
    "SwarmTimeout",
    "SwarmValidationError",
    "error_for_status",
]


class SwarmError(Exception):
    """Base class of every AgentJet client error."""


class SwarmConnectionError(SwarmError):
    """The swarm server could not be reached or did not answer in time."""


class SwarmTimeout(SwarmError):
    """A bounded wait ran past its deadline; the message says what was awaited."""


class SwarmServerOfflineError(SwarmError):
    """The engine went ENGINE.OFFLINE (a failed boot, a crash, a stop) while a call waited.

    The original AgentJet client raises an exception of this name from `begin_episode`,
    `start_engine` and friends; the message carries the server's `last_error`.
    """


class SwarmStateError(SwarmError, RuntimeError):
    """The engine's state does not allow this call (`start_engine` while not OFFLINE, ...).

    Also a `RuntimeError`, which the original AgentJet client raises in these cases.
    """


class PackagingError(SwarmError):
    """The local `ajet/` tree cannot be packaged; nothing was uploaded."""


class SwarmHTTPError(SwarmError):
    """The server answered with an error status."""

    def __init__(self, status: int, detail: Any, hint: str = "", *, method: str = "",
                 path: str = "") -> None:
        self.status = status
        self.detail = detail
        self.hint = hint
        self.method = method
        self.path = path
        where = f"{method} {path} -> " if method else ""
        text = f"{where}{status}: {detail}"
        if hint:
            text += f" (hint: {hint})"
        super().__init__(text)


class SwarmAuthError(SwarmHTTPError):
    """401/403: set AJET_SWARM_TOKEN (control) or AJET_SWARM_WORKER_TOKEN (episodes)."""


class SwarmNotFound(SwarmHTTPError):
    """404: the id does not exist on this server."""


class EngineStateConflict(SwarmHTTPError):
    """409: the engine's state does not allow this call now."""


class ApprovalPending(EngineStateConflict):
    """409: the snapshot is pending (or was denied or revoked) on a server that enforces
    approvals; an approver decides with their own token, never this client."""

    @property
    def snapshot_id(self) -> str:
        return str(self.detail.get("snapshot_id", "")) if isinstance(self.detail, dict) else ""

    @property
    def approval_state(self) -> str:
        return str(self.detail.get("approval_state", "")) if isinstance(self.detail, dict) \
            else ""


class PayloadTooLarge(SwarmHTTPError):
    """413: an upload passed one of the server's limits."""


class SwarmValidationError(SwarmHTTPError):
    """400/422: the request was malformed or a field is invalid."""


_BY_STATUS: dict[int, type[SwarmHTTPError]] = {
    400: SwarmValidationError,
    401: SwarmAuthError,
    403: SwarmAuthError,
    404: SwarmNotFound,
    409: EngineStateConflict,
    413: PayloadTooLarge,
    422: SwarmValidationError,
}


def error_for_status(status: int, detail: Any, hint: str = "", *, method: str = "",
                     path: str = "") -> SwarmHTTPError:
    """The most specific `SwarmHTTPError` subclass for an HTTP status."""
    cls = _BY_STATUS.get(status, SwarmHTTPError)
    if status == 409 and isinstance(detail, dict) and "approval_state" in detail:
        cls = ApprovalPending
    return cls(status, detail, hint, method=method, path=path)
