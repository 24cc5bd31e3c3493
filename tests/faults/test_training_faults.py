"""Faults with the real engine (ajet-tiny on CPU): fifty rollout workers with random
aborts and hangs, a worker that vanishes mid-episode, and SIGKILL during the update.

Exactly-once accounting reads the engine's own counters on its private channel (the
`GET /status` report the server polls) and its metrics.jsonl: every episode the workers
ended is in the engine's `episodes_ended` once, every ended episode is either trained
(in exactly one step's `episodes`) or still waiting for its group, never both.
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict
from ajet.protocol import BeginEpisodeResponse, EngineState
from ajet.rollout import RolloutRunner, WorkflowOutput
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, rolling_server
from tests.support.invariants import assert_consistent, wait_status

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0  # episode idle timeout: short, so hung and vanished workers cost little
JOB = AgentJetJob(experiment_name="faults", batch_size=4, num_repeat=2, max_new_tokens=4,
                  episode_timeout_s=TIMEOUT_S)
CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
WRK = {"Authorization": f"Bearer {WORKER_TOKEN}"}


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerHandle]:
    env = {"AJET_SWARM_STATUS_POLL_S": "0.05", "AJET_SWARM_STOP_GRACE_S": "10"}
    # A short work directory: `engine_report` reads the socket at `<run dir>/engine.sock`,
    # where the server puts it only while that path fits a Unix socket address (pytest's
    # temp dirs under xdist are longer).
    with tempfile.TemporaryDirectory(prefix="ajet-faults-") as workdir, \
            rolling_server(Path(workdir) / "swarm", JOB, env=env) as handle:
        yield handle


def engine_report(srv: ServerHandle) -> dict[str, Any]:
    """The engine's own report, read on its private socket (as the server reads it)."""
    status = httpx.get(f"{srv.url}/get_engine_status", headers=CTL, timeout=30).json()
    socket = srv.workdir / "runs" / status["run_id"] / "engine.sock"
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=30) as engine:
        return engine.get("http://engine/status").json()


def quiet_report(srv: ServerHandle, batch_size: int) -> dict[str, Any]:
    """Wait until nothing is in flight and no step can run; the counters then stand still."""
    deadline = time.monotonic() + 60
    previous: dict[str, Any] | None = None
    while True:
        report = engine_report(srv)
        info = report["info"]
        counters = {k: v for k, v in info.items() if k.startswith(("episodes_", "groups_"))}
        settled = (report["state"] == EngineState.ROLLING.value
                   and info["episodes_in_flight"] == 0 and info["groups_ready"] < batch_size)
        if settled and previous == counters:
            return report
        previous = counters if settled else None
        assert time.monotonic() < deadline, f"engine never settled: {report}"
        time.sleep(TIMEOUT_S / 4)


def metric_lines(srv: ServerHandle, run_id: str) -> list[dict[str, Any]]:
    text = (srv.workdir / "runs" / run_id / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]  # every line whole JSON


def chat(http: httpx.Client, episode: BeginEpisodeResponse) -> httpx.Response:
    return http.post(f"{episode.openai_base_url}/chat/completions",
                     headers={"Authorization": f"Bearer {episode.openai_api_key}"},
                     json={"model": "ajet-tiny", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "add 2 and 3"}]})


def begin(client: SwarmClient) -> BeginEpisodeResponse:
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.open_episode()
        except EngineStateConflict:
            assert time.monotonic() < deadline, "begin_episode kept answering 409"
            time.sleep(0.05)


# ---------------------------------------------------------------------------- 50 workers


def test_fifty_workers_with_random_aborts_and_hangs_count_each_episode_once(
        srv: ServerHandle) -> None:
    start = engine_report(srv)
    run_id = start["run_id"]
    steps_before = len(metric_lines(srv, run_id))
    rng = random.Random(8)
    rng_lock = threading.Lock()
    statuses: list[int] = []
    hangs = [0]

    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=64)) as http:

        def workflow(task: dict[str, Any], episode: BeginEpisodeResponse) -> WorkflowOutput:
            with rng_lock:
                roll = rng.random()
            if roll < 0.2:
                raise RuntimeError("random abort")  # the runner aborts the episode
            if roll < 0.25:
                hangs[0] += 1
                time.sleep(TIMEOUT_S + 1.0)  # idle past the timeout: the engine re-queues it
                return WorkflowOutput(reward=0.0)  # its end_episode gets 409: redone
            reply = chat(http, episode)
            statuses.append(reply.status_code)
            reply.raise_for_status()
            return WorkflowOutput(reward=float(len(reply.json()["choices"][0]["message"]
                                                   ["content"]) % 3), is_success=roll > 0.5)

        tasks = [{"task_id": f"task-{i}"} for i in range(6)]
        with SwarmClient(srv.url, token=WORKER_TOKEN, timeout=60) as worker:
            runner = RolloutRunner(worker, workflow, tasks, n_workers=50, num_repeat=2,
                                   max_attempts=1000)
            runner.start()
            deadline = time.monotonic() + 90
            # until a hung episode has come back and been redone: one still asleep when
            # the runner stops is aborted as stopped, not counted as re-queued
            while (len(metric_lines(srv, run_id)) < steps_before + 4 or hangs[0] < 2
                   or runner.stats().episodes_requeued < 1):
                assert time.monotonic() < deadline, runner.stats()
                assert runner.running(), runner.stats()
                time.sleep(0.2)
            runner.stop(timeout=60)
            stats = runner.stats()

    assert not stats.running
    report = quiet_report(srv, JOB.batch_size)
    info, before = report["info"], start["info"]
    ended = info["episodes_ended"] - before["episodes_ended"]
    lines = metric_lines(srv, run_id)
    # every episode a worker ended reached the engine exactly once ...
    assert ended == stats.episodes_ended > 0, (info, stats)
    # ... and is trained in exactly one step, or still waits for its group
    assert info["episodes_ended"] == info["episodes_trained"] + info["episodes_waiting"]
    assert sum(line["episodes"] for line in lines) == info["episodes_trained"]
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert info["episodes_claimed"] == (info["episodes_ended"] + info["episodes_aborted"]
                                        + info["episodes_timed_out"])
    assert info["episodes_timed_out"] - before["episodes_timed_out"] >= 1  # the hangs
    assert stats.episodes_requeued >= 1 and stats.workflow_errors >= 1
    # no 5xx on the chat path; a refusal can only be a key whose episode timed out
    assert 200 in statuses and set(statuses) <= {200, 401}, sorted(set(statuses))


