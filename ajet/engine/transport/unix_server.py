"""The private channel's transport: uvicorn on a Unix socket, in a background thread.

The socket is bound here (stale file removed first), made 0600 before it listens, and
handed to uvicorn, so no other local user can connect even for a moment. uvicorn runs
outside the main thread, which therefore keeps the SIGTERM handler (the trainer's).

`tcp_host` binds a TCP port instead (a free one on that address): ranks on other nodes
serve their generator to rank 0 that way (`ranks.py`), behind a bearer token, and so
does rank 0's own channel when the swarm server is on another machine (the Ray launcher):
`BearerGuard` wraps the app and answers 401 to any request without the token.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from typing import Any

import uvicorn
from fastapi import FastAPI

from ajet.coalesced_writes import CoalescedWrites

__all__ = ["BearerGuard", "ChannelServer"]

log = logging.getLogger(__name__)

#: AF_UNIX paths are limited to 108 bytes on Linux, 104 on macOS (docs/internals.md: 100).
MAX_SOCKET_PATH = 100


class BearerGuard:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <token>`.

    Checked before the app sees the request (so before any body is read), in constant
    time; a refusal is `{"detail", "hint"}` with 401, the private channel's error shape.
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode("latin-1")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                body = json.dumps({"detail": "the engine's channel answers its swarm server "
                                             "only", "hint": "send the run's bearer token"}
                                  ).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _http_protocol() -> Any:
    """uvicorn's httptools protocol writing each response in one piece
    (`ajet.coalesced_writes`); uvicorn's choice ("auto") where httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.transport = CoalescedWrites(transport, self.loop)

    return CoalescingHttpToolsProtocol


class ChannelServer:
    def __init__(self, app: Any, socket_path: Path | None = None, *,
                 tcp_host: str | None = None) -> None:
        if (socket_path is None) == (tcp_host is None):
            raise ValueError("pass a socket path or a TCP host, not both")
        if socket_path is not None and len(os.fsencode(str(socket_path))) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path is longer than {MAX_SOCKET_PATH} bytes: {socket_path}")
        self.socket_path = socket_path
        self.tcp_host = tcp_host
        #: (host, port) once started on TCP
        self.tcp_address: tuple[str, int] | None = None
        # no `date` or `server` header: the peer (the swarm server, another rank) parses
        # every reply on the episode plane's hot path and reads neither
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=5, server_header=False,
                                date_header=False, http=_http_protocol())
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, *, timeout: float = 30.0) -> None:
        if self.tcp_host is not None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((self.tcp_host, 0))
            self.tcp_address = sock.getsockname()[:2]
            path = f"{self.tcp_address[0]}:{self.tcp_address[1]}"
        else:
            path = str(self.socket_path)
            if os.path.lexists(path):
                os.unlink(path)  # a stale socket from a killed engine
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, 0o600)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="ajet-channel", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the private channel on {path} failed to start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the private channel on {path} did not start in {timeout}s")
            time.sleep(0.01)
        log.info("private channel listening on %s", path)

    def stop(self, *, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
