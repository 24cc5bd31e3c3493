"""The Ray launcher end to end: one swarm server places two-node runs on a local Ray cluster.

One module-scoped cluster of two raylets on this machine (`bench/ray_cluster.py`), with
Ray's token authentication on, and a server started with `ajet-swarm start --launcher ray
--ray-address ...` (a second one with `--ray-shared-workdir` for the rank-kill test). The
runs are `nnodes=2, n_proc=1` on CPU with gloo: rank 0 on one Ray node, rank 1 on the
other, rank 0's channel reached over TCP with the run's bearer token. The two-node run is
driven through the MCP bridge's tools. The head has two CPUs and the other node one, so
only `STRICT_SPREAD` puts the two one-CPU bundles on different nodes. The last test
removes a node: nothing runs on the cluster after it.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict, SwarmHTTPError
from ajet.protocol import EngineState
from bench.ray_cluster import LocalRayCluster, local_ray_cluster
from mcp_bridge import tools
from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.models import ApprovalMode
from tests.support import make_ajet_repo, start_server
from tests.support.servers import ServerHandle

SERVING = ("ENGINE.ROLLING", "ENGINE.ROLLING_POST", "ENGINE.WEIGHT_SYNCING")
pytestmark = pytest.mark.slow

JOB = dict(batch_size=1, num_repeat=4, max_new_tokens=8, lr=0.01, seed=3, n_proc=1, nnodes=2)
RAY_TOKEN = secrets.token_urlsafe(32)
#: In the server's environment only: off the allow-list, it must not reach a rank
SERVER_SECRET = ("AWS_SECRET_ACCESS_KEY", "ray-test-cloud-secret")
#: In the server's environment only, on the allow-list (`HF_`): every rank gets it
ALLOWED = ("HF_AJET_RAY_TEST_MARK", "allow-listed-through-ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    with local_ray_cluster(2, head_cpus=2, auth_token=RAY_TOKEN) as cluster:
        yield cluster


def _start(cluster: LocalRayCluster, workdir: Path, *flags: str) -> ServerHandle:
    handle = start_server(
        workdir, env={**cluster.client_env, SERVER_SECRET[0]: SERVER_SECRET[1],
                      ALLOWED[0]: ALLOWED[1]},
        args=["--launcher", "ray", "--ray-address", cluster.dashboard_url, *flags])
    try:
        with SwarmClient(handle.url, timeout=60) as client:
            client.push_code(make_ajet_repo(workdir.parent / f"{workdir.name}-repo"))
    except BaseException:
        handle.stop()
        raise
    return handle


@pytest.fixture(scope="module")
def server(ray_cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerHandle]:
    handle = _start(ray_cluster, tmp_path_factory.mktemp("ray-swarm"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def shared_server(ray_cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerHandle]:
    """A server whose work directory every node sees (they all are this machine)."""
    handle = _start(ray_cluster, tmp_path_factory.mktemp("ray-shared"), "--ray-shared-workdir")
    try:
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


def _rank(run_id: str, rank: int) -> psutil.Process:
    found = [p for p in _engine_processes(run_id)
             if p.environ().get("RANK") == str(rank)
             and "torch.distributed.run" not in p.cmdline()]
    assert len(found) == 1, found
    return found[0]


def _ray_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name", "cmdline"])
            if "raylet" in (p.info["name"] or "") or any("raylet" in part for part in
                                                         p.info["cmdline"] or [])]


def _live_groups(cluster: LocalRayCluster, run_id: str) -> int:
    """The run's placement groups that hold resources (Ray's state API)."""
    reply = httpx.get(f"{cluster.dashboard_url}/api/v0/placement_groups", timeout=10,
                      params={"limit": 100}, headers=cluster.headers)
    reply.raise_for_status()
    return sum(1 for pg in reply.json()["data"]["result"]["result"]
               if pg["name"] == f"ajet-{run_id}" and pg["state"] != "REMOVED")


def _wait_offline(client: SwarmClient, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (now := client.engine_status()).state != EngineState.OFFLINE:
        assert time.monotonic() < deadline, f"still {now.state}"
        time.sleep(0.2)
    return now


def _wait_no_engine(run_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _engine_processes(run_id):
        assert time.monotonic() < deadline, _engine_processes(run_id)
        time.sleep(0.2)


def _imported(text: str) -> dict[int, tuple[str, str]]:
    """Each rank's `ajet from <path> (content id <id>)` line: rank -> (path, id)."""
    return {int(m[1]): (m[2], m[3]) for m in re.finditer(
        r"\[node \d\] \[rank (\d)\] .*ajet from (\S+) \(content id (\w+)\)", text)}


def test_multi_node_fields_follow_the_launcher(server: ServerHandle,
                                               ray_cluster: LocalRayCluster) -> None:
    # the cluster enforces Ray's token: the server got in with it (it started, it reads
    # the nodes' memory below)
    assert httpx.get(f"{ray_cluster.dashboard_url}/api/jobs/", timeout=10).status_code in (401,
                                                                                          403)
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


@pytest.fixture
def bridge(server: ServerHandle, tmp_path: Path) -> Iterator[Bridge]:
    """The MCP bridge's state, its tools called as functions (as an MCP client would)."""
    b = Bridge(BridgeConfig(swarm_url=server.url, repo=tmp_path, approval=ApprovalMode.AUTO,
                            approvals_dir=tmp_path / "approvals", start_wait_s=300.0))
    try:
        yield b
    finally:
        b.close()


