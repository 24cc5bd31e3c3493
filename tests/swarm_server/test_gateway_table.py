"""The episode gateway's table stays bounded under begin/abort churn.

`EpisodeGateway` against a small stand-in engine served by uvicorn on a real Unix socket
(the gateway's own transport), with the engine's step under the test's control: closed
entries stay while their batch is collected, go once the step moves on, a late call for
a pruned episode is answered by the engine, and the table never passes its bound.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ajet.protocol import AbortEpisodeRequest, BeginEpisodeRequest
from ajet.errors import EngineStateConflict, SwarmAuthError, SwarmHTTPError
from swarm_server.episodes import EpisodeGateway
from tests.support.gateway import gateway_on


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
                with pytest.raises(SwarmAuthError, match="has ended"):
                    gateway.check_key(key)
            engine.step = 1  # the batch those episodes were collected for was trained
            live = await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
            assert gateway.table_size() == 1
            assert gateway.check_key(live.openai_api_key) == live.episode_uuid
            with pytest.raises(SwarmAuthError):  # a pruned episode's key is still refused
                gateway.check_key(keys[0])
            # a late call for a pruned episode: the engine, which remembers it, answers
            pruned = next(iter(engine.closed))
            with pytest.raises(SwarmHTTPError, match="was aborted") as late:
                await gateway.abort(AbortEpisodeRequest(episode_uuid=pruned))
            assert late.value.status == 409

    asyncio.run(scenario())


def test_the_table_never_passes_its_bound(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway_on(tmp_path, max_gateway_episodes=100) as (gateway, engine):
            live = [await gateway.begin(BeginEpisodeRequest(), public_base_url="http://x/")
                    for _ in range(100)]
            with pytest.raises(EngineStateConflict, match="limit") as full:
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
