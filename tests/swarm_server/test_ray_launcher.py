"""The Ray launcher end to end: one swarm server places a two-node run on a local Ray cluster.

One module-scoped cluster of two raylets on this machine (`tests/support/ray_cluster.py`)
and one server started with `--launcher ray` (through its settings' variables). The run is
`nnodes=2, n_proc=1` on CPU with gloo: rank 0 on one Ray node, rank 1 on the other, its
channel reached over TCP with the run's bearer token.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict, SwarmHTTPError
from ajet.protocol import EngineState
from tests.support import make_ajet_repo, start_server
from bench.ray_cluster import LocalRayCluster, local_ray_cluster
from tests.support.servers import ServerHandle

pytestmark = pytest.mark.slow

JOB = dict(batch_size=1, num_repeat=4, max_new_tokens=8, lr=0.01, seed=3, n_proc=1, nnodes=2)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    with local_ray_cluster(2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def server(ray_cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerHandle]:
    workdir = tmp_path_factory.mktemp("ray-swarm")
    handle = start_server(workdir, env={"AJET_SWARM_LAUNCHER": "ray",
                                        "AJET_SWARM_RAY_ADDRESS": ray_cluster.dashboard_url})
    try:
        with SwarmClient(handle.url, timeout=60) as client:
            client.push_code(make_ajet_repo(workdir.parent / "ray-repo"))
        yield handle
    finally:
        handle.stop()


def _episodes(client: SwarmClient, n: int) -> None:
    import openai

    done = 0
    while done < n:
        try:
            ep = client.open_episode()
        except EngineStateConflict:
            time.sleep(0.05)
            continue
        reply = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.openai_api_key,
                              max_retries=0).chat.completions.create(
            model="ajet-tiny", messages=[{"role": "user", "content": "digits"}])
        text = reply.choices[0].message.content or ""
        share = sum(c.isdigit() for c in text) / len(text) if text else 0.0
        client.report_episode(ep.episode_uuid, "one-task", share)
        done += 1


def _engine_processes(run_id: str) -> list[psutil.Process]:
    """The run's engine processes (torchrun and its ranks), told apart from Ray's own
    (raylets, workers, the NodeAgent actors) by the run id on their command line."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if run_id in cmdline and "--run-dir" in cmdline:
            found.append(proc)
    return found


def _ray_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name", "cmdline"])
            if "raylet" in (p.info["name"] or "") or any("raylet" in part for part in
                                                         p.info["cmdline"] or [])]


def _live_groups(cluster: LocalRayCluster, run_id: str) -> int:
    """The run's placement groups that hold resources (Ray's state API)."""
    reply = httpx.get(f"{cluster.dashboard_url}/api/v0/placement_groups", timeout=10,
                      params={"limit": 100})
    reply.raise_for_status()
    return sum(1 for pg in reply.json()["data"]["result"]["result"]
               if pg["name"] == f"ajet-{run_id}" and pg["state"] != "REMOVED")


