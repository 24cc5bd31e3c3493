"""Every route of the OpenAPI schema, walked with no token, a wrong token, the worker
token and the control token; the refusals must match the access table
(tests/support/access.py): a route the server grows and the table does not name fails the
walk, so nobody adds a route without deciding who may call it.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.support import (
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
    WORKER_TOKEN,
)
from tests.support.access import (
    ACCESS,
    APPROVER,
    CONTROL,
    DOC_ROUTES,
    EPISODE_KEY,
    OPEN,
    READER,
    REVIEWER,
)
from tests.support.factory import Server, ServerFactory

BAD_CREDENTIALS: list[dict[str, str]] = [
    {}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "Basic abc"},
    {"Authorization": "Bearer"}, {"Authorization": f"Bearer {CONTROL_TOKEN}x"},
    {"Authorization": f"bearer {WORKER_TOKEN[:-1]}"},
]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory) -> Server:
    return server_factory(env=ENFORCING_ENV)  # in process: the auth gate is the app's


def schema_routes(http: httpx.Client) -> list[tuple[str, str]]:
    schema = http.get("/openapi.json", headers=bearer(CONTROL_TOKEN)).json()
    return [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "0" * 64, path)


def test_the_access_table_names_every_route(srv: Server) -> None:
    routes = schema_routes(srv.http)
    assert set(routes) == set(ACCESS), "classify new routes in ACCESS (and docs/security.md)"


def test_every_route_refuses_missing_wrong_and_insufficient_tokens(srv: Server) -> None:
    with srv.http_as(None) as http:  # no default token: each request sends its own
        for (method, path), access in [*ACCESS.items(), *((r, READER) for r in DOC_ROUTES)]:
            url = concrete(path)
            # a body that is not JSON: refusals must come before any parsing
            body = b"{not json" if method == "POST" else None
            for headers in BAD_CREDENTIALS:
                r = http.request(method, url, headers=headers, content=body)
                if access == OPEN:
                    assert r.status_code == 200, (method, path, r.text)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                assert r.json()["hint"] and r.headers["www-authenticate"] == "Bearer"
            worker = http.request(method, url, headers=bearer(WORKER_TOKEN), content=body)
            control = http.request(method, url, headers=bearer(CONTROL_TOKEN), content=body)
            approver = http.request(method, url, headers=bearer(APPROVER_TOKEN), content=body)
            if access in (APPROVER, REVIEWER):
                assert approver.status_code not in (401, 403), (method, path, approver.text)
                assert approver.status_code < 500, (method, path, approver.text)
            elif access != OPEN:  # an approver token opens nothing else
                assert approver.status_code in (401, 403), (method, path, approver.text)
            if access == APPROVER:
                assert worker.status_code == control.status_code == 403, (path, control.text)
                assert "cannot approve" in control.json()["detail"]
                continue
            if access in (CONTROL, REVIEWER):
                assert worker.status_code == 403, (method, path, worker.text)
                assert "control token" in worker.json()["detail"]
            if access == EPISODE_KEY:  # a bearer token is not an episode key
                assert worker.status_code == control.status_code == 401, (path, worker.text)
                continue
            if access == READER:
                assert worker.status_code not in (401, 403), (method, path, worker.text)
            assert control.status_code not in (401, 403), (method, path, control.text)
            for answer in (worker, control):
                assert answer.status_code < 500, (method, path, answer.text)


def test_a_server_with_only_a_control_token_refuses_everything_else(
        server_factory: ServerFactory) -> None:
    handle = server_factory(env={"AJET_SWARM_TOKEN": CONTROL_TOKEN})
    with handle.http_as(None) as http:
        for (method, path), access in ACCESS.items():
            if access in (OPEN, EPISODE_KEY):
                continue
            r = http.request(method, concrete(path), headers=bearer(WORKER_TOKEN))
            assert r.status_code == 401, (method, path, r.text)
        assert http.get("/get_engine_status", headers=bearer(CONTROL_TOKEN)).status_code == 200
