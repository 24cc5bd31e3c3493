"""Console sign-in sessions: a random id in an HttpOnly, SameSite=Strict cookie.

A session is made when someone signs in at `/ui/login` with an approver token (it can
approve; the approver's name is what decisions record) or the control token (it can look,
not approve). The token itself is never stored or put in a URL: the session keeps only
the role, the name, a CSRF token for its forms, and when it expires. Sessions live in
this process (a server restart signs everyone out) and expire after
`Settings.ui_session_ttl_s`; signing out drops one at once.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["COOKIE", "ConsoleSession", "SessionStore"]

#: The session cookie's name (path /ui only).
COOKIE = "ajet_console"
_MAX_SESSIONS = 1000


@dataclass(frozen=True)
class ConsoleSession:
    sid: str
    role: Literal["approver", "control"]
    name: str  # the approver's name, or "control"
    csrf: str
    expires_at: float

    @property
    def can_approve(self) -> bool:
        return self.role == "approver"

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())


class SessionStore:
    """Live console sessions of one server process."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, ConsoleSession] = {}

    def create(self, role: Literal["approver", "control"], name: str) -> ConsoleSession:
        now = self._clock()
        session = ConsoleSession(sid=secrets.token_urlsafe(32), role=role, name=name,
                                 csrf=secrets.token_urlsafe(32), expires_at=now + self.ttl_s)
        with self._lock:
            self._drop_expired(now)
            if len(self._sessions) >= _MAX_SESSIONS:  # oldest out: bounded memory
                oldest = min(self._sessions.values(), key=lambda s: s.expires_at)
                del self._sessions[oldest.sid]
            self._sessions[session.sid] = session
        return session

    def get(self, sid: str | None) -> ConsoleSession | None:
        if not sid:
            return None
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None and session.expires_at <= self._clock():
                del self._sessions[sid]
                return None
            return session

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._sessions.pop(sid or "", None)

    def _drop_expired(self, now: float) -> None:
        for sid in [s.sid for s in self._sessions.values() if s.expires_at <= now]:
            del self._sessions[sid]