def _wait_offline(client: SwarmClient, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (now := client.engine_status()).state != EngineState.OFFLINE:
        assert time.monotonic() < deadline, f"still {now.state}"
        time.sleep(0.2)
    return now


def test_multi_node_fields_follow_the_launcher(server: ServerHandle) -> None:
    with SwarmClient(server.url, timeout=60) as client:
        with pytest.raises(SwarmHTTPError) as refused:
            client.check_config(AgentJetJob(**{**JOB, "rdzv_endpoint": "10.0.0.1:29500"}))
        assert refused.value.status == 422
        assert "cannot be set under the Ray launcher" in str(refused.value.detail)
        accepted = client.check_config(AgentJetJob(**JOB))
        assert accepted.config["nnodes"] == 2
        # the planner counted the memory Ray reports for its nodes, not this machine's
        assert accepted.memory is not None
        assert "AJET_ENGINE_HOST_MEMORY_GB=" in accepted.memory["available_source"]


def test_a_run_the_cluster_cannot_hold_is_refused_with_what_is_free(
        server: ServerHandle) -> None:
    with SwarmClient(server.url, timeout=60) as client:
        client.submit_config(AgentJetJob(**{**JOB, "nnodes": 3}))
        with pytest.raises(SwarmHTTPError) as refused:
            client.start_run()
        assert refused.value.status == 409, refused.value
        detail = str(refused.value.detail)
        assert "needs 3 node(s) each with CPU 1 free" in detail and "free now:" in detail
        status = client.engine_status()
        assert status.state == EngineState.OFFLINE
        assert status.last_error is not None and "cannot hold" in status.last_error.reason
        # beside other runs: no idle cluster of two nodes holds three, so no queue either
        with pytest.raises(SwarmHTTPError) as never:
            client.start_run(AgentJetJob(**{**JOB, "nnodes": 3}), name="three-nodes")
        assert never.value.status == 409 and "cannot hold" in str(never.value.detail)
        assert client.list_runs(state="active").devices.queued == []  # type: ignore[union-attr]


def test_two_nodes_generate_train_log_and_stop(server: ServerHandle,
                                               ray_cluster: LocalRayCluster) -> None:
    steps = 2
    with SwarmClient(server.url, timeout=60) as client:
        started = time.monotonic()
        status = client.configure_and_start(AgentJetJob(**JOB), wait_timeout=300)
        boot_s = time.monotonic() - started
        run_id = status.run_id
        assert run_id is not None
        _episodes(client, steps * JOB["num_repeat"])
        deadline = time.monotonic() + 120
        while len(points := client.get_metrics().points) < steps:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert all(p["episodes"] == JOB["num_repeat"] for p in points)
        assert len(_engine_processes(run_id)) >= 4  # two torchruns, two ranks
        assert _live_groups(ray_cluster, run_id) == 1
        # rank 0's TCP channel answers the run's bearer token only
        live = "\n".join(client.get_run_logs(run_id, tail=2000).lines)
        found = re.search(r"rank 0's channel: ([\d.]+):(\d+) \(TCP, bearer token\)", live)
        assert found, live[-2000:]
        url = f"http://{found[1]}:{found[2]}/status"
        assert httpx.get(url, timeout=5).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer " + "x" * 43},
                         timeout=5).status_code == 401
        stopped = client.stop_run()
        assert stopped.stopped
        logs = client.get_run_logs(run_id, tail=2000).lines
    text = "\n".join(logs)
    # both ranks, each line naming its node and rank, on two different Ray nodes
    assert any(line.startswith("[node 0] [rank 0]") for line in logs), text[-3000:]
    assert any(line.startswith("[node 1] [rank 1]") for line in logs), text[-3000:]
    placed = re.search(r"placed on 2 node\(s\): node 0: \S+ \(Ray node (\w+).*node 1: \S+ "
                       r"\(Ray node (\w+)", text)
    assert placed and placed[1] != placed[2], text[:3000]
    # rank 0 routed episodes to both ranks, and rank 1's generator answered its share
    routed = re.search(r"generation per rank: 0: (\d+) request\(s\), 1: (\d+) request", text)
    assert routed and int(routed[1]) > 0 and int(routed[2]) > 0, text[-3000:]
    trained = re.search(r"\[node 1\] \[rank 1\].*rank 1 stopped after (\d+) step\(s\); it "
                        r"generated (\d+) reply", text)
    assert trained and int(trained[1]) >= steps and int(trained[2]) == int(routed[2])
    # nothing of the engine is left; Ray's own processes are, and the group is gone
    deadline = time.monotonic() + 30
    while _engine_processes(run_id):
        assert time.monotonic() < deadline, _engine_processes(run_id)
        time.sleep(0.2)
    assert len(_ray_processes()) >= 2
    assert _live_groups(ray_cluster, run_id) == 0
    print(f"\nray launcher: two-node boot to ROLLING {boot_s:.1f} s, cluster start-up "
          f"{ray_cluster.startup_s:.1f} s")


def test_killing_one_nodes_rank_takes_the_run_offline_naming_it(
        server: ServerHandle, ray_cluster: LocalRayCluster) -> None:
    with SwarmClient(server.url, timeout=60) as client:
        status = client.configure_and_start(AgentJetJob(**JOB), wait_timeout=300)
        run_id = status.run_id
        assert run_id is not None
        victims = [p for p in _engine_processes(run_id)
                   if p.environ().get("RANK") == "1" and "torch.distributed.run"
                   not in p.cmdline()]
        assert len(victims) == 1, victims
        os.kill(victims[0].pid, signal.SIGKILL)
        now = _wait_offline(client)
        assert now.last_error is not None
        reason = now.last_error.reason
        assert re.search(rf"rank 1 \(pid {victims[0].pid}\) on node 1 \(", reason), reason
        deadline = time.monotonic() + 30
        while _engine_processes(run_id):
            assert time.monotonic() < deadline, _engine_processes(run_id)
            time.sleep(0.2)
        assert client.get_run(run_id).status == "failed"
        assert _live_groups(ray_cluster, run_id) == 0