def test_two_nodes_generate_train_log_and_stop_through_the_bridge(
        server: ServerHandle, ray_cluster: LocalRayCluster, bridge: Bridge) -> None:
    steps = 2
    with SwarmClient(server.url, timeout=60) as client:
        started = time.monotonic()
        assert tools.configure(bridge, JOB, reset=True).config["nnodes"] == 2
        start = tools.start_engine(bridge)
        boot_s = time.monotonic() - started
        assert start.status == "running", start.message
        run_id = start.run_id
        assert run_id is not None
        # every rank runs the active snapshot: same content id, imported from Ray's copy
        text = "\n".join(client.get_run_logs(run_id, tail=2000).lines)
        imported = _imported(text)
        assert sorted(imported) == [0, 1], text[-3000:]
        for path, ident in imported.values():
            assert ident == start.snapshot_id[:12] and "runtime_resources" in path, path
            assert not path.startswith(str(server.workdir))
        # the entrypoint names the engine's interpreter by its absolute path
        job = httpx.get(f"{ray_cluster.dashboard_url}/api/jobs/ajet-{run_id}", timeout=10,
                        headers=ray_cluster.headers).json()
        assert job["entrypoint"].split()[0] == sys.executable and os.path.isabs(sys.executable)
        # the ranks get the local launcher's allow-list of the server's environment, and
        # never Ray's token
        for rank in (0, 1):
            env = _rank(run_id, rank).environ()
            assert env.get(ALLOWED[0]) == ALLOWED[1]
            assert SERVER_SECRET[0] not in env and "RAY_AUTH_TOKEN" not in env
            assert not any(RAY_TOKEN in value for value in env.values())

        _episodes(client, steps * JOB["num_repeat"])
        deadline = time.monotonic() + 120
        while (metrics := tools.read_metrics(bridge)[0]).total_steps < steps:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert all(p["episodes"] == JOB["num_repeat"] for p in client.get_metrics().points)
        status = tools.engine_status(bridge)
        # serving: the last step's metrics line can come before its weights are published
        assert status.engine_state in SERVING and status.run_id == run_id
        listed = tools.list_runs(bridge, state="active")
        assert listed.devices is not None and listed.devices.kind == "ray"
        assert "on a Ray cluster" in listed.message
        both = tools.read_logs(bridge, grep="[node 1] [rank 1]", tail=20)
        assert both.lines and all(ln.startswith("[node 1] [rank 1]") for ln in both.lines)
        assert tools.read_logs(bridge, grep="[node 0] [rank 0]", tail=20).lines
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
        stopped = tools.stop_engine(bridge)
        assert stopped.stopped and stopped.engine_state == "ENGINE.OFFLINE"
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
    assert metrics.total_steps >= steps
    # nothing of the engine is left; Ray's own processes are, and the group is gone
    _wait_no_engine(run_id)
    assert len(_ray_processes()) >= 2
    assert _live_groups(ray_cluster, run_id) == 0
    print(f"\nray launcher: two-node boot to ROLLING {boot_s:.1f} s, cluster start-up "
          f"{ray_cluster.startup_s:.1f} s")


def test_killing_one_nodes_rank_takes_the_run_offline_naming_it(
        shared_server: ServerHandle, ray_cluster: LocalRayCluster) -> None:
    with SwarmClient(shared_server.url, timeout=60) as client:
        status = client.configure_and_start(AgentJetJob(**JOB), wait_timeout=300)
        run_id = status.run_id
        assert run_id is not None
        # the shared work directory: every rank imports the snapshot where the server keeps it
        imported = _imported("\n".join(client.get_run_logs(run_id, tail=2000).lines))
        assert sorted(imported) == [0, 1]
        for path, ident in imported.values():
            assert path.startswith(str(shared_server.workdir)) and "runtime_resources" not in path
            assert ident == status.snapshot_id[:12]
        victim = _rank(run_id, 1)
        os.kill(victim.pid, signal.SIGKILL)
        _assert_failed_naming(client, ray_cluster, run_id,
                              rf"rank 1 \(pid {victim.pid}\) on node 1 \(")


def test_losing_a_node_takes_the_run_offline_naming_it(
        server: ServerHandle, ray_cluster: LocalRayCluster) -> None:
    """Last in the module: the cluster keeps only its head afterwards."""
    cluster = ray_cluster.cluster
    with SwarmClient(server.url, timeout=60) as client:
        status = client.configure_and_start(AgentJetJob(**JOB), wait_timeout=300)
        run_id = status.run_id
        assert run_id is not None
        text = "\n".join(client.get_run_logs(run_id, tail=2000).lines)
        where = dict(re.findall(r"node (\d): \S+ \(Ray node (\w+)", text))
        (worker,) = cluster.worker_nodes  # type: ignore[attr-defined]
        (index,) = [int(i) for i, ray_id in where.items() if worker.node_id.startswith(ray_id)]
        cluster.remove_node(worker, allow_graceful=False)  # type: ignore[attr-defined]
        _assert_failed_naming(client, ray_cluster, run_id,
                              rf"rank {index} on node {index} \(.*\) was lost", timeout=120)


def _assert_failed_naming(client: SwarmClient, cluster: LocalRayCluster, run_id: str,
                          pattern: str, *, timeout: float = 90.0) -> None:
    """The run went OFFLINE as failed, its reason matching `pattern`, and left no engine
    process and no placement group."""
    now = _wait_offline(client, timeout=timeout)
    assert now.last_error is not None
    assert re.search(pattern, now.last_error.reason), now.last_error.reason
    _wait_no_engine(run_id)
    assert client.get_run(run_id).status == "failed"
    assert _live_groups(cluster, run_id) == 0
