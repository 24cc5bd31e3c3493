"""Schemathesis against the server's own OpenAPI schema, with the control token and the
engine ROLLING (the fake engine): no 5xx, every response conforms to the schema, and
every engine an example restarted is reaped (tests/support/fuzz.py has the loop).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ajet.protocol import EngineState
from tests.support import process_alive
from tests.support.factory import Server
from tests.support.fake_engine import started_pids
from tests.support.fuzz import ensure_rolling, fuzz, state, stop_side_runs

pytestmark = pytest.mark.slow


def test_no_5xx_and_schema_conformance_with_the_engine_rolling(
        srv: Server, schema: Any, http: httpx.Client) -> None:
    ensure_rolling(http)
    failures = fuzz(schema, srv.url, before_each=lambda: ensure_rolling(http))
    assert not failures, "\n\n".join(failures)
    stop_side_runs(http)
    http.post("/stop_engine", json={})
    assert state(http) is EngineState.OFFLINE
    pids = started_pids(srv.workdir)
    assert pids and not any(process_alive(pid) for pid in pids)  # every restart reaped
