"""`ServerFactory`: every swarm server a test module needs, in process or as a subprocess.

The `server_factory` fixture (tests/conftest.py) hands one factory to each test module:

    srv = server_factory(env=server_env())             # the app in this process, shared
    srv = server_factory(env=ENFORCING_ENV, process=True)  # a real `ajet-swarm start`
    with server_factory.fresh(env=server_env()) as srv:  # one of its own, for one test
        ...

Calls with the same arguments get the same server for the whole module, so a module pays
for each distinct server once; everything is stopped when the module's tests are done.
In process (the default) is for tests that call routes; `process=True` is for tests
about the process itself: see tests/support/app.py and tests/support/servers.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.support.app import AppServer, app_server
from tests.support.servers import ServerHandle, start_server

__all__ = ["Server", "ServerFactory"]

#: what the factory gives; both have url, workdir, http, client(token) and log()
Server = AppServer | ServerHandle


class ServerFactory:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._stack = ExitStack()
        self._shared: dict[tuple[object, ...], Server] = {}
        self._names = itertools.count()

    def __call__(self, env: Mapping[str, str] | None = None, *, process: bool = False,
                 name: str = "") -> Server:
        """The module's server for these arguments (`name` tells equal ones apart)."""
        key = (process, name, tuple(sorted((env or {}).items())))
        if key not in self._shared:
            self._shared[key] = self._stack.enter_context(self._start(env, process))
        return self._shared[key]

    @contextmanager
    def fresh(self, env: Mapping[str, str] | None = None, *, process: bool = False
              ) -> Iterator[Server]:
        """A server of its own, stopped when the block ends."""
        with self._start(env, process) as server:
            yield server

    @contextmanager
    def _start(self, env: Mapping[str, str] | None, process: bool) -> Iterator[Server]:
        workdir = self.root / f"swarm{next(self._names)}"
        if not process:
            with app_server(workdir, env=env) as app:
                yield app
            return
        handle = start_server(workdir, env=env)
        try:
            yield handle
        finally:
            handle.stop()

    def close(self) -> None:
        self._shared.clear()
        self._stack.close()
