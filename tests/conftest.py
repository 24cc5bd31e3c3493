"""Shared fixtures: swarm servers (`server_factory`: in process or subprocesses) and temp git
repos; the order and grouping of files across `make test`'s workers."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, make_ajet_repo, start_server
from tests.support.factory import ServerFactory

# Every httpx client (SwarmClient, TestClient, the OpenAI and Anthropic SDKs, in this
# process and in the servers, bridges and scripts it starts) builds an SSL context when
# it is made, and reading a CA bundle file into it (SSL_CERT_FILE, else certifi's) costs
# about 20 ms of CPU. The suite makes thousands of clients and speaks no TLS: a CA
# directory is only read when a certificate is verified, which here is never.
os.environ.pop("SSL_CERT_FILE", None)
os.environ.setdefault("SSL_CERT_DIR", "/etc/ssl/certs")


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """Swarm servers for this module: `server_factory(env)` in process, shared by calls
    with the same arguments; `process=True` a real subprocess; `.fresh(...)` one of its
    own for a block (tests/support/factory.py)."""
    factory = ServerFactory(tmp_path_factory.mktemp("servers"))
    yield factory
    factory.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerHandle]:
    """An open (no token) swarm server on a free loopback port."""
    handle = start_server(tmp_path / "swarm")
    yield handle
    handle.stop()


@pytest.fixture
def secured_server(tmp_path: Path) -> Iterator[ServerHandle]:
    """A swarm server with a control and a worker token."""
    handle = start_server(tmp_path / "swarm", env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                                                   "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN})
    yield handle
    handle.stop()


@pytest.fixture
def ajet_repo(tmp_path: Path) -> Path:
    """A real git repo with a committed copy of the project's ajet/."""
    return make_ajet_repo(tmp_path / "repo")


#: What a test module calls when it starts a real server, engine, CLI or script process:
#: such modules are marked `process`, and `make test-fast` leaves them out. In-process
#: servers (`server_factory(...)` without process=True) and the engines they start for a
#: test are not counted: those modules stay in the fast loop.
_PROCESS_CALLS = re.compile(
    r"start_server\(|rolling_server\(|process=True|spawn_engine\(|tool_server|secured_server"
    r"|\bserver: ServerHandle|subprocess\.(?:run|Popen|check_call|check_output)\(|_cli\(")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `process` modules, and put the modules with `slow` tests first.

    `make test` hands whole files to two workers in collection order; the long files
    first (longest processing time first) keeps one worker from starting a long file when
    the other has nothing left, which would add that file's time to the wall time.
    """
    process_modules: dict[Path, bool] = {}
    slow_modules: set[Path] = set()
    for item in items:
        path = item.path
        if path not in process_modules:
            process_modules[path] = bool(_PROCESS_CALLS.search(path.read_text("utf-8")))
        if process_modules[path]:
            item.add_marker(pytest.mark.process)
        if item.get_closest_marker("slow") is not None:
            slow_modules.add(path)
    items.sort(key=lambda item: item.path not in slow_modules)  # stable: order kept within


#: Folders whose files `--dist loadfile` hands to one worker as one unit: they share a
#: package-scoped fixture that costs an engine boot (tests/tool_agents: the tool model's
#: server), which would otherwise start once on each worker.
ONE_WORKER_FOLDERS = ("tests/tool_agents/",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FoldersTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((folder for folder in ONE_WORKER_FOLDERS if path.startswith(folder)),
                        path)

    return FoldersTogether(config, log)
