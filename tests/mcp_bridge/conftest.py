"""Fixtures for the bridge: a real git repo, an approvals folder, bridges on a server.

The helpers the tests call (MCP results, the approvals CLI) are in tests/support/bridge.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_bridge.bridge import Bridge
from mcp_bridge.models import ApprovalMode
from tests.support.bridge import make_bridge
from tests.support.servers import ServerHandle, make_ajet_repo


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _restore_sys_path() -> Iterator[None]:
    # Loading a workflow in process puts its (temporary) repo first on sys.path; later
    # tests must not import modules from there.
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_ajet_repo(tmp_path / "repo")


@pytest.fixture
def approvals_dir(tmp_path: Path) -> Path:
    return tmp_path / "approvals"


@pytest.fixture
def bridge_factory(server: ServerHandle, repo: Path, approvals_dir: Path) -> Iterator[Any]:
    made: list[Bridge] = []

    def factory(approval: ApprovalMode = ApprovalMode.ASK, **kw: Any) -> Bridge:
        b = make_bridge(server, repo, approvals_dir, approval=approval, **kw)
        made.append(b)
        return b

    yield factory
    for b in made:
        b.close()
