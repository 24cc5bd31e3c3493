"""The Ray launcher's parts that need no Ray cluster: rank 0's private channel on TCP
(bearer token, same routes, same client code), the multi-node job fields each launcher
accepts, the nodes' memory for the planner, and the driver's verdict on who ended a run.

The channel is the engine's own transport (`ChannelServer` with `BearerGuard`) on a real
port of 127.0.0.1, spoken to by the server's `EngineChannel` and `TcpProbe`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request

from ajet.engine.transport.unix_server import BearerGuard, ChannelServer
from ajet.protocol import EngineReport, EngineState
from swarm_server.config_check import launcher_problem
from swarm_server.engine_channel import EngineChannel, TcpEndpoint
from swarm_server.launchers.ajet_ray_job.__main__ import _verdict
from swarm_server.launchers.ray_launcher import node_memory_env
from swarm_server.settings import Settings
from swarm_server.supervisor import TcpProbe

TOKEN = "t" * 43


@pytest.fixture(scope="module")
def endpoint() -> Iterator[TcpEndpoint]:
    app = FastAPI()
    seen: list[str] = []

    @app.get("/status")
    async def status() -> EngineReport:
        return EngineReport(state=EngineState.ROLLING, pid=os.getpid(), ajet_file="x", step=3)

    @app.post("/begin_episode")
    async def begin(request: Request) -> dict[str, object]:
        body = await request.json()
        seen.append(body["task_id"])
        return {"episode_uuid": "e-1", "seen": len(seen)}

    server = ChannelServer(BearerGuard(app, TOKEN), tcp_host="127.0.0.1")
    server.start()
    assert server.tcp_address is not None
    host, port = server.tcp_address
    try:
        yield TcpEndpoint(host, port, TOKEN)
    finally:
        server.stop()


def test_the_channel_answers_only_requests_bearing_the_token(endpoint: TcpEndpoint) -> None:
    url = f"http://{endpoint}/status"
    assert httpx.get(url, timeout=5).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer " + "u" * 43}, timeout=5)
    assert wrong.status_code == 401 and wrong.json()["hint"]
    # refused before the app read the body: a large body does not get through either
    big = httpx.post(f"http://{endpoint}/begin_episode", content=b"x" * 1_000_000, timeout=5)
    assert big.status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=5).status_code == 200


def test_the_server_probe_and_channel_reach_rank_0_over_tcp(endpoint: TcpEndpoint) -> None:
    probe = TcpProbe(endpoint)
    try:
        report = probe.get_report()
        assert report is not None and report.step == 3 and report.state is EngineState.ROLLING
        assert probe.get_report() is not None  # the same keep-alive connection again
    finally:
        probe.close()
    assert TcpProbe(TcpEndpoint(endpoint.host, endpoint.port, "z" * 43)).get_report() is None

    async def episodes() -> list[int]:
        channel = EngineChannel(endpoint, timeout_s=5)
        try:
            out = []
            for i in range(3):
                reply, body = await channel.request("POST", "/begin_episode",
                                                    f'{{"task_id": "t{i}"}}'.encode())
                assert reply.status == 200, body
                out.append(reply.status)
            return out
        finally:
            channel.close()

    assert asyncio.run(episodes()) == [200, 200, 200]
    assert "token" not in repr(endpoint) and TOKEN not in repr(endpoint)


def test_multi_node_fields_each_launcher_accepts(tmp_path: Path) -> None:
    local = Settings(workdir=tmp_path)
    ray = Settings(workdir=tmp_path, launcher="ray")
    two = {"nnodes": 2, "n_gpu": 8, "node_rank": 0, "rdzv_endpoint": None}
    assert "rdzv_endpoint (host:port) is required" in (launcher_problem(local, two) or "")
    assert launcher_problem(local, {**two, "rdzv_endpoint": "10.0.0.1:29500"}) is None
    assert launcher_problem(ray, two) is None
    refused = launcher_problem(ray, {**two, "node_rank": 1, "rdzv_endpoint": "h:1"}) or ""
    assert "node_rank=1 and rdzv_endpoint=h:1 cannot be set under the Ray launcher" in refused


def test_the_planner_gets_the_smallest_nodes_memory() -> None:
    nodes = [
        {"raylet": {"state": "ALIVE"}, "mem": [64 * 2**30, 1, 0, 0],
         "gpus": [{"memory_total": 81_559}, {"memory_total": 40_960}]},
        {"raylet": {"state": "ALIVE"}, "mem": [32 * 2**30, 1, 0, 0], "gpus": []},
        {"raylet": {"state": "DEAD"}, "mem": [1 * 2**30, 1, 0, 0]},
    ]
    assert node_memory_env(nodes) == {"AJET_ENGINE_HOST_MEMORY_GB": "32.000",
                                      "AJET_ENGINE_GPU_MEMORY_GB": "40.000"}
    assert node_memory_env([]) == {}


def test_the_driver_names_the_rank_that_ended_first() -> None:
    infos = [{"index": i, "ip": "10.0.0.%d" % i, "host": f"h{i}", "node_id": f"{i}" * 12}
             for i in range(2)]
    states = [{"exit_code": 1, "first_end": {"rank": 0, "pid": 7, "at": 20.0}},
              {"exit_code": 1, "first_end": {"rank": 1, "pid": 9, "at": 10.0}}]
    code, detail = _verdict(states, infos)
    assert code == 1 and detail.startswith("rank 1 (pid 9) on node 1 (10.0.0.1, host h1")
    clean = [{"exit_code": 0, "first_end": None}, {"exit_code": 0, "first_end": None}]
    assert _verdict(clean, infos) == (0, "every node's engine exited with code 0")
