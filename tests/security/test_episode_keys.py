"""Episode API keys cannot be forged, replayed after their episode closed, or used for
another episode or another engine run (real server, real engine, real HTTP)."""

from __future__ import annotations

import base64
import json
import string
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict, SwarmNotFound
from ajet.protocol import BeginEpisodeResponse
from swarm_server.episode_keys import KEY_PREFIX, EpisodeKeySigner, InvalidEpisodeKey
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, rolling_server

JOB = AgentJetJob(experiment_name="keys", batch_size=4, num_repeat=2, max_new_tokens=4,
                  episode_timeout_s=120.0)
WRK = {"Authorization": f"Bearer {WORKER_TOKEN}"}


# ---------------------------------------------------------------------------- the signer


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _payload(key: str) -> dict[str, object]:
    body = key[len(KEY_PREFIX):].split(".")[0]
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


SIGNER = EpisodeKeySigner(ttl_s=3600, secret=b"k" * 32)
KEY, _ = SIGNER.sign("run-1", "episode-a")


@settings(max_examples=300, deadline=None, database=None)
@given(st.data())
def test_any_change_to_a_key_is_refused(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["replace", "truncate", "extend", "insert"]))
    at = data.draw(st.integers(0, len(KEY) - 1))
    char = data.draw(st.sampled_from(string.ascii_letters + string.digits + "-_.=+/ "))
    forged = {"replace": KEY[:at] + char + KEY[at + 1:], "truncate": KEY[:at],
              "extend": KEY + char, "insert": KEY[:at] + char + KEY[at:]}[kind]
    if forged == KEY:
        return
    with pytest.raises(InvalidEpisodeKey):
        SIGNER.verify(forged)


def test_keys_of_another_server_another_episode_or_past_expiry_are_refused() -> None:
    assert SIGNER.verify(KEY).episode_uuid == "episode-a"
    other, _ = EpisodeKeySigner(ttl_s=3600).sign("run-1", "episode-a")  # another secret
    with pytest.raises(InvalidEpisodeKey):
        SIGNER.verify(other)
    # the payload of episode b under the signature of episode a
    b_key, _ = SIGNER.sign("run-1", "episode-b")
    swapped = b_key.split(".")[0] + "." + KEY.split(".")[1]
    with pytest.raises(InvalidEpisodeKey):
        SIGNER.verify(swapped)
    # a payload edited by hand (longer expiry), signature kept
    edited = {**_payload(KEY), "x": 9e12}
    resigned = KEY_PREFIX + _b64(json.dumps(edited).encode()) + "." + KEY.split(".")[1]
    with pytest.raises(InvalidEpisodeKey):
        SIGNER.verify(resigned)
    now = [1000.0]
    timed = EpisodeKeySigner(ttl_s=10, secret=b"t" * 32, clock=lambda: now[0])
    key, expires = timed.sign("r", "e")
    now[0] = expires
    with pytest.raises(InvalidEpisodeKey) as info:
        timed.verify(key)
    assert info.value.expired


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    with rolling_server(tmp_path_factory.mktemp("keys") / "swarm", JOB) as handle:
        yield handle


@pytest.fixture
def worker(srv: ServerHandle) -> Iterator[SwarmClient]:
    with SwarmClient(srv.url, token=WORKER_TOKEN, timeout=60) as client:
        yield client


def begin(client: SwarmClient) -> BeginEpisodeResponse:
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.open_episode()
        except EngineStateConflict:  # a step is closing; claims reopen at ROLLING
            assert time.monotonic() < deadline
            time.sleep(0.05)


def chat(srv: ServerHandle, key: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", **headers},
                      json={"model": "ajet-tiny", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]})


def refused(response: httpx.Response) -> bool:
    return (response.status_code == 401 and bool(response.json()["hint"])
            and response.json()["error"]["type"] == "authentication_error")


def test_forged_keys_are_refused(srv: ServerHandle, worker: SwarmClient) -> None:
    a, b = begin(worker), begin(worker)
    for key in ("ajep_.", "ajep_", "ajep_e30.AAAA", "sk-" + "a" * 40, WORKER_TOKEN, CONTROL_TOKEN,
                a.openai_api_key[:-1] + ("A" if a.openai_api_key[-1] != "A" else "B"),
                # b's payload under a's signature: "use a's key for episode b"
                b.openai_api_key.split(".")[0] + "." + a.openai_api_key.split(".")[1],
                a.openai_api_key + "x" * 2000):
        assert refused(chat(srv, key)), key[:40]
    assert chat(srv, a.openai_api_key).status_code == 200  # the genuine key still works
    # an episode key is not a bearer token for the worker routes
    r = httpx.post(f"{srv.url}/begin_episode", json={}, timeout=30,
                   headers={"Authorization": f"Bearer {a.openai_api_key}"})
    assert r.status_code == 401
    for episode in (a, b):
        worker.cancel_episode(episode.episode_uuid)


def test_a_key_works_for_its_own_episode_only(srv: ServerHandle, worker: SwarmClient) -> None:
    a, b = begin(worker), begin(worker)
    worker.report_episode(b.episode_uuid, task_id="keys-b", reward=1.0)
    # a's key naming b in the header the gateway sets: the key alone decides the episode
    answer = chat(srv, a.openai_api_key, **{"X-Episode-UUID": b.episode_uuid})
    assert answer.status_code == 200, answer.text
    assert refused(chat(srv, b.openai_api_key))  # b has ended: its own key is void
    worker.cancel_episode(a.episode_uuid)


def test_keys_cannot_be_replayed_after_end_or_abort(srv: ServerHandle,
                                                    worker: SwarmClient) -> None:
    ended, aborted = begin(worker), begin(worker)
    for episode in (ended, aborted):
        assert chat(srv, episode.openai_api_key).status_code == 200
    worker.report_episode(ended.episode_uuid, task_id="keys-replay", reward=0.5)
    worker.cancel_episode(aborted.episode_uuid)
    for episode in (ended, aborted):
        replay = chat(srv, episode.openai_api_key)
        assert refused(replay), replay.text
        assert "ended" in replay.json()["detail"]
    # nor can the episode be ended twice with the worker token
    again = httpx.post(f"{srv.url}/end_episode", headers=WRK, timeout=30, json={
        "episode_uuid": ended.episode_uuid, "task_id": "keys-replay", "reward": 1.0})
    assert again.status_code == 409


def test_keys_of_an_earlier_engine_run_are_refused(srv: ServerHandle,
                                                   worker: SwarmClient) -> None:
    old = begin(worker)
    assert chat(srv, old.openai_api_key).status_code == 200
    with SwarmClient(srv.url, token=CONTROL_TOKEN) as control:
        new_run = control.start_run(force_restart=True, wait=True, wait_timeout=180)
    assert new_run.run_id != old.run_id
    assert refused(chat(srv, old.openai_api_key))
    late = httpx.post(f"{srv.url}/end_episode", headers=WRK, timeout=30, json={
        "episode_uuid": old.episode_uuid, "task_id": "t", "reward": 1.0})
    assert late.status_code == 404 and "run" in late.json()["detail"]
    with pytest.raises(SwarmNotFound, match="belongs to engine run"):  # the typed client
        worker.report_episode(old.episode_uuid, "t", 1.0)
    fresh = begin(worker)
    assert fresh.run_id == new_run.run_id and chat(srv, fresh.openai_api_key).status_code == 200
    worker.cancel_episode(fresh.episode_uuid)
