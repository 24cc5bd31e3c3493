"""The chat routes and the generator: an aborted episode cancels the reply in progress.

Real parts: the engine's private channel (`ChannelServer`, uvicorn on a Unix socket) with
the engine's own routes, the tiny policy for the chat template, httpx as the client. The
generator is a stand-in that holds every reply until it is cancelled, so the abort
always lands while the reply is being generated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import engine_config_from_job
from ajet.engine.generation.interface import (
    GenerationHandle,
    GenerationRefused,
    GenerationRequest,
)
from ajet.engine.plane.app import create_channel_app
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.policy import load_policy
from ajet.engine.tiny import ensure_tiny_model
from ajet.engine.transport.unix_server import ChannelServer
from ajet.protocol import EngineState
from tests.support.engine import StubGenerator


class HoldingGenerator(StubGenerator):
    """Never finishes a reply by itself; records submits and cancels."""

    def __init__(self) -> None:
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        if len(request.prompt_ids) > 60:
            raise GenerationRefused("longer than this stand-in's KV cache")
        self.submitted.append(request)
        return GenerationHandle(request, on_cancel=lambda _h: self.cancelled.append(request))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, HoldingGenerator]]:
    root = tmp_path_factory.mktemp("chat")
    cfg = engine_config_from_job(AgentJetJob(batch_size=1, num_repeat=2), cuda_devices=0,
                                 cpu_count=1)
    registry = EpisodeRegistry(group_size=2, max_in_flight=4, default_timeout_s=60)
    registry.set_state(EngineState.ROLLING)
    generator = HoldingGenerator()
    plane = EpisodePlane(cfg=cfg, registry=registry, run_id="r", ajet_file="x")
    plane.set_policy(load_policy(ensure_tiny_model(root, seed=0), device="cpu",
                                 dtype="float32", seed=0), generator)
    channel = ChannelServer(create_channel_app(plane), root / "engine.sock")
    channel.start()
    yield root / "engine.sock", generator
    channel.stop()


def _client(socket: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)),
                        base_url="http://engine", timeout=30)


def _begin(client: httpx.Client) -> str:
    return str(client.post("/begin_episode", json={}).json()["episode_uuid"])


def test_abort_cancels_the_reply_being_generated(
        engine: tuple[Path, HoldingGenerator]) -> None:
    socket, generator = engine
    client = _client(socket)
    uuid = _begin(client)
    answers: list[httpx.Response] = []

    def ask() -> None:
        with _client(socket) as own:  # a connection of its own, as each worker has
            answers.append(own.post("/v1/chat/completions", headers={"X-Episode-UUID": uuid},
                                    json={"messages": [{"role": "user", "content": "hi"}]}))

    chat = threading.Thread(target=ask)
    chat.start()
    deadline = time.monotonic() + 10
    while not generator.submitted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert generator.submitted[0].session == uuid  # routed sticky per episode
    assert client.post("/abort_episode", json={"episode_uuid": uuid}).status_code == 200
    chat.join(10)
    assert generator.cancelled == generator.submitted  # the reply was stopped, not left
    assert answers[0].status_code == 409 and "cancelled" in answers[0].json()["detail"]


def test_a_prompt_the_generator_refuses_is_a_400(
        engine: tuple[Path, HoldingGenerator]) -> None:
    client = _client(engine[0])
    uuid = _begin(client)
    r = client.post("/v1/chat/completions", headers={"X-Episode-UUID": uuid},
                    json={"messages": [{"role": "user", "content": "x" * 100}]})
    assert r.status_code == 400 and "KV cache" in r.json()["detail"]
    assert client.post("/abort_episode", json={"episode_uuid": uuid}).status_code == 200
