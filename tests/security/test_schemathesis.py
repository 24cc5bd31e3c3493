"""Schemathesis against the server's own OpenAPI schema, with the control token, the
engine OFFLINE and then ROLLING (the fake engine): no 5xx, and every response conforms
to the schema (documented status, content type, headers, body).

Bounded: a few examples per operation and generation mode, derandomized, so the run is
reproducible. Most of its time is schemathesis drawing cases (most drawn cases are
rejected before one is sent), so the budget is what the suite's wall time allows.
Operations whose examples are expensive (the config validator runs a subprocess) get fewer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ajet.protocol import EngineState
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, process_alive
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env, started_pids

CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
JOB = "experiment_name: fuzz\nlr: 0.01\n"
EXAMPLES = 6
#: Fewer examples where one costs a subprocess (config validation) or an engine restart.
FEWER = {"POST /sync_train_config": 3, "POST /stop_engine": 2, "POST /start_engine": 3}


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


def state(http: httpx.Client) -> EngineState:
    return EngineState(http.get("/get_engine_status").json()["state"])


def ensure_rolling(http: httpx.Client) -> None:
    """Bring the engine (back) to ROLLING: an example may have stopped or restarted it."""
    deadline = time.monotonic() + 60
    while (current := state(http)) is not EngineState.ROLLING:
        if current is EngineState.OFFLINE:
            http.post("/sync_train_config", json={"yaml": JOB})
            http.post("/start_engine", json={})
        if time.monotonic() > deadline:
            raise AssertionError(f"engine stuck in {current}")
        time.sleep(0.05)


def fuzz(schema: Any, url: str, *, before_each: Callable[[], None]) -> list[str]:
    """Every operation, positive and negative examples; returns the failures."""
    failures: list[str] = []
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            n = FEWER.get(operation.label, EXAMPLES)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def check(case: Any) -> None:
                    before_each()
                    case.call_and_validate(base_url=url, session=session, headers=CTL,
                                           checks=CHECKS, timeout=60)

                try:
                    check()
                except Unsatisfiable:
                    continue  # no invalid input exists (no parameters, no body)
                except Exception as exc:  # noqa: BLE001 - collect every operation's failure
                    failures.append(f"{operation.label} [{mode.value}]: {exc}")
    return failures


def test_no_5xx_and_schema_conformance_with_the_engine_offline(
        srv: Server, schema: Any, http: httpx.Client) -> None:
    def offline() -> None:
        if state(http) is not EngineState.OFFLINE:
            http.post("/stop_engine", json={})

    failures = fuzz(schema, srv.url, before_each=offline)
    assert not failures, "\n\n".join(failures)


def test_no_5xx_and_schema_conformance_with_the_engine_rolling(
        srv: Server, schema: Any, http: httpx.Client) -> None:
    ensure_rolling(http)
    failures = fuzz(schema, srv.url, before_each=lambda: ensure_rolling(http))
    assert not failures, "\n\n".join(failures)
    http.post("/stop_engine", json={})
    assert state(http) is EngineState.OFFLINE
    pids = started_pids(srv.workdir)
    assert pids and not any(process_alive(pid) for pid in pids)  # every restart reaped


def test_what_the_fuzzer_found_stays_fixed(http: httpx.Client) -> None:
    # a paging offset past SQLite's 64-bit integers was a 500
    for path in ("/runs", "/audit"):
        r = http.get(path, params={"offset": 2**63})
        assert r.status_code == 422 and "offset" in r.text, (path, r.text)
    # a body that is not UTF-8 was a 400 without a hint, on routes that did not document it
    r = http.post("/stop_engine", content=b"\xff\xfe{",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["hint"], r.text
