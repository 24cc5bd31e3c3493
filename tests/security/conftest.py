"""Fixtures the two schemathesis modules share: one real server process per module (the
cases go over HTTP), its OpenAPI schema, and a control-token client on it. A module that
defines its own `srv` (most do) uses that one instead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import CONTROL_TOKEN, WORKER_TOKEN
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env
from tests.support.fuzz import CTL


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    return server_factory(env=server_env(AJET_SWARM_TOKEN=CONTROL_TOKEN,
                                         AJET_SWARM_WORKER_TOKEN=WORKER_TOKEN), process=True)


@pytest.fixture(scope="module")
def schema(srv: Server) -> Any:
    import schemathesis

    return schemathesis.openapi.from_url(f"{srv.url}/openapi.json", headers=CTL,
                                         timeout=30)


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=CTL, timeout=60) as client:
        yield client
