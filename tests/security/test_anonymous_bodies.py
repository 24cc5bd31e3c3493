"""No anonymous body is buffered: every path a caller without a credential may reach
reads at most `ANONYMOUS_BODY_BYTES` of a body, under a deadline, and the sign-in's
checks (origin, throttle) run before the first byte is read (so before any
`100 Continue`, which the server sends at that first read). Sign-in: throttled per
source and overall, failures audited, a flood of control-token sign-ins signs no
approver out.

The walk drives the ASGI app directly with a `receive` that counts what it hands out,
so "how much was read" is exact; the socket-level cases (`100 Continue`, a trickled
body) are in `tests/security/test_limits.py`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from starlette.routing import Route

from swarm_server.auth import Requirement
from swarm_server.limits import ANONYMOUS_BODY_BYTES, OPEN_PATHS
from swarm_server.ui.sessions import SessionStore, SignInThrottle
from tests.security.inproc import InProc, inproc_server
from tests.support import APPROVER_TOKEN, CONTROL_TOKEN, WORKER_TOKEN

CHUNK = 1024


@pytest.fixture
def srv(tmp_path: Path) -> Any:
    with inproc_server(tmp_path / "swarm", header_timeout_s=1.0,
                       ui_sign_ins_per_source=1000) as s:
        yield s


def _needs_credential(route: Any) -> bool:
    found: list[Any] = []

    def walk(dependant: Any) -> None:
        for dep in getattr(dependant, "dependencies", []):
            found.append(dep.call)
            walk(dep)

    walk(getattr(route, "dependant", None))
    return any(isinstance(c, Requirement) for c in found)


def _flat(routes: Any) -> list[Any]:
    """Routes, with those of included routers (this FastAPI keeps them nested)."""
    out: list[Any] = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        out.extend(_flat(inner.routes) if inner is not None else [route])
    return out


def anonymous_paths(srv: InProc) -> list[tuple[str, str]]:
    """(method, path) of every route a caller without a credential reaches, plus an
    unknown console path; POST on each too (a body where none is expected)."""
    out: set[tuple[str, str]] = {("POST", "/ui/no-such-page"), ("PUT", "/ui/login")}
    for route in _flat(srv.app.routes):
        if not isinstance(route, (APIRoute, Route)):
            continue
        path = route.path
        console = path == "/ui" or path.startswith("/ui/")
        if not (console or path in OPEN_PATHS) or _needs_credential(route):
            continue
        concrete = path.replace("{", "").replace("}", "")
        for method in {*(route.methods or set()), "POST"}:
            out.add((method, concrete))
    return sorted(out)


def asgi(srv: InProc, method: str, path: str, *, body_bytes: int = 1 << 20,
         headers: dict[str, str] | None = None, delay_s: float = 0.0,
         chunk: int = CHUNK) -> tuple[int, int, int]:
    """(status, body bytes handed to the app, receive calls) of one request."""
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in {
        "host": "testserver", "content-type": "application/x-www-form-urlencoded",
        **(headers or {})}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": raw_headers,
             "client": ("203.0.113.7", 5000), "server": ("testserver", 80)}
    handed = [0, 0]
    status = [0]

    async def receive() -> dict[str, Any]:
        handed[1] += 1
        if delay_s:
            await asyncio.sleep(delay_s)
        if handed[0] >= body_bytes:
            await asyncio.sleep(3600)  # the client has nothing more to say
        n = min(chunk, body_bytes - handed[0])
        handed[0] += n
        return {"type": "http.request", "body": b"t" * n, "more_body": handed[0] < body_bytes}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]

    async def run() -> None:
        await asyncio.wait_for(srv.app(scope, receive, send), 30)

    asyncio.run(run())
    return status[0], handed[0], handed[1]


def test_every_anonymous_path_reads_at_most_a_few_kb(srv: InProc) -> None:
    paths = anonymous_paths(srv)
    assert ("POST", "/ui/login") in paths and ("GET", "/health") in paths
    for method, path in paths:
        status, read, _ = asgi(srv, method, path)
        assert status and status < 500, (method, path, status)
        assert read <= ANONYMOUS_BODY_BYTES + CHUNK, (method, path, read)
    # a declared length over the bound is refused without reading a byte
    status, read, calls = asgi(srv, "POST", "/ui/login",
                               headers={"content-length": str(15 << 20)})
    assert status == 413 and read == 0 and calls == 0


def test_an_anonymous_body_must_arrive_within_the_deadline(srv: InProc) -> None:
    t0 = time.monotonic()
    status, read, _ = asgi(srv, "POST", "/ui/login", body_bytes=3000, delay_s=0.2,
                               chunk=10)  # 10 bytes every 0.2 s
    assert status == 408 and time.monotonic() - t0 < 3.0 and read < 3000


def test_a_refused_sign_in_reads_nothing(srv: InProc) -> None:
    status, read, calls = asgi(srv, "POST", "/ui/login", headers={
        "origin": "http://evil.example"})
    assert status == 403 and read == 0 and calls == 0
    status, _, calls = asgi(srv, "POST", "/ui/login", headers={"sec-fetch-site": "cross-site"})
    assert status == 403 and calls == 0
    entries = srv.call("GET", "/audit", params={"limit": 1000}).json()["entries"]
    assert [e for e in entries if e["action"] == "console_sign_in"
            and "another origin" in e["outcome"]]


def test_sign_in_from_this_console_works(srv: InProc) -> None:
    r = srv.sign_in(APPROVER_TOKEN, origin="http://testserver", **{"sec-fetch-site": "same-origin"})
    assert r.status_code == 303 and "ajet_console" in r.headers["set-cookie"]
    bad = srv.sign_in(APPROVER_TOKEN, origin="https://evil.example")
    assert bad.status_code == 403 and "set-cookie" not in bad.headers
    # behind a TLS proxy: the browser's origin is the proxy's, which says so
    proxied = srv.sign_in(APPROVER_TOKEN, origin="https://cluster.example",
                          **{"x-forwarded-host": "cluster.example"})
    assert proxied.status_code == 303
    assert srv.sign_in(APPROVER_TOKEN, origin="https://testserver").status_code == 303
    # a browser's own word wins: same-site is not same-origin
    assert srv.sign_in(APPROVER_TOKEN, origin="http://testserver",
                       **{"sec-fetch-site": "same-site"}).status_code == 403


def test_sign_in_is_throttled_and_failures_are_audited(tmp_path: Path) -> None:
    with inproc_server(tmp_path / "swarm", ui_sign_ins_per_source=3) as srv:
        for _ in range(3):
            assert srv.sign_in("wrong-token-of-some-length").status_code == 401
        assert srv.sign_in(WORKER_TOKEN).status_code == 429  # even a real token waits
        limited = srv.sign_in(APPROVER_TOKEN)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        entries = srv.call("GET", "/audit", params={"limit": 1000}).json()["entries"]
    outcomes = [e["outcome"] for e in entries if e["action"] == "console_sign_in"]
    assert outcomes.count("refused: wrong token") == 3
    assert outcomes.count("refused: rate limited") == 1  # once per source and window
    assert all(e["detail"].get("source") for e in entries if e["action"] == "console_sign_in")


def test_the_throttle_bounds_each_source_and_all_together() -> None:
    now = [0.0]
    throttle = SignInThrottle(per_source=2, overall=3, window_s=60, clock=lambda: now[0])
    assert throttle.attempt("a") == (0.0, False) and throttle.attempt("a") == (0.0, False)
    wait, first = throttle.attempt("a")
    assert wait > 0 and first
    assert throttle.attempt("b")[0] == 0.0
    assert throttle.attempt("c")[0] > 0  # the overall bound, from a fresh source
    now[0] += 61
    assert throttle.attempt("a")[0] == 0.0


def test_control_sign_ins_never_sign_an_approver_out(srv: InProc) -> None:
    store: SessionStore = srv.app.state.console_sessions
    alice = store.create("approver", "alice")
    for _ in range(1000):
        store.create("control", "control")
    assert store.get(alice.sid) == alice
    # and through the form: the approver's cookie still opens the console
    assert srv.sign_in(APPROVER_TOKEN).status_code == 303
    cookie = srv.http.cookies.get("ajet_console")
    for _ in range(30):
        srv.sign_in(CONTROL_TOKEN)
    srv.http.cookies.clear()
    page = srv.http.get("/ui/approvals", follow_redirects=False,
                        headers={"cookie": f"ajet_console={cookie}"})
    assert page.status_code == 200 and '<b id="who">alice</b>' in page.text
