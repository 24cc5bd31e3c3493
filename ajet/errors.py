"""Errors of AgentJet, on the wire and on the client side.

One type, `SwarmHTTPError(status, detail, hint, *, param, retry_after_s, headers)`, is an
HTTP error wherever it is: the swarm server's routes and the engine's private routes
raise it, `error_response` renders it on both (one body shape), and the client raises
it again from the answer (`error_for_status`), so the class a handler raises is the
class a caller catches. The tree:

    SwarmError                       base of everything below
    ├── SwarmConnectionError         server unreachable, or a request timed out
    ├── SwarmTimeout                 a bounded wait (e.g. for ENGINE.ROLLING) ran past its deadline
    ├── SwarmServerOfflineError      the engine went ENGINE.OFFLINE while a call waited for it
    │                                (the original AgentJet name; carries the server's last_error)
    ├── SwarmStateError              an original-surface call found the engine in the wrong
    │                                state (also a RuntimeError, which the original raises)
    ├── PackagingError               the local tree cannot be packaged (not git, symlink, too big)
    └── SwarmHTTPError               an HTTP error status (any; 408, 431, 5xx have no subclass)
        ├── SwarmAuthError           401 / 403: token or episode key missing, wrong, or lacks
        │                            the role; an episode owned by another client
        ├── SwarmNotFound            404: unknown run, snapshot, episode, blob or model
        ├── EngineStateConflict      409: the engine's (or the episode's) state does not allow
        │   │                        the call now: not ROLLING, episode ended, no free slot
        │   └── ApprovalPending      409: the code is not approved by an approver (detail
        │                            has snapshot_id, approval_state, approve_with)
        ├── PayloadTooLarge          413: a body or an upload passed a limit
        └── SwarmValidationError     400 / 422: bad input; `detail` or `param` names the field

The body of every error is `{"detail", "hint"}`, plus `param` (the request field at
fault) where one is named; the OpenAI-compatible routes (`/v1/*`) add OpenAI's
`{"error": {"message", "type", "param", "code"}}` (`openai_error_body`), Anthropic's
Messages routes answer `{"type": "error", "error": {"type", "message"}}` next to them
(`anthropic_error_body`). `retry_after_s`
becomes a `Retry-After` header. `hint` always says what to call next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the laptop side never imports starlette: see `error_response`
    from starlette.responses import JSONResponse

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
    "anthropic_error_body",
    "error_body",
    "error_for_status",
    "error_headers",
    "error_response",
    "openai_error_body",
    "validation_error",
]


class SwarmError(Exception):
    """Base class of every AgentJet error."""


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
    """An HTTP error: raised by a route with what to answer, or by the client from the answer.

    `detail` is what happened (a string, or a structure such as validation errors),
    `hint` what to call next, `param` the request field at fault (OpenAI's `error.param`),
    `retry_after_s` when a retry may succeed, `headers` any other response header (a
    `WWW-Authenticate` challenge). `method` and `path` are the client's request.
    """

    def __init__(self, status: int, detail: Any, hint: str = "", *, param: str | None = None,
                 retry_after_s: float | None = None, headers: Mapping[str, str] | None = None,
                 method: str = "", path: str = "") -> None:
        self.status = status
        self.detail = detail
        self.hint = hint
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = dict(headers) if headers else None
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
    """409: the engine's state (or the episode's) does not allow this call now."""


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
    """413: a body or an upload passed one of the limits."""


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


def error_for_status(status: int, detail: Any, hint: str = "", *, param: str | None = None,
                     retry_after_s: float | None = None,
                     headers: Mapping[str, str] | None = None, method: str = "",
                     path: str = "") -> SwarmHTTPError:
    """The most specific `SwarmHTTPError` subclass for an HTTP status."""
    cls = _BY_STATUS.get(status, SwarmHTTPError)
    if status == 409 and isinstance(detail, dict) and "approval_state" in detail:
        cls = ApprovalPending
    return cls(status, detail, hint, param=param, retry_after_s=retry_after_s, headers=headers,
               method=method, path=path)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> SwarmValidationError:
    """422 for request validation errors (pydantic's, `loc` starting with `body` ...):
    `detail` lists them, `param` is the first field, the hint names them all."""
    detail = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""),
               "type": e.get("type", "")} for e in errors]
    fields = [".".join(e["loc"][1:] or e["loc"]) for e in detail]
    return SwarmValidationError(
        422, detail, f"fix the field(s): {', '.join(fields)}; see /docs for the schema",
        param=fields[0] if fields else None)


# ---------------------------------------------------------------------------- rendering

#: OpenAI's `error.type` per status.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                 409: "conflict_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 431: "invalid_request_error"}


def error_body(exc: SwarmHTTPError, *, openai: bool = False, anthropic: bool = False
               ) -> dict[str, Any]:
    """The JSON body for `exc`: `{"detail", "hint"}`, `param` when set; with `openai`,
    OpenAI's `error` object as well (the `/v1/*` routes); with `anthropic`, Anthropic's
    (the Messages routes)."""
    if anthropic:
        return anthropic_error_body(exc.status, exc.detail, exc.hint, param=exc.param)
    if openai:
        return openai_error_body(exc.status, exc.detail, exc.hint, param=exc.param)
    body: dict[str, Any] = {"detail": exc.detail, "hint": exc.hint}
    if exc.param is not None:
        body["param"] = exc.param
    return body


def openai_error_body(status: int, detail: Any, hint: str = "", *, param: str | None = None
                      ) -> dict[str, Any]:
    """`{"detail", "hint"}` plus OpenAI's `error` object, the hint in its message,
    so that an OpenAI client's exception says what happened and what to do."""
    text = detail if isinstance(detail, str) else _detail_text(detail)
    message = f"{text} (hint: {hint})" if hint else text
    return {"detail": detail, "hint": hint,
            "error": {"message": message,
                      "type": _OPENAI_TYPES.get(status, "api_error" if status >= 500
                                                else "invalid_request_error"),
                      "param": param, "code": status}}


#: Anthropic's `error.type` per status (its SDK raises by status; the type is for logs).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, detail: Any, hint: str = "", *,
                         param: str | None = None) -> dict[str, Any]:
    """`{"detail", "hint", "param"}` plus Anthropic's error, for the Messages routes."""
    text = detail if isinstance(detail, str) else _detail_text(detail)
    return {"type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                   else "invalid_request_error"),
                      "message": f"{text} (hint: {hint})" if hint else text},
            "detail": detail, "hint": hint, "param": param}


def _detail_text(detail: Any) -> str:
    # a validation detail is a list of {"loc", "msg"}: name each field
    if isinstance(detail, list):
        parts = [f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg', '')}"
                 for e in detail if isinstance(e, dict)]
        if parts:
            return "; ".join(parts)
    return str(detail)


def error_headers(exc: SwarmHTTPError) -> dict[str, str] | None:
    """`exc.headers`, with `Retry-After` (whole seconds, at least 1) when it sets a delay."""
    if exc.retry_after_s is None:
        return exc.headers
    return {**(exc.headers or {}), "Retry-After": str(max(1, round(exc.retry_after_s)))}


def error_response(exc: SwarmHTTPError, *, openai: bool = False, anthropic: bool = False
                   ) -> JSONResponse:
    """The response for `exc`, on the swarm server and in the engine alike.

    Imports starlette when called: only the server and the engine (which both have it)
    render errors, and the client side stays free of it.
    """
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(exc, openai=openai, anthropic=anthropic),
                        status_code=exc.status, headers=error_headers(exc))
