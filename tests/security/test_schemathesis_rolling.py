"""Schemathesis against the server's own OpenAPI schema, with the control token and the
engine ROLLING (the fake engine): no 5xx, every response conforms to the schema, and
every engine an example restarted is reaped (tests/support/fuzz.py has the loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis

from ajet.protocol import EngineState
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, process_alive
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env, started_pids
from tests.support.fuzz import CTL, ensure_rolling, fuzz, state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    # a real server process: schemathesis sends its cases over HTTP with requests
    return server_factory(env=server_env(AJET_SWARM_TOKEN=CONTROL_TOKEN,
                                         AJET_SWARM_WORKER_TOKEN=WORKER_TOKEN), process=True)


@pytest.fixture(scope="module")
def schema(srv: Server) -> Any:
    return schemathesis.openapi.from_url(f"{srv.url}/openapi.json", headers=CTL, timeout=30)


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=CTL, timeout=60) as client:
        yield client


def test_no_5xx_and_schema_conformance_with_the_engine_rolling(
        srv: Server, schema: Any, http: httpx.Client) -> None:
    ensure_rolling(http)
    failures = fuzz(schema, srv.url, before_each=lambda: ensure_rolling(http))
    assert not failures, "\n\n".join(failures)
    http.post("/stop_engine", json={})
    assert state(http) is EngineState.OFFLINE
    pids = started_pids(srv.workdir)
    assert pids and not any(process_alive(pid) for pid in pids)  # every restart reaped
