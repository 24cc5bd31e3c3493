"""EpisodeGateway placeholder (see docs/internals.md); replaced by the engine work."""

from __future__ import annotations

from typing import Any

from swarm_server.settings import Settings


class EpisodeGateway:
    def __init__(self, settings: Settings, engine: Any) -> None:
        self.settings = settings
        self.engine = engine

    async def aclose(self) -> None:
        pass
