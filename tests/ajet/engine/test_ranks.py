"""Rank 0 routes generation to other ranks: the service, its client, sticky routing.

Real parts: each rank's `RankService` on a real Unix socket or TCP port, rank 0's
`RemoteGenerator` over HTTP. The generator behind the service is a fake that replies
with its prompt reversed, one token per delta, so these tests need no model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ajet.engine.generation.interface import (
    GenerationCancelled,
    GenerationHandle,
    GenerationRefused,
    GenerationRequest,
    GenerationResult,
)
from ajet.engine.generation.ranks import RankRouter, RankService, RemoteGenerator
from tests.support.engine import StubGenerator


class EchoGenerator(StubGenerator):
    """Replies with the prompt reversed, one token per `step_s`; `hold` keeps it going."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.hold = threading.Event()
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[GenerationRequest] = []

    def validate(self, request: GenerationRequest) -> None:
        if len(request.prompt_ids) > 100:
            raise GenerationRefused("the prompt is too long for this fake")

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        self.validate(request)
        self.submitted.append(request)
        handle = GenerationHandle(request, on_cancel=lambda h: self.cancelled.append(request))
        threading.Thread(target=self._run, args=(handle,), daemon=True).start()
        return handle

    def _run(self, handle: GenerationHandle) -> None:
        ids = list(reversed(handle.request.prompt_ids))[:handle.request.max_new_tokens]
        for i in ids:
            time.sleep(self.step_s)
            handle.delta(chr(i))
        while self.hold.is_set() and not handle.done:
            time.sleep(0.01)
        handle.finish(GenerationResult(handle.request.prompt_ids, ids, [-0.5] * len(ids),
                                       "".join(map(chr, ids)), "length"))


def wait(outcomes: list[object], n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(outcomes) < n:
        assert time.monotonic() < deadline, outcomes
        time.sleep(0.01)


@pytest.fixture(params=["uds", "tcp"])
def remote(request: pytest.FixtureRequest, tmp_path: Path
           ) -> Iterator[tuple[EchoGenerator, RankService, RemoteGenerator]]:
    echo = EchoGenerator()
    service = RankService(echo, rank=1, run_dir=tmp_path,
                          tcp_host="127.0.0.1" if request.param == "tcp" else None)
    endpoint = service.start()
    client = RemoteGenerator(endpoint)
    client.start()
    yield echo, service, client
    client.stop()
    service.stop()


def test_a_remote_rank_streams_deltas_and_returns_the_result(
        remote: tuple[EchoGenerator, RankService, RemoteGenerator]) -> None:
    echo, _, client = remote
    deltas: list[str] = []
    outcomes: list[object] = []
    client.submit(GenerationRequest(prompt_ids=[72, 105, 33], max_new_tokens=8,
                                    on_done=outcomes.append, on_delta=deltas.append,
                                    stop=("z",), temperature=0.3, top_p=0.9, session="ep-1"))
    wait(outcomes)
    result = outcomes[0]
    assert isinstance(result, GenerationResult)
    assert result.response_ids == [33, 105, 72] and result.text == "!iH"
    assert "".join(deltas) == "!iH" and result.logprobs == [-0.5] * 3
    sent = echo.submitted[0]  # every field reached the rank
    assert (sent.stop, sent.temperature, sent.top_p, sent.session) == (("z",), 0.3, 0.9, "ep-1")
    refused: list[object] = []
    client.submit(GenerationRequest(prompt_ids=[1] * 101, max_new_tokens=1,
                                    on_done=refused.append))
    wait(refused)
    assert isinstance(refused[0], GenerationRefused)


def test_cancel_on_rank_0_cancels_on_the_rank(
        remote: tuple[EchoGenerator, RankService, RemoteGenerator]) -> None:
    echo, _, client = remote
    echo.hold.set()
    outcomes: list[object] = []
    handle = client.submit(GenerationRequest(prompt_ids=[65], max_new_tokens=4,
                                             on_done=outcomes.append))
    wait(echo.submitted)
    handle.cancel()
    wait(outcomes)
    assert isinstance(outcomes[0], GenerationCancelled)
    wait(echo.cancelled)  # the stream closed, so the rank cancelled its request


def test_the_rank_service_answers_its_token_only(
        remote: tuple[EchoGenerator, RankService, RemoteGenerator]) -> None:
    _, service, client = remote
    endpoint = client.endpoint
    transport = httpx.HTTPTransport(uds=endpoint.uds) if endpoint.uds else None
    with httpx.Client(transport=transport, base_url=endpoint.url or "http://rank") as http:
        body = {"prompt_ids": [1], "max_new_tokens": 1}
        assert http.post("/generate", json=body).status_code == 401
        forged = http.post("/generate", json=body, headers={"Authorization": "Bearer x"})
        assert forged.status_code == 401
        ok = http.get("/status", headers={"Authorization": f"Bearer {service.token}"})
        assert ok.status_code == 200 and ok.json()["rank"] == 1
    if endpoint.uds:
        assert oct(Path(endpoint.uds).stat().st_mode & 0o777) == "0o600"


def test_the_router_keeps_an_episode_on_one_rank_and_spreads_new_ones() -> None:
    local, other = EchoGenerator(), EchoGenerator()
    local.hold.set()
    router = RankRouter(local, [other])  # a second rank, without HTTP in between
    done: list[object] = []

    def ask(session: str | None) -> None:
        router.submit(GenerationRequest(prompt_ids=[66], max_new_tokens=1, on_done=done.append,
                                        session=session))

    ask("a")  # rank 0 (nothing in flight anywhere; rank 0 first)
    ask("b")  # rank 1: rank 0 is busy with "a"
    ask("a")  # rank 0 again: sticky, though rank 0 is the busier one
    assert [len(local.submitted), len(other.submitted)] == [2, 1]
    wait(done, 1)  # "b" finished on rank 1; "a" is held on rank 0
    ask("c")  # the least busy rank: rank 1
    assert router.routed() == [2, 2]
    local.hold.clear()
    wait(done, 4)
    with pytest.raises(GenerationRefused):  # refused before any rank is asked
        router.submit(GenerationRequest(prompt_ids=[1] * 101, max_new_tokens=1,
                                        on_done=done.append))
    assert router.stats()["ranks"] == [{"rank": 0, "routed": 2, "in_flight": 0},
                                       {"rank": 1, "routed": 2, "in_flight": 0}]
