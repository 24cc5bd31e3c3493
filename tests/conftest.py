"""Shared fixtures: swarm servers (`server_factory`: in process or subprocesses), temp git
repos, and the tool-calling model of the end-to-end tool tests."""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ajet.client import SwarmClient
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, make_ajet_repo, start_server
from tests.support.factory import ServerFactory


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


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ajet-tiny fine-tuned to call get_weather (tests/support/tool_model.py), built once
    per test run: under xdist the workers share it (about 20 s of CPU each otherwise)."""
    from tests.support.tool_model import finetune_tool_model

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above every worker's own basetemp
    target = root / "tool-model" / "ajet-tiny-tools"
    target.parent.mkdir(parents=True, exist_ok=True)
    # one worker builds it while the others wait; `finetune_tool_model` returns a
    # finished one (its finetuned.json is written last) as it is
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return finetune_tool_model(target)


@pytest.fixture(scope="session")
def tool_server(tool_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerHandle]:
    """A token-protected server whose engine serves `tool_model` (tool-calling tests)."""
    from tests.support import rolling_server
    from tests.support.tool_model import tool_job

    with rolling_server(tmp_path_factory.mktemp("tools"), tool_job(tool_model)) as handle:
        yield handle


@pytest.fixture(scope="session")
def tool_worker(tool_server: ServerHandle) -> Iterator[SwarmClient]:
    with SwarmClient(tool_server.url, token=WORKER_TOKEN, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def tool_tokenizer(tool_model: Path) -> Any:
    """The tool model's tokenizer, to render expected prompts in the test process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


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
