"""Schemathesis against the server's own OpenAPI schema: the fuzz loop and its budget.

Used by tests/security/test_schemathesis*.py (one file per engine state, so that the two
fuzz runs can go to different workers). Bounded: a few examples per operation and
generation mode, derandomized, so a run is reproducible. Most of the time goes into
schemathesis drawing cases (most drawn cases are rejected before one is sent), so the
budget is what the suite's wall time allows. Operations whose examples are expensive (the
config validator runs a subprocess) get fewer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import requests
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
from tests.support.servers import CONTROL_TOKEN

__all__ = ["CTL", "EXAMPLES", "FEWER", "JOB", "ensure_rolling", "fuzz", "state",
           "stop_side_runs"]

CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
JOB = "experiment_name: fuzz\nlr: 0.01\n"
EXAMPLES = 4
#: Fewer examples where one costs a subprocess (config validation) or an engine restart.
FEWER = {"POST /sync_train_config": 3, "POST /stop_engine": 2, "POST /start_engine": 3,
         "POST /runs": 3}


def state(http: httpx.Client) -> EngineState:
    return EngineState(http.get("/get_engine_status").json()["state"])


def stop_side_runs(http: httpx.Client) -> None:
    """Stop the runs an example started with `POST /runs` (they hold device slots the
    default run needs)."""
    active = http.get("/runs", params={"state": "active", "limit": 200}).json()["runs"]
    for run in active:
        if not run["default_run"]:
            http.post(f"/runs/{run['run_id']}/stop", json={"reason": "fuzz example done"})


def ensure_rolling(http: httpx.Client) -> None:
    """Bring the engine (back) to ROLLING: an example may have stopped or restarted it."""
    stop_side_runs(http)
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
