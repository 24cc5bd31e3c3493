"""Schemathesis against the server's own OpenAPI schema, with the control token and the
engine OFFLINE: no 5xx, and every response conforms to the schema (documented status,
content type, headers, body). The loop and its budget: tests/support/fuzz.py; the same
with the engine ROLLING: test_schemathesis_rolling.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ajet.protocol import EngineState
from tests.support.factory import Server
from tests.support.fuzz import ensure_rolling, fuzz, state

pytestmark = pytest.mark.slow


def test_no_5xx_and_schema_conformance_with_the_engine_offline(
        srv: Server, schema: Any, http: httpx.Client) -> None:
    def offline() -> None:
        if state(http) is not EngineState.OFFLINE:
            http.post("/stop_engine", json={})

    failures = fuzz(schema, srv.url, before_each=offline)
    assert not failures, "\n\n".join(failures)


def test_what_the_fuzzer_found_stays_fixed(http: httpx.Client) -> None:
    # a paging offset past SQLite's 64-bit integers was a 500
    for path in ("/runs", "/audit"):
        r = http.get(path, params={"offset": 2**63})
        assert r.status_code == 422 and "offset" in r.text, (path, r.text)
    # a body that is not UTF-8 was a 400 without a hint, on routes that did not document it
    r = http.post("/stop_engine", content=b"\xff\xfe{",
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["hint"], r.text


def test_unencodable_episode_input_is_a_422_before_the_engine_sees_it(
        http: httpx.Client) -> None:
    # it was a 500 that left the episode open (the metadata could not be stored)
    ensure_rolling(http)
    raw = {"Content-Type": "application/json"}
    before = http.get("/get_engine_status").json()
    r = http.post("/begin_episode", content=b'{"metadata": {"note": "\\ud800"}}', headers=raw)
    assert r.status_code == 422 and "metadata.note" in r.text, r.text
    end = b'{"episode_uuid": "e", "task_id": "t", "reward": 1.0, "metadata": {"\\udc00": 1}}'
    r = http.post("/end_episode", content=end, headers=raw)
    assert r.status_code == 422 and "metadata" in r.text, r.text
    r = http.post("/end_episode", content=end.replace(b'1.0', b'Infinity'), headers=raw)
    assert r.status_code == 422 and "reward" in r.text, r.text
    assert http.get("/get_engine_status").json()["state"] == before["state"]
