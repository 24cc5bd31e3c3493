"""The episode plane's route table: one row is the route, on the lane and in FastAPI alike.

In-process (`TestClient`), no engine: a row added to a table is served by `EpisodeLane`
(in front of the middleware stack, as `create_app` puts it)
with its requirement and body bound enforced by the limits gate, served the same by the
FastAPI endpoint built from it, a bug in its handler is the app's 500 every way, and it
is documented in the OpenAPI schema; the real table's rows are exactly the documented
episode routes; and an episode key is verified once per `/v1/*` request.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from ajet.protocol import PlanePath
from swarm_server.auth import ReaderRequirement
from swarm_server.context import ServerContext
from swarm_server.episode_keys import EpisodeKeySigner
from swarm_server.episode_lane import PlaneRoute, plane_router
from swarm_server.episodes import _Entry
from swarm_server.errors import install_error_handlers
from swarm_server.limits import BodyLimit, LimitsMiddleware
from swarm_server.main import SwarmApp, build_context, create_app
from swarm_server.routes.episodes import EPISODE_ROUTES
from swarm_server.settings import Settings

WORKER = "w" * 32
CONTROL = "c" * 32


class Echo(BaseModel):
    text: str = Field(max_length=40)


async def _echo(ctx: ServerContext, request: Request, body: Echo) -> dict[str, Any]:
    return {"echo": body.text, "route": request.scope["route"].path}


ECHO = PlaneRoute("POST", "/echo", _echo, ReaderRequirement(), BodyLimit(bound=lambda _: 64),
                  model=Echo, response_model=dict[str, Any], name="echo",
                  description="Say it back.")


def _settings(tmp_path: Path) -> Settings:
    return Settings(workdir=tmp_path / "swarm", token=CONTROL, worker_token=WORKER)


async def _fail(ctx: ServerContext, request: Request, body: Echo) -> dict[str, Any]:
    raise RuntimeError("a bug in the handler")


FAIL = PlaneRoute("POST", "/fail", _fail, ReaderRequirement(), BodyLimit(bound=lambda _: 64),
                  model=Echo, name="fail")


def _app(ctx: ServerContext, rows: list[PlaneRoute], *, lane: str) -> FastAPI:
    """An app assembled like `create_app` ("front": the lane in front of the stack), from
    `rows` alone; or without a lane ("fastapi")."""
    app = SwarmApp() if lane == "front" else FastAPI()
    app.state.ctx = ctx
    install_error_handlers(app)
    router = plane_router(rows)
    app.include_router(router)
    app.add_middleware(LimitsMiddleware, ctx=ctx)
    if isinstance(app, SwarmApp):
        app.put_lane_in_front(rows, router, ctx)
    return app


LANES = ["front", "fastapi"]


@pytest.mark.parametrize("lane", LANES)
def test_a_row_is_served_guarded_and_bounded_the_same_every_way(tmp_path: Path,
                                                                 lane: str) -> None:
    ctx = build_context(_settings(tmp_path))
    with TestClient(_app(ctx, [ECHO], lane=lane)) as client:
        worker = {"Authorization": f"Bearer {WORKER}"}
        ok = client.post("/echo", json={"text": "hi"}, headers=worker)
        assert ok.status_code == 200 and ok.json() == {"echo": "hi", "route": "/echo"}
        # the row's requirement (no token: the first gate; a bad body: the model)
        assert client.post("/echo", json={"text": "hi"}).status_code == 401
        bad = client.post("/echo", json={"text": 1}, headers=worker)
        assert bad.status_code == 422 and bad.json()["param"] == "text"
        # the row's own body bound (64 bytes), not max_json_bytes
        big = client.post("/echo", json={"text": "x" * 100}, headers=worker)
        assert big.status_code == 413 and "64-byte" in big.json()["detail"]


@pytest.mark.parametrize("lane", LANES)
def test_a_handler_bug_is_the_apps_500_and_raised_on(tmp_path: Path, lane: str) -> None:
    ctx = build_context(_settings(tmp_path))
    app = _app(ctx, [FAIL], lane=lane)
    worker = {"Authorization": f"Bearer {WORKER}"}
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/fail", json={"text": "hi"}, headers=worker)
        assert answer.status_code == 500
        assert answer.json() == {"detail": "internal server error",
                                 "hint": "see the swarm server log"}
        assert client.post("/fail", json={"text": "hi"}).status_code == 401  # gate first
    with TestClient(app) as client, pytest.raises(RuntimeError, match="a bug"):
        client.post("/fail", json={"text": "hi"}, headers=worker)  # on to the server


def test_create_app_puts_the_lane_in_front(tmp_path: Path) -> None:
    app = create_app(_settings(tmp_path))
    assert isinstance(app, SwarmApp) and app.lane is not None
    assert app.lane.paths == {row.path for row in EPISODE_ROUTES if row.on_lane}


def test_a_row_is_documented(tmp_path: Path) -> None:
    ctx = build_context(_settings(tmp_path))
    spec = _app(ctx, [ECHO], lane="front").openapi()
    op = spec["paths"]["/echo"]["post"]
    assert op["description"] == "Say it back."
    assert op["requestBody"]["required"] is True
    assert any(p["name"] == "authorization" for p in op["parameters"])


def test_the_table_is_every_documented_episode_route(tmp_path: Path) -> None:
    spec = create_app(_settings(tmp_path)).openapi()
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops
                  if "episodes" in ops[m].get("tags", [])}
    table = {(row.method, row.path.replace(":path}", "}")) for row in EPISODE_ROUTES}
    assert documented == table
    assert {row.path for row in EPISODE_ROUTES if row.on_lane} >= {
        PlanePath.BEGIN_EPISODE, PlanePath.END_EPISODE, PlanePath.ABORT_EPISODE,
        PlanePath.CHAT_COMPLETIONS, PlanePath.COMPLETIONS, PlanePath.RESPONSES}


def test_an_episode_key_is_verified_once_per_request(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(_settings(tmp_path))
    ctx: ServerContext = app.state.ctx
    gateway = ctx.episodes
    key, expires_at = gateway.signer.sign("run-1", "ep-1")
    gateway._episodes["ep-1"] = _Entry(run_id="run-1", expires_at=expires_at, timeout_s=60,
                                       last_active=0.0, step=0)
    # a serving run whose socket answers nothing: the key passes, the forward answers 409
    monkeypatch.setattr(ctx.runs, "serving_socket", lambda run_id: tmp_path / "gone.sock")
    verified: list[str] = []
    real_verify = EpisodeKeySigner.verify

    def counting(self: EpisodeKeySigner, given: str) -> Any:
        verified.append(given)
        return real_verify(self, given)

    monkeypatch.setattr(EpisodeKeySigner, "verify", counting)
    with TestClient(app) as client:
        for path in (PlanePath.CHAT_COMPLETIONS, PlanePath.RESPONSES):
            verified.clear()
            answer = client.post(path, json={"messages": []},
                                 headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 409, answer.text
            assert answer.json()["error"]["type"] == "conflict_error"
            assert verified == [key]
        verified.clear()
        assert client.get("/v1/nothing", headers={"Authorization": f"Bearer {key}"}
                          ).status_code == 404
        assert verified == [key]



@pytest.mark.parametrize("scope", [
    {"headers": [(b"host", b"10.0.0.5:8000")], "server": ("127.0.0.1", 8000)},
    {"headers": [(b"host", b"swarm.example")], "scheme": "https"},
    {"headers": [], "server": ["127.0.0.1", 8000]},
    {"headers": [], "server": ("::1", 80), "root_path": "/swarm"},
    {"headers": [(b"host", b"a"), (b"host", b"b")], "server": ("127.0.0.1", 8000)},
])
def test_begin_gives_the_base_url_starlette_would(scope: dict[str, Any]) -> None:
    from swarm_server.routes.episodes import _base_url

    full = {"type": "http", "method": "POST", "path": "/begin_episode", "query_string": b"",
            "scheme": "http", **scope}
    ctx: Any = SimpleNamespace(episodes=SimpleNamespace(base_urls={}))
    for _ in range(2):  # computed, then kept
        assert _base_url(ctx, Request(full)) == str(Request(full).base_url)
    assert len(ctx.episodes.base_urls) == 1
