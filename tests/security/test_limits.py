"""swarm_server.limits against a real server: auth before the body, size, depth, header
and idle caps on every input, the upload routes streaming under their own caps.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm_server.limits import json_too_deep
from tests.support import CONTROL_TOKEN, WORKER_TOKEN
from tests.support.factory import Server, ServerFactory
from tests.support.hostile import blob_record

MAX_JSON = 4096
MAX_DEPTH = 8
MAX_HEADERS = 8192
BODY_TIMEOUT_S = 1.0
HEADER_TIMEOUT_S = 1.0
CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
WRK = {"Authorization": f"Bearer {WORKER_TOKEN}"}


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    # a real process: the limits hold on real sockets (slow bodies, trickled headers)
    return server_factory(process=True, env={
        "AJET_SWARM_TOKEN": CONTROL_TOKEN, "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN,
        "AJET_SWARM_MAX_JSON_BYTES": str(MAX_JSON),
        "AJET_SWARM_MAX_JSON_DEPTH": str(MAX_DEPTH),
        "AJET_SWARM_MAX_HEADER_BYTES": str(MAX_HEADERS),
        "AJET_SWARM_REQUEST_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "AJET_SWARM_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    })


def post_routes(url: str) -> list[str]:
    schema = httpx.get(f"{url}/openapi.json", headers=CTL).json()
    return [p for p, ops in schema["paths"].items() if "post" in ops]


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


# ---------------------------------------------------------------------------- auth first


def test_auth_is_checked_before_the_body_is_parsed(srv: Server) -> None:
    routes = post_routes(srv.url)
    assert {"/sync_train_config", "/end_episode", "/code/commit"} <= set(routes)
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for path in routes:
            if path == "/v1/chat/completions":
                continue  # episode key, checked in the route (tests/security/test_episode_keys)
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = http.post(path, content=b"{not json", headers={
                    **headers, "Content-Type": "application/json"})
                assert r.status_code == 401, (path, r.text)
                assert r.headers["www-authenticate"] == "Bearer" and r.json()["hint"]
        # the worker token on a control route: 403, also before the body is parsed
        r = http.post("/sync_train_config", content=b"{not json", headers=WRK)
        assert r.status_code == 403 and "control token" in r.json()["detail"]
        # with the right token the same body reaches the parser
        r = http.post("/sync_train_config", content=b"{not json",
                      headers={**CTL, "Content-Type": "application/json"})
        assert r.status_code == 422


def test_docs_and_schema_need_a_token_health_does_not(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect",
                     "/no/such/route"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Bearer x"}).status_code == 401
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path, headers=WRK).status_code == 200, path
        assert http.get("/no/such/route", headers=WRK).status_code == 404
        assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------- body size


def test_json_body_over_the_cap_is_413_declared_or_streamed(srv: Server) -> None:
    too_big = json.dumps({"yaml": "x" * MAX_JSON}).encode()
    with httpx.Client(base_url=srv.url, headers=CTL, timeout=30) as http:
        declared = http.post("/sync_train_config", content=too_big)
        assert declared.status_code == 413, declared.text
        assert "AJET_SWARM_MAX_JSON_BYTES" in declared.json()["hint"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
            for i in range(0, len(too_big), 1000):
                yield too_big[i:i + 1000]

        streamed = http.post("/sync_train_config", content=chunks())
        assert streamed.status_code == 413, streamed.text
        # just under the cap reaches the route (a YAML that is not a job: 422)
        fits = json.dumps({"yaml": "x" * (MAX_JSON - 100)}).encode()
        assert len(fits) <= MAX_JSON
        assert http.post("/sync_train_config", content=fits).status_code == 422


def test_upload_routes_stream_past_the_json_cap(srv: Server) -> None:
    data = b"# a module bigger than a JSON body may be\n" * (3 * MAX_JSON // 40)
    body = blob_record(data)
    assert len(body) > 2 * MAX_JSON
    r = httpx.post(f"{srv.url}/code/blobs", content=body, headers=CTL, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["bytes_received"] == len(body)


# ---------------------------------------------------------------------------- depth


def test_json_nested_past_the_depth_cap_is_400(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        deep = {"episode_uuid": "e", "task_id": "t", "reward": 1.0,
                "metadata": nested(MAX_DEPTH)}  # MAX_DEPTH + 1 levels with the outer object
        r = http.post("/end_episode", json=deep, headers=WRK)
        assert r.status_code == 400 and "deeper than 8" in r.json()["detail"], r.text
        ok = {**deep, "metadata": nested(MAX_DEPTH - 1)}
        # past the caps: the gateway answers (no engine runs: 409)
        assert http.post("/end_episode", json=ok, headers=WRK).status_code == 409


@settings(max_examples=200, deadline=None, database=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet="[]{}\"\\ab,:"),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(alphabet="[]{}\"ab", max_size=3), inner, max_size=3),
                    max_leaves=30),
       st.integers(min_value=1, max_value=6))
def test_json_depth_check_agrees_with_a_parser(value: Any, limit: int) -> None:
    def depth(v: Any) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    for text in (json.dumps(value), json.dumps(value, indent=1, ensure_ascii=False)):
        assert json_too_deep(text.encode(), limit) == (depth(value) > limit), text


# ---------------------------------------------------------------------------- headers, idle


def test_oversized_headers_are_refused(srv: Server) -> None:
    r = httpx.get(f"{srv.url}/get_engine_status", timeout=30,
                  headers={**WRK, **{f"X-Pad-{i}": "p" * 900 for i in range(10)}})
    assert r.status_code in (400, 431), r.text  # middleware 431, or uvicorn's parser first
    assert httpx.get(f"{srv.url}/get_engine_status", headers=WRK).status_code == 200


def _stall(port: int, path: str, token: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"a\":".encode())
        s.settimeout(BODY_TIMEOUT_S + 20)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def test_a_stalled_body_is_dropped(srv: Server) -> None:
    reply = _stall(srv.port, "/sync_train_config", CONTROL_TOKEN)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    # an upload route: the stall reads as an interrupted upload, its temp files go
    reply = _stall(srv.port, "/code/blobs", CONTROL_TOKEN)
    assert reply.startswith(b"HTTP/1.1 400") and b"interrupted" in reply, reply[:300]
    incoming = Path(srv.workdir) / "ajet_temp" / ".incoming"
    assert not incoming.exists() or not any(incoming.iterdir())


def _closed_by_server(s: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing `s` (within `within` s), or None if still open."""
    s.settimeout(within)
    reply = b""
    try:
        while chunk := s.recv(65536):
            reply += chunk
    except socket.timeout:
        return None
    return reply


