"""In-process swarm servers: `create_app(settings)` behind Starlette's `TestClient`.

Most server tests only call HTTP routes: for them the app runs in the test process (its
lifespan entered, so recovery, the engine controller and the episode gateway are live),
and requests go through `TestClient`'s transport instead of a socket. A server costs
milliseconds instead of a Python start-up and an import of the whole stack. The engine the
app starts is still a real subprocess (the fake engine or `python -m ajet.engine`).

What needs a real process stays on `tests.support.servers.start_server`: the command line,
signals, real sockets and their limits (slow clients, header timeouts), clients in other
processes (the MCP bridge over stdio, scripts), and crashes of the server itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette import testclient as starlette_testclient

from ajet.client import SwarmClient
from swarm_server.main import create_app
from swarm_server.settings import Settings

__all__ = ["AppServer", "app_server", "settings_from_env"]

#: the `httpx` module TestClient's transport speaks (Starlette prefers `httpx2`)
_TC_HTTPX: Any = starlette_testclient.httpx
#: the in-process app's URL (TestClient's): clients need a transport to reach it
APP_URL = "http://testserver"


@dataclass
class AppServer:
    """A swarm server app running in this process, and clients that reach it.

    `http` is a plain `httpx.Client` on the app (`srv.http.get("/health")`), `client()` a
    `SwarmClient`; both go through the transport of `test_client`, the `TestClient` that
    holds the app's lifespan and event loop. Timeouts are accepted and not applied.
    """

    settings: Settings
    app: FastAPI
    test_client: TestClient
    http: httpx.Client
    workdir: Path
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    url: str = APP_URL

    @property
    def transport(self) -> httpx.BaseTransport:
        """A transport into the app for one more client (closing that client is harmless)."""
        return _SharedTransport(self.test_client)

    def http_as(self, token: str | None) -> httpx.Client:
        """A new `httpx.Client` on the app that sends `token` as its bearer token
        (None: no token; each request may send its own)."""
        return httpx.Client(base_url=self.url, transport=self.transport, timeout=60.0,
                            headers={"Authorization": f"Bearer {token}"} if token else {})

    def client(self, token: str | None = None, **kwargs: Any) -> SwarmClient:
        """A `SwarmClient` on this app; `token` as SwarmClient takes it (None: from the
        environment, as `SwarmClient(url)` would)."""
        return SwarmClient(self.url, token=token, transport=self.transport, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")


class _SharedTransport(httpx.BaseTransport):
    """An `httpx` transport into the app, through the `TestClient`'s own transport.

    `TestClient` speaks the `httpx` flavour Starlette picked (`httpx2` where installed), so
    requests and responses are carried across here, bodies streamed. Its `close` does
    nothing: closing the inner transport would abort what still streams to other clients,
    so only the `TestClient` closes it, at the end. No cookies are kept here: each client
    keeps its own, as over a socket.
    """

    def __init__(self, test_client: TestClient) -> None:
        # TestClient keeps its ASGI transport on the client's private attribute; requests
        # of every client on it run on the app's event loop (TestClient's blocking portal)
        self._inner = test_client._transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        inner = self._inner.handle_request(_TC_HTTPX.Request(
            request.method, str(request.url), headers=request.headers.raw,
            content=request.read()))
        return httpx.Response(inner.status_code, headers=inner.headers.raw,
                              stream=_Body(inner), request=request)

    def close(self) -> None:
        pass


class _Body(httpx.SyncByteStream):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        yield from self._inner.stream

    def close(self) -> None:
        self._inner.close()


def settings_from_env(workdir: Path, env: Mapping[str, str] | None = None, *,
                      host: str = "127.0.0.1", port: int = 0) -> Settings:
    """`Settings` as `ajet-swarm start` builds them under `env` (its `AJET_SWARM_*` only).

    The test process's own `AJET_SWARM_*` variables are left out, as `start_server` does
    for its subprocess, so one test's environment never configures another's server.
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith("AJET_SWARM_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update({k: v for k, v in (env or {}).items() if k.startswith("AJET_SWARM_")})
        return Settings(host=host, port=port, workdir=workdir.resolve())
    finally:
        for key in [k for k in os.environ if k.startswith("AJET_SWARM_")]:
            del os.environ[key]
        os.environ.update(saved)


@contextmanager
def _process_env(extra: Mapping[str, str]) -> Iterator[None]:
    """`extra` in os.environ while the app runs: the engines it starts inherit it."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _captured_log(path: Path) -> Iterator[None]:
    """The server's log records (`swarm_server.*`) appended to `path`, like its stderr."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("swarm_server")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


@contextmanager
def app_server(workdir: Path, *, env: Mapping[str, str] | None = None,
               headers: Mapping[str, str] | None = None) -> Iterator[AppServer]:
    """Run `create_app` for `workdir` in this process until the block ends.

    `env` is what `start_server` would pass to the subprocess: `AJET_SWARM_*` variables
    configure the settings, the others (the fake engine's `PYTHONPATH`) are set in this
    process while the app runs, so that the engines it starts inherit them. The umask the
    server sets for its work directory is put back afterwards.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(env or {})
    env.setdefault("AJET_SWARM_WARM_STANDBY", "0")  # as start_server: no standby by default
    settings = settings_from_env(workdir, env)
    log_path = workdir / "server-inprocess.log"
    umask = os.umask(0o077)
    os.umask(umask)
    try:
        with _captured_log(log_path), \
                _process_env({k: v for k, v in env.items() if not k.startswith("AJET_SWARM_")}):
            app = create_app(settings)
            with TestClient(app, raise_server_exceptions=False) as test_client, \
                    httpx.Client(base_url=APP_URL, transport=_SharedTransport(test_client),
                                 headers=dict(headers or {}), timeout=60.0) as http:
                yield AppServer(settings, app, test_client, http, workdir, log_path, env)
    finally:
        os.umask(umask)
