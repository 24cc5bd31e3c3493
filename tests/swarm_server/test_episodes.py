"""The public episode plane: real swarm server, real engine, the official openai client."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict, SwarmNotFound
from ajet.protocol import BeginEpisodeResponse
from swarm_server.episode_keys import EpisodeKeySigner, InvalidEpisodeKey
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, rolling_server, start_server
from tests.support.episodes import begin

JOB = AgentJetJob(batch_size=1, num_repeat=2, max_new_tokens=8, episode_timeout_s=60.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    with rolling_server(tmp_path_factory.mktemp("swarm"), JOB, wait_timeout=120) as handle:
        yield handle


@pytest.fixture
def worker(server: ServerHandle) -> Iterator[SwarmClient]:
    with SwarmClient(server.url, token=WORKER_TOKEN) as client:
        yield client


def oai(episode: BeginEpisodeResponse) -> openai.OpenAI:
    return openai.OpenAI(base_url=episode.openai_base_url, api_key=episode.openai_api_key,
                         max_retries=0)


def ask(client: openai.OpenAI, text: str = "hello") -> str:
    reply = client.chat.completions.create(model="ajet-tiny",
                                           messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


def raw(server: ServerHandle, path: str, body: dict[str, Any], token: str | None = WORKER_TOKEN
        ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def test_openai_client_chats_plain_and_streaming_through_an_episode_key(
        server: ServerHandle, worker: SwarmClient) -> None:
    episode = begin(worker)
    assert episode.openai_base_url == f"{server.url}/v1"
    client = oai(episode)
    reply = client.chat.completions.create(
        model="ajet-tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=6)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model="ajet-tiny", messages=[{"role": "user", "content": "2+2?"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage]
    assert usage and 1 <= usage[0].completion_tokens <= 8
    assert len(text) <= usage[0].completion_tokens  # one character per token at most
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    # the `ajet` field rides on the last chunk, the usage chunk here, and only there
    with_ajet = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("ajet")]
    assert with_ajet == [len(chunks) - 1] and chunks[-1].usage is not None
    done = worker.report_episode(episode.episode_uuid, "plain-and-stream", 0.25)
    assert done.accepted


def test_episode_routes_need_a_worker_or_control_token(server: ServerHandle) -> None:
    assert raw(server, "/begin_episode", {}, token=None).status_code == 401
    assert raw(server, "/begin_episode", {}, token="wrong").status_code == 401
    ok = raw(server, "/begin_episode", {}, token=CONTROL_TOKEN)
    assert ok.status_code == 200
    uuid = ok.json()["episode_uuid"]
    assert raw(server, "/abort_episode", {"episode_uuid": uuid}, token=None).status_code == 401
    assert raw(server, "/abort_episode", {"episode_uuid": uuid}).json()["requeued"] is True


def _tampered(key: str, **changes: Any) -> str:
    payload, signature = key.removeprefix("ajep_").split(".")
    data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data.update(changes)
    forged = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    return f"ajep_{forged}.{signature}"


def test_forged_tampered_foreign_and_ended_keys_get_401(server: ServerHandle,
                                                       worker: SwarmClient) -> None:
    a, b = begin(worker), begin(worker)
    other_server_key, _ = EpisodeKeySigner(ttl_s=60).sign(a.run_id or "", a.episode_uuid)
    forged_keys = [
        "sk-not-an-episode-key",
        "ajep_e30.AAAA",
        a.openai_api_key[:-2] + ("AA" if not a.openai_api_key.endswith("AA") else "BB"),
        _tampered(a.openai_api_key, e=b.episode_uuid),  # a's key re-pointed at b
        _tampered(a.openai_api_key, x=time.time() + 10**6),  # longer life
        other_server_key,  # right shape, wrong secret
    ]
    for key in forged_keys:
        with pytest.raises(openai.AuthenticationError):
            ask(openai.OpenAI(base_url=a.openai_base_url, api_key=key, max_retries=0))
    assert isinstance(ask(oai(a)), str)  # the genuine key still works
    worker.report_episode(a.episode_uuid, "keys", 1.0)
    with pytest.raises(openai.AuthenticationError, match="ended"):
        ask(oai(a))
    assert isinstance(ask(oai(b)), str)  # a's end did not touch b
    worker.cancel_episode(b.episode_uuid)
    with pytest.raises(openai.AuthenticationError):
        ask(oai(b))
    no_key = httpx.post(f"{server.url}/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "x"}]})
    assert no_key.status_code == 401 and no_key.json()["hint"]
    non_ascii = httpx.post(f"{server.url}/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "x"}]},
                           headers={"Authorization": "Bearer ajep_\u00e9.x".encode("utf-8")})
    assert non_ascii.status_code == 401


def test_end_for_unknown_and_already_ended_episodes_is_4xx(server: ServerHandle,
                                                           worker: SwarmClient) -> None:
    with pytest.raises(SwarmNotFound):
        worker.report_episode("0" * 32, "t", 1.0)
    episode = begin(worker)
    worker.report_episode(episode.episode_uuid, "twice", 1.0)
    with pytest.raises(EngineStateConflict, match="already ended"):
        worker.report_episode(episode.episode_uuid, "twice", 1.0)
    with pytest.raises(EngineStateConflict):
        worker.cancel_episode(episode.episode_uuid)
    bad = raw(server, "/end_episode", {"episode_uuid": "x", "task_id": "t", "reward": "many"})
    assert bad.status_code == 422


def test_idle_episode_is_requeued_and_its_key_and_end_refused(worker: SwarmClient) -> None:
    episode = begin(worker, discard_episode_timeout=0.3)
    time.sleep(1.0)
    with pytest.raises(EngineStateConflict, match="timed out"):
        worker.report_episode(episode.episode_uuid, "idle", 1.0)
    with pytest.raises(openai.AuthenticationError):
        ask(oai(episode))


def _status(server: ServerHandle) -> dict[str, Any]:
    engine = httpx.get(f"{server.url}/get_engine_status",
                       headers={"Authorization": f"Bearer {CONTROL_TOKEN}"}).json()
    return engine


ORDERS = [("end", "end"), ("end", "abort"), ("abort", "end"), ("abort", "abort"),
          ("timeout", "end"), ("timeout", "abort"), ("end", "chat"), ("abort", "chat"),
          ("timeout", "chat"), ("chat", "end"), ("chat", "timeout", "end")]


def test_every_order_of_end_abort_timeout_no_5xx_no_lost_group_no_double_training(
        server: ServerHandle, worker: SwarmClient) -> None:
    """Episode A of each scenario gets the ops in order; partner B always ends.

    A group trains only when two ended episodes share a task: exactly the scenarios
    whose first closing op of A is `end`. Then the step count and trained-episode
    count must match those groups exactly: nothing lost, nothing trained twice.
    """
    run_dir = server.workdir / "runs" / str(worker.engine_status().run_id)
    metrics = run_dir / "metrics.jsonl"
    steps_before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    statuses: list[int] = []
    expected_groups = 0
    for n, ops in enumerate(ORDERS):
        task = f"order-{n}"
        a = begin(worker, discard_episode_timeout=0.5)
        closed_by: str | None = None
        for op in ops:
            if op == "end":
                r = raw(server, "/end_episode", {"episode_uuid": a.episode_uuid,
                                                 "task_id": task, "reward": 1.0})
            elif op == "abort":
                r = raw(server, "/abort_episode", {"episode_uuid": a.episode_uuid})
            elif op == "chat":
                r = httpx.post(f"{a.openai_base_url}/chat/completions", timeout=30,
                               json={"messages": [{"role": "user", "content": "hi"}]},
                               headers={"Authorization": f"Bearer {a.openai_api_key}"})
            else:
                time.sleep(1.0)
                continue
            statuses.append(r.status_code)
            if closed_by is None and op in ("end", "abort") and r.status_code == 200:
                closed_by = op
        expected_groups += closed_by == "end"
        b = begin(worker)
        worker.report_episode(b.episode_uuid, task, 0.0)
    assert all(s < 500 for s in statuses), statuses
    assert statuses.count(200) >= len(ORDERS) - 3  # first ops on live episodes succeed
    deadline = time.monotonic() + 60
    while True:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        new = [json.loads(line) for line in lines[steps_before:]]
        if len(new) >= expected_groups or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # a wrongly trained extra group would show up here
    new = [json.loads(line) for line in metrics.read_text().splitlines()[steps_before:]]
    assert len(new) == expected_groups
    assert all(line["episodes"] == 2 for line in new)
    assert all(line["reward_mean"] == 0.5 for line in new)  # A (1.0) with its B (0.0)


def test_begin_while_offline_is_409_and_keys_expire(tmp_path: Path) -> None:
    # that a key of an earlier engine run is refused (and its episode is not found) is
    # tested on the restart of tests/security/test_episode_keys.py's engine
    handle = start_server(tmp_path / "swarm", env={"AJET_SWARM_EPISODE_KEY_TTL_S": "1"})
    try:
        with SwarmClient(handle.url) as client:
            with pytest.raises(EngineStateConflict) as info:
                client.open_episode()
            assert "ENGINE.OFFLINE" in str(info.value.detail)
            assert "start_engine" in info.value.hint
            client.configure_and_start(JOB, wait_timeout=120)
            episode = client.open_episode()
            time.sleep(1.5)
            with pytest.raises(openai.AuthenticationError, match="expired"):
                ask(oai(episode))
    finally:
        handle.stop()


def test_signer_rejects_expired_and_accepts_fresh_keys() -> None:
    now = [1000.0]
    signer = EpisodeKeySigner(ttl_s=10, clock=lambda: now[0])
    key, expires = signer.sign("run", "ep")
    assert signer.verify(key).episode_uuid == "ep" and expires == 1010.0
    now[0] = 1010.0
    with pytest.raises(InvalidEpisodeKey) as info:
        signer.verify(key)
    assert info.value.expired
