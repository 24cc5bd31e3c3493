"""Console sign-in sessions: a random id in an HttpOnly, SameSite=Strict cookie.

A session is made when someone signs in at `/ui/login` with an approver token (it can
approve; the approver's name is what decisions record) or the control token (it can look,
not approve). The token itself is never stored or put in a URL: the session keeps only
the role, the name, a CSRF token for its forms, and when it expires. Sessions live in
this process (a server restart signs everyone out) and expire after
`Settings.ui_session_ttl_s`; signing out drops one at once.

Memory is bounded per kind of session: control-token sessions make room by dropping the
oldest control session, an approver's sessions by dropping that approver's oldest, so no
number of sign-ins with one token ever signs anyone else out. Notices shown on a page
("decision recorded") are kept here, per session, never read from a URL a third party
could have written.

`SignInThrottle` bounds sign-in attempts per source address and overall.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["COOKIE", "ConsoleSession", "Notice", "NoticeKind", "SessionStore", "SignInThrottle"]

#: The session cookie's name (path /ui only).
COOKIE = "ajet_console"
#: Live sessions kept per role: control sessions all together, approvers each.
_MAX_CONTROL_SESSIONS = 200
_MAX_SESSIONS_PER_APPROVER = 50
_MAX_NOTICES = 20


#: How a notice reads: done as asked, done with a caveat, or not done.
NoticeKind = Literal["success", "warning", "error"]


@dataclass(frozen=True)
class Notice:
    """One message for a page, with its kind (the page styles each kind apart)."""
    kind: NoticeKind
    text: str


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
        self._notices: dict[str, dict[str, Notice]] = {}

    def create(self, role: Literal["approver", "control"], name: str) -> ConsoleSession:
        now = self._clock()
        session = ConsoleSession(sid=secrets.token_urlsafe(32), role=role, name=name,
                                 csrf=secrets.token_urlsafe(32), expires_at=now + self.ttl_s)
        with self._lock:
            self._drop_expired(now)
            # oldest out, among the same role and name only: bounded memory, and a flood of
            # control-token sign-ins never signs an approver out
            same = [s for s in self._sessions.values() if s.role == role and s.name == name]
            cap = _MAX_CONTROL_SESSIONS if role == "control" else _MAX_SESSIONS_PER_APPROVER
            if len(same) >= cap:
                self._forget(min(same, key=lambda s: s.expires_at).sid)
            self._sessions[session.sid] = session
        return session

    def notify(self, sid: str, key: str, text: str, kind: NoticeKind) -> None:
        """Keep a notice of `kind` for this session's next view of page `key`."""
        with self._lock:
            if sid not in self._sessions:
                return
            notices = self._notices.setdefault(sid, {})
            notices.pop(key, None)
            notices[key] = Notice(kind, text)
            while len(notices) > _MAX_NOTICES:
                notices.pop(next(iter(notices)))

    def take_notice(self, sid: str, key: str) -> Notice | None:
        """The notice kept for page `key`, once (it is gone after this)."""
        with self._lock:
            return self._notices.get(sid, {}).pop(key, None)

    def get(self, sid: str | None) -> ConsoleSession | None:
        if not sid:
            return None
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None and session.expires_at <= self._clock():
                self._forget(sid)
                return None
            return session

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._forget(sid or "")

    def _forget(self, sid: str) -> None:
        self._sessions.pop(sid, None)
        self._notices.pop(sid, None)

    def _drop_expired(self, now: float) -> None:
        for sid in [s.sid for s in self._sessions.values() if s.expires_at <= now]:
            self._forget(sid)


@dataclass
class _Window:
    started: float
    count: int = 0
    refused: int = 0


class SignInThrottle:
    """At most `per_source` sign-in attempts per source address and `overall` in all, per
    `window_s` seconds (fixed windows). A refusal says how long to wait.

    The sources tracked are bounded (`max_sources`, the stalest dropped first), so a
    caller with many addresses costs memory it cannot grow; the overall bound still
    holds for them.
    """

    def __init__(self, *, per_source: int = 10, overall: int = 100, window_s: float = 60.0,
                 max_sources: int = 10_000, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.per_source, self.overall, self.window_s = per_source, overall, window_s
        self._max_sources = max_sources
        self._clock = clock
        self._lock = threading.Lock()
        self._sources: dict[str, _Window] = {}
        self._all = _Window(started=clock())

    def attempt(self, source: str) -> tuple[float, bool]:
        """(seconds to wait, first refusal of this window); (0, False) = go ahead."""
        now = self._clock()
        with self._lock:
            if now - self._all.started >= self.window_s:
                self._all = _Window(started=now)
            window = self._sources.pop(source, None)
            if window is None or now - window.started >= self.window_s:
                window = _Window(started=now)
            self._sources[source] = window  # newest last: the stalest go first
            while len(self._sources) > self._max_sources:
                self._sources.pop(next(iter(self._sources)))
            for w, cap in ((window, self.per_source), (self._all, self.overall)):
                if w.count >= cap:
                    w.refused += 1
                    return max(0.1, w.started + self.window_s - now), w.refused == 1
            window.count += 1
            self._all.count += 1
            return 0.0, False
