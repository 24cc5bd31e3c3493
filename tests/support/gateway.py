"""`EpisodeGateway` against a small stand-in engine on a real Unix socket (uvicorn).

The engine's step is under the test's control (`StandInEngine`); `gateway_on` serves it and
gives a gateway in front of it (tests/swarm_server/test_gateway_table.py and others).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ajet.protocol import EngineState
from swarm_server.episodes import EpisodeGateway
from swarm_server.settings import Settings

__all__ = ["StandInEngine", "gateway_on"]


@dataclass
class StandInEngine:
    """What the gateway sees of the runs (`RunsView`: one run, `run-1`) plus the engine's
    own memory."""

    socket: Path
    step: int = 0
    timeout_s: float = 60.0
    live: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)
    state: EngineState = EngineState.ROLLING

    def default_run_id(self) -> str | None:
        return "run-1"

    def serving_socket(self, run_id: str) -> Path | None:
        return self.socket if run_id == "run-1" else None

    def run_step(self, run_id: str) -> int | None:
        return self.step

    def resolve(self, ref: str) -> str:
        return ref

    def live_state(self, run_id: str | None) -> EngineState | None:
        return self.state

    def describe(self, run_id: str | None) -> str:
        return f"engine is {self.state}"

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
