"""The episode gateway's table stays bounded under begin/abort churn.

`EpisodeGateway` against a small stand-in engine served by uvicorn on a real Unix socket
(the gateway's own transport), with the engine's step under the test's control: closed
entries stay while their batch is collected, go once the step moves on, a late call for
a pruned episode is answered by the engine, and the table never passes its bound.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ajet.protocol import AbortEpisodeRequest, BeginEpisodeRequest, EngineState
from swarm_server.episodes import EpisodeGateway
from swarm_server.errors import ApiError, EngineStateError, Unauthorized
from swarm_server.settings import Settings


@dataclass
class StandInEngine:
    """What the gateway sees of the engine (`EngineView`) plus the engine's own memory."""

    socket: Path
    step: int = 0
    timeout_s: float = 60.0
    live: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)
    state: EngineState = EngineState.ROLLING

    def engine_socket(self) -> Path | None:
        return self.socket

    def current_run_id(self) -> str | None:
        return "run-1"

    def current_step(self) -> int | None:
        return self.step

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/begin_episode")
        async def begin() -> dict[str, Any]:
            episode = uuid.uuid4().hex
            self.live.add(episode)
            return {"episode_uuid": episode, "timeout_s": self.timeout_s}

        @app.post("/abort_episode")
        async def abort(body: dict[str, Any]) -> Any:
            episode = body["episode_uuid"]
            if episode in self.closed:
                return JSONResponse({"detail": f"cannot abort episode {episode}: it was "
                                               "aborted", "hint": "begin"}, status_code=409)
            self.live.discard(episode)
            self.closed.add(episode)
            return {"episode_uuid": episode, "requeued": True}

        return app


@asynccontextmanager
async def gateway_on(tmp_path: Path, **settings: Any) -> AsyncIterator[
        tuple[EpisodeGateway, StandInEngine]]:
    engine = StandInEngine(socket=tmp_path / "engine.sock")
    server = uvicorn.Server(uvicorn.Config(engine.app(), uds=str(engine.socket),
                                           log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    gateway = EpisodeGateway(Settings(workdir=tmp_path, **settings), engine)
    try:
        yield gateway, engine
    finally:
        await gateway.aclose()
        server.should_exit = True
        await task


async def churn(gateway: EpisodeGateway, n: int) -> list[str]:
    """Begin and abort `n` episodes; returns their keys."""
    keys = []
    for _ in range(n):
        episode = await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
        await gateway.abort(AbortEpisodeRequest(episode_uuid=episode.episode_uuid))
        keys.append(episode.openai_api_key)
    return keys


def test_closed_entries_are_pruned_once_their_batch_is_trained(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway_on(tmp_path) as (gateway, engine):
            keys = await churn(gateway, 300)
            assert gateway.table_size() == 300  # the current batch: kept for its statistics
            for key in keys[:3]:
                with pytest.raises(Unauthorized, match="has ended"):
                    gateway.check_key(key)
            engine.step = 1  # the batch those episodes were collected for was trained
            live = await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
            assert gateway.table_size() == 1
            assert gateway.check_key(live.openai_api_key) == live.episode_uuid
            with pytest.raises(Unauthorized):  # a pruned episode's key is still refused
                gateway.check_key(keys[0])
            # a late call for a pruned episode: the engine, which remembers it, answers
            pruned = next(iter(engine.closed))
            with pytest.raises(ApiError, match="was aborted") as late:
                await gateway.abort(AbortEpisodeRequest(episode_uuid=pruned))
            assert late.value.status == 409

    asyncio.run(scenario())


def test_the_table_never_passes_its_bound(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway_on(tmp_path, max_gateway_episodes=100) as (gateway, engine):
            live = [await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
                    for _ in range(100)]
            with pytest.raises(EngineStateError, match="limit") as full:
                await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
            assert full.value.headers == {"Retry-After": "1"}
            assert len(engine.live) == 100  # refused before the engine was asked
            for episode in live[:40]:
                await gateway.abort(AbortEpisodeRequest(episode_uuid=episode.episode_uuid))
            # full again: closed entries of the current batch make room
            await churn(gateway, 500)
            assert gateway.table_size() <= 100
            assert all(gateway.check_key(e.openai_api_key) for e in live[40:])

    asyncio.run(scenario())


def test_idle_entries_the_engine_timed_out_are_pruned_too(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway_on(tmp_path) as (gateway, engine):
            engine.timeout_s = 0.01
            for _ in range(50):  # workers that vanished: never ended nor aborted
                await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
            await asyncio.sleep(0.1)
            engine.step = 1
            await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
            assert gateway.table_size() == 1

    asyncio.run(scenario())