# ---------------------------------------------------------------------------- vanishing


def test_a_vanished_worker_times_out_and_its_slot_is_requeued(srv: ServerHandle) -> None:
    quiet_report(srv, JOB.batch_size)
    slots = engine_report(srv)["info"]["max_in_flight"]
    with SwarmClient(srv.url, token=WORKER_TOKEN) as worker, httpx.Client(timeout=60) as http:
        # every slot claimed by a worker that chats once and is never heard from again;
        # claimed at once, so the first claim cannot time out (TIMEOUT_S) before the
        # last is made on a loaded machine
        with ThreadPoolExecutor(max_workers=slots) as pool:
            gone = list(pool.map(lambda _: begin(worker), range(slots)))
        full = httpx.post(f"{srv.url}/begin_episode", json={}, headers=WRK, timeout=30)
        assert full.status_code == 409 and "slots" in full.json()["detail"]
        assert chat(http, gone[0]).status_code == 200

        fresh = begin(worker)  # waits (409s) until the idle claims time out
        report = engine_report(srv)["info"]
        assert report["episodes_in_flight"] == 1
        for episode in gone:
            late = httpx.post(f"{srv.url}/end_episode", headers=WRK, timeout=30, json={
                "episode_uuid": episode.episode_uuid, "task_id": "t", "reward": 1.0})
            assert late.status_code == 409 and "timed out" in late.json()["detail"], late.text
        assert chat(http, gone[0]).status_code == 401  # its key died with it
        worker.cancel_episode(fresh.episode_uuid)


# ---------------------------------------------------------------------------- kill


def test_engine_sigkilled_during_the_update(srv: ServerHandle) -> None:
    # a long update (many PPO epochs), so the kill lands inside WEIGHT_SYNCING
    slow = JOB.model_copy(update={"ppo_epochs": 100, "max_new_tokens": 16})
    with SwarmClient(srv.url, token=CONTROL_TOKEN) as control:
        status = control.configure_and_start(slow, force_restart=True,
                                                                 wait_timeout=180)
    run_id, pid = status.run_id, status.pid
    assert run_id is not None and pid is not None

    def workflow(task: dict[str, Any], episode: BeginEpisodeResponse) -> float:
        chat(http, episode).raise_for_status()  # completions: the update has work to do
        return 1.0 if task["task_id"] == "a" else 0.0

    with SwarmClient(srv.url, token=WORKER_TOKEN) as worker, httpx.Client(timeout=60) as http:
        runner = RolloutRunner(worker, workflow, [{"task_id": "a"}, {"task_id": "b"}],
                               n_workers=4, num_repeat=2)
        runner.start()
        try:
            wait_status(srv.url, EngineState.WEIGHT_SYNCING, headers=CTL, timeout=120)
            os.kill(pid, signal.SIGKILL)
            after = assert_consistent(srv.url, srv.workdir, engine_pids=[pid],
                                      died="killed by SIGKILL", headers=CTL)
        finally:
            runner.stop(timeout=30)
    assert after.last_error is not None and after.last_error.run_id == run_id
    assert "ENGINE.WEIGHT_SYNCING" in after.last_error.reason
    run_dir = srv.workdir / "runs" / run_id
    metric_lines(srv, run_id)  # whole lines only, whatever the kill interrupted
    checkpoints = [p for p in (run_dir / "checkpoints").glob("*")] if (
        run_dir / "checkpoints").is_dir() else []
    assert all(p.name.endswith(".partial") or (p / "ajet_checkpoint.json").is_file()
               for p in checkpoints)
    assert not (run_dir / "final").exists()  # no final checkpoint pretends it finished
    r = httpx.post(f"{srv.url}/begin_episode", json={}, headers=WRK, timeout=30)
    assert r.status_code == 409
    # and the next start works on the same config
    with SwarmClient(srv.url, token=CONTROL_TOKEN) as control:
        again = control.start_run(wait=True, wait_timeout=180)
        assert again.state is EngineState.ROLLING and again.run_id != run_id
        control.stop_run()
