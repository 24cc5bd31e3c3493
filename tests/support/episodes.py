"""Episode helpers for tests that drive a server's episode plane with `SwarmClient`."""

from __future__ import annotations

import time
from typing import Any

from ajet.client import SwarmClient
from ajet.errors import EngineStateConflict
from ajet.protocol import BeginEpisodeResponse

__all__ = ["begin"]


def begin(client: SwarmClient, **kwargs: Any) -> BeginEpisodeResponse:
    """begin_episode, retrying while a step closes claims (409), as rollout workers do."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.open_episode(**kwargs)
        except EngineStateConflict:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