def test_connections_that_never_finish_their_headers_are_closed(srv: Server) -> None:
    silent, partial = [], []
    try:
        for _ in range(25):
            silent.append(socket.create_connection(("127.0.0.1", srv.port), timeout=30))
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            partial.append(s)
        # meanwhile the server answers everyone else
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        t0 = time.monotonic()
        for s in silent:  # nothing sent: closed without a word
            assert _closed_by_server(s, HEADER_TIMEOUT_S + 10) == b""
        for s in partial:  # half a request: told why
            reply = _closed_by_server(s, HEADER_TIMEOUT_S + 10)
            assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
            assert b"AJET_SWARM_HEADER_TIMEOUT_S" in reply
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 10
    finally:
        for s in silent + partial:
            s.close()


def test_trickled_headers_do_not_extend_the_deadline(srv: Server) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        closed = False
        for _ in range(int(4 * HEADER_TIMEOUT_S / 0.2)):  # a byte every 0.2 s for 4x the limit
            try:
                s.sendall(b"X")
            except OSError:
                closed = True
                break
            if _closed_by_server(s, 0.2) is not None:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 4 * HEADER_TIMEOUT_S


def test_keep_alive_requests_are_not_cut_by_the_header_timer(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, headers=WRK, timeout=30) as http:
        for _ in range(2):  # one connection, requests spaced past the header timeout
            assert http.get("/get_engine_status").status_code == 200
            time.sleep(HEADER_TIMEOUT_S * 1.3)


def test_a_head_growing_past_the_header_bound_is_431_before_it_ends(srv: Server) -> None:
    # httptools (the default parser) has no bound of its own on an unfinished head:
    # http_protocol counts its bytes; the header timer alone would let it grow for 1 s
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        t0 = time.monotonic()
        s.sendall(b"p" * (MAX_HEADERS + 1024))  # and no end of the header
        reply = _closed_by_server(s, HEADER_TIMEOUT_S + 10)
        assert reply is not None and reply.startswith(b"HTTP/1.1 431"), reply
        assert b"AJET_SWARM_MAX_HEADER_BYTES" in reply
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S  # the bound, not the timer
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def test_the_server_parses_with_httptools_unless_told_h11() -> None:
    from swarm_server.http_protocol import (
        HeaderTimeoutProtocol,
        HttpToolsHeaderTimeoutProtocol,
        with_header_timeout,
    )

    chosen = with_header_timeout(2.0, max_header_bytes=1234)
    assert issubclass(chosen, HttpToolsHeaderTimeoutProtocol)
    assert (chosen.header_timeout_s, chosen.max_header_bytes) == (2.0, 1234)
    assert issubclass(with_header_timeout(2.0, parser="h11"), HeaderTimeoutProtocol)


def test_the_episode_planes_calls_are_not_access_logged(srv: Server) -> None:
    # one line per call of every rollout worker would flood the log; refusals are answered
    assert httpx.post(f"{srv.url}/begin_episode", json={}, headers=WRK).status_code == 409
    assert httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": []},
                      headers={"Authorization": "Bearer ajep_forged"}).status_code == 401
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    deadline = time.monotonic() + 5
    while '"GET /health HTTP/1.1" 200' not in srv.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = srv.log()
    assert '"GET /health HTTP/1.1" 200' in log  # every other path is
    assert '"POST /begin_episode HTTP/1.1"' not in log
    assert '"POST /v1/chat/completions HTTP/1.1"' not in log


# ---------------------------------------------------------------------------- anonymous


def _sign_in_head(extra: str = "", length: int = 20) -> bytes:
    return ("POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/x-www-form-urlencoded\r\nContent-Length: {length}\r\n{extra}\r\n"
            ).encode()


def test_no_100_continue_before_a_sign_in_may_proceed(srv: ServerHandle) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(_sign_in_head("Expect: 100-continue\r\nOrigin: http://evil.example\r\n"))
        reply = _closed_by_server(s, 10) or b""
    assert reply.startswith(b"HTTP/1.1 403") and b"100 Continue" not in reply, reply[:200]
    # from the console itself: 100 Continue, then the form is read and judged
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(_sign_in_head("Expect: 100-continue\r\nConnection: close\r\n"))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(b"token=wrong-token-xx")
        reply = _closed_by_server(s, 10) or b""
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


def test_an_anonymous_body_is_small_and_on_time(srv: ServerHandle) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(_sign_in_head(length=15 << 20) + b"token=")
        reply = _closed_by_server(s, 10) or b""
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # one byte at a time: dropped at the header deadline, not at the idle timeout per byte
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(_sign_in_head(length=200))
        reply = None
        while reply is None and time.monotonic() - t0 < 15:
            try:
                s.sendall(b"t")
            except OSError:
                break
            reply = _closed_by_server(s, 0.3)
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 5
    assert reply is None or reply.startswith(b"HTTP/1.1 408"), reply[:200]
