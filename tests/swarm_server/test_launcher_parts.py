"""The Ray launcher's parts that need no Ray cluster: rank 0's private channel on TCP
(bearer token, same routes, same client code), the multi-node job fields each launcher
accepts, the nodes' memory for the planner, the driver's verdict on who ended a run, and
what the spawner submits (against a stand-in of Ray's Jobs client) and does when the
cluster stops answering.

The channel is the engine's own transport (`ChannelServer` with `BearerGuard`) on a real
port of 127.0.0.1, spoken to by the server's `EngineChannel` and `TcpProbe`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from ajet.engine.transport.unix_server import BearerGuard, ChannelServer
from ajet.protocol import EngineReport, EngineState
from swarm_server.config_check import launcher_problem
from swarm_server.engine_channel import EngineChannel, TcpEndpoint
from swarm_server.launchers.ajet_ray_job.verdict import verdict
from swarm_server.launchers.ajet_ray_job.agent import _code_base
from swarm_server.launchers.ajet_ray_job.wire import SPEC_ENV, marker
from swarm_server.launchers.ray_launcher import RaySpawner, node_memory_env
from swarm_server.settings import Settings
from swarm_server.supervisor import SpawnSpec, TcpProbe

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
    code, detail = verdict(states, infos)
    assert code == 1 and detail.startswith("rank 1 (pid 9) on node 1 (10.0.0.1, host h1")
    clean = [{"exit_code": 0, "first_end": None}, {"exit_code": 0, "first_end": None}]
    assert verdict(clean, infos) == (0, "every node's engine exited with code 0")


def test_under_ray_the_engine_interpreter_must_be_an_absolute_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be an absolute path, the same on every Ray"):
        Settings(workdir=tmp_path, launcher="ray", engine_python="python3")
    assert Settings(workdir=tmp_path, engine_python="python3").launcher == "local"  # default


class _FakeJobs:
    """The part of Ray's `JobSubmissionClient` the spawner uses: the job is placed at once,
    then the Jobs API stops answering (the head lost)."""

    def __init__(self, *, agentless: int = 0) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.agentless = agentless  # submissions answered as by a head just started

    def submit_job(self, **kwargs: Any) -> str:
        if self.agentless > 0:
            self.agentless -= 1
            raise RuntimeError("Request failed with status code 500: No available agent to "
                               "submit job, please try again later.")
        self.submitted.append(kwargs)
        return str(kwargs["submission_id"])

    async def tail_job_logs(self, job_id: str) -> AsyncIterator[str]:
        yield marker("placed", nodes=[{"index": 0, "ip": "10.0.0.1", "node_id": "n" * 12,
                                       "pid": 4242, "start_time": 1.0}]) + "\n"
        yield "[node 0] [rank 0] booting\n"

    def get_job_info(self, job_id: str) -> Any:
        raise ConnectionError("Failed to connect to Ray at address: http://head:8265")

    def stop_job(self, job_id: str) -> bool:
        raise ConnectionError("Failed to connect to Ray at address: http://head:8265")


def _spawn_spec(tmp_path: Path, settings: Settings) -> SpawnSpec:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "job.yaml").write_text("nnodes: 2\nn_proc: 1\n", encoding="utf-8")
    base = tmp_path / "snapshots" / "s1"
    return SpawnSpec(argv=[settings.engine_python, "-m", settings.engine_module, "--run-id",
                           "r1", "--run-dir", str(run_dir), "--socket", str(run_dir / "s")],
                     cwd=run_dir, env={"ISOLATED_AGENTJET_BASE_DIR": str(base),
                                       "HF_HOME": "/h", "PATH": "/server/bin"},
                     log_path=run_dir / "engine.log")


@pytest.mark.parametrize("shared", [False, True])
def test_the_snapshot_travels_as_the_jobs_package_unless_the_workdir_is_shared(
        tmp_path: Path, shared: bool) -> None:
    settings = Settings(workdir=tmp_path, launcher="ray", ray_shared_workdir=shared)
    jobs = _FakeJobs(agentless=1)  # submitted again once the head has its job agent
    spawner = RaySpawner(settings, jobs, unreachable_after_s=0.3)
    spec = _spawn_spec(tmp_path, settings)
    handle = spawner.start(spec)
    (sent,) = jobs.submitted
    runtime_env = sent["runtime_env"]
    run_spec = json.loads(runtime_env["env_vars"][SPEC_ENV])
    base = spec.env["ISOLATED_AGENTJET_BASE_DIR"]
    assert ("working_dir" in runtime_env) is not shared
    assert run_spec["code_base"] == (base if shared else None)
    if not shared:
        assert runtime_env["working_dir"] == base
    assert sent["entrypoint"].startswith(settings.engine_python + " ")
    assert run_spec["nnodes"] == 2 and run_spec["bundle_cpus"] == 1
    assert run_spec["env"] == {"ISOLATED_AGENTJET_BASE_DIR": base, "HF_HOME": "/h"}
    # the Jobs API then stops answering: the run ends, saying so, instead of hanging
    assert spawner.wait(handle, 10) and handle.returncode == 1
    assert handle.detail is not None and "stopped answering for 0.3 s" in handle.detail
    assert "stopped answering" in spec.log_path.read_text(encoding="utf-8")


def test_a_node_without_the_shared_workdir_refuses_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not shared with it.*without --ray-shared-workdir"):
        _code_base(str(tmp_path / "not-mounted-here"))
    (tmp_path / "s1" / "ajet").mkdir(parents=True)
    (tmp_path / "s1" / "ajet" / "__init__.py").write_text("", encoding="utf-8")
    assert _code_base(str(tmp_path / "s1")) == str(tmp_path / "s1")
