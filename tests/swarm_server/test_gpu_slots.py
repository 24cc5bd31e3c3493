"""Device slots on a GPU host, with a stand-in `nvidia-smi` (three GPUs: 80, 15 and 80 GB)
and the stand-in engine: the slots are the GPUs (`--devices N` takes the first N), a run
of `n_gpu: 1` holds one and its engine sees only it (`CUDA_VISIBLE_DEVICES`, numbered as
nvidia-smi numbers them), a CPU job holds none and sees none, and the memory planner
checks each run against the smallest GPU it may be given, not against the first GPU of
the machine.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from ajet.copilot.job import AgentJetJob
from swarm_server.devices import DevicePool, detect_gpus, devices_needed
from tests.support.factory import Server, ServerFactory
from tests.support.fake_engine import server_env
from tests.support.harness import wait_until

QWEN_7B = Path(__file__).parents[1] / "ajet" / "engine" / "models" / "Qwen2.5-7B-Instruct"
#: about 42 GiB per GPU: fits an 80 GB GPU, not a 15 GB one
LORA_7B = AgentJetJob(experiment_name="lora", model=str(QWEN_7B), n_gpu=1,
                      lora_rank=16).to_yaml()
ONE_GPU = AgentJetJob(experiment_name="gpu", n_gpu=1).to_yaml()
NO_GPU = AgentJetJob(experiment_name="cpu", n_gpu=0).to_yaml()

_SMI = """#!/bin/sh
case "$*" in
  -L) printf 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\\nGPU 1: Tesla T4 (UUID: GPU-b)\\n'
      printf 'GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-c)\\n' ;;
  *index,memory.total*) printf '0, 81559\\n1, 15360\\n2, 81559\\n' ;;
  *memory.total*) printf '81559\\n15360\\n81559\\n' ;;
  *) exit 2 ;;
esac
"""


@pytest.fixture(scope="module")
def smi_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("smi")
    exe = folder / "nvidia-smi"
    exe.write_text(_SMI)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_the_pool_counts_the_gpus_and_hands_each_run_its_own(smi_path: str) -> None:
    pool = DevicePool.for_host(None, {"PATH": smi_path})
    assert (pool.kind, pool.slots, pool.pci_order) == ("gpu", [0, 1, 2], True)
    assert pool.memory_mib == {0: 81559, 1: 15360, 2: 81559}
    assert pool.acquire("a", 2) == [0, 1] and pool.acquire("b", 2) is None
    assert pool.environment([2]) == {"CUDA_VISIBLE_DEVICES": "2",
                                     "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert pool.environment([]) == {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert pool.planner_env() == {"AJET_ENGINE_GPU_MEMORY_GB": "15.000"}  # the smallest
    # --devices 1: only GPU 0, so the 15 GB one is nobody's
    assert DevicePool.for_host(1, {"PATH": smi_path}).planner_env() == {
        "AJET_ENGINE_GPU_MEMORY_GB": "79.647"}
    # the operator's CUDA_VISIBLE_DEVICES names the slots, in CUDA's own order: which of
    # nvidia-smi's GPUs they are is known only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    chosen = DevicePool.for_host(None, {"PATH": smi_path, "CUDA_VISIBLE_DEVICES": "2,0"})
    assert (chosen.slots, chosen.pci_order) == ([2, 0], False)
    assert chosen.environment([2]) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert chosen.planner_env() == {"AJET_ENGINE_GPU_MEMORY_GB": "15.000"}
    in_pci_order = DevicePool.for_host(None, {"PATH": smi_path, "CUDA_VISIBLE_DEVICES": "2,0",
                                              "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert in_pci_order.planner_env() == {"AJET_ENGINE_GPU_MEMORY_GB": "79.647"}
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == []  # UUIDs: no slots
    assert DevicePool.for_host(3, {"PATH": "/nonexistent"}).kind == "cpu"


def test_what_a_job_needs_by_host() -> None:
    assert devices_needed({"n_gpu": 2}, "gpu") == 2
    assert devices_needed({"n_gpu": 0, "n_proc": 2}, "gpu") == 0  # a CPU job holds no GPU
    assert devices_needed({"n_gpu": 0, "n_proc": 2}, "cpu") == 2
    assert devices_needed({"n_gpu": 4}, "ray") == 0  # Ray's placement group holds them


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory, smi_path: str) -> Server:
    # --devices 2: GPUs 0 (80 GB) and 1 (15 GB); GPU 2 is not the server's
    return server_factory(env=server_env(PATH=smi_path, AJET_SWARM_DEVICES="2"))


def _start(http: httpx.Client, yaml: str, name: str, **extra: Any) -> httpx.Response:
    return http.post("/runs", json={"snapshot_id": "server", "yaml": yaml, "name": name,
                                    **extra})


def _devices_line(http: httpx.Client, run: str) -> str:
    def line() -> str:
        lines = http.get(f"/runs/{run}/logs", params={"grep": "devices:"}).json()["lines"]
        return str(lines[0]) if lines else ""

    wait_until(line, timeout=30)
    return line()


def test_each_run_sees_only_its_gpus_and_a_cpu_job_none(srv: Server) -> None:
    with srv.http_as(None) as http:
        try:
            a, b = _start(http, ONE_GPU, "gpu-a").json(), _start(http, ONE_GPU, "gpu-b").json()
            assert (a["devices"], b["devices"]) == ([0], [1])
            assert "CUDA_VISIBLE_DEVICES=0 " in _devices_line(http, "gpu-a")
            assert "CUDA_VISIBLE_DEVICES=1 " in _devices_line(http, "gpu-b")
            cpu = _start(http, NO_GPU, "on-cpu").json()  # both GPUs held: it needs none
            assert cpu["status"] == "booting" and cpu["devices"] == []
            assert "CUDA_VISIBLE_DEVICES= " in _devices_line(http, "on-cpu")
            waiting = _start(http, ONE_GPU, "gpu-c").json()
            assert waiting["status"] == "queued"
            assert "needs 1 device slot(s); 0 of 2 free" in waiting["queue_reason"]
            never = _start(http, AgentJetJob(n_gpu=3).to_yaml(), "three")
            assert never.status_code == 409 and "could never start" in never.json()["detail"]
            pool = http.get("/runs", params={"state": "active"}).json()["devices"]
            assert pool["kind"] == "gpu" and pool["total"] == 2
        finally:
            for run in ("gpu-c", "gpu-a", "gpu-b", "on-cpu"):
                http.post(f"/runs/{run}/stop", json={"reason": "test done"})


def test_the_planner_checks_a_run_against_the_smallest_gpu_it_may_get(srv: Server) -> None:
    with srv.http_as(None) as http:
        # 42 GiB fits GPU 0, the first; but the run may be given GPU 1 (15 GB)
        refused = _start(http, LORA_7B, "big-lora")
        assert refused.status_code == 422, refused.text
        (error,) = refused.json()["detail"]
        assert error["type"] == "memory_estimate"
        assert error["memory"]["available_gib"] == pytest.approx(15.0)
        assert "AJET_ENGINE_GPU_MEMORY_GB=15.000" in error["msg"]
        # the default run's config is checked the same way
        default = http.post("/sync_train_config", json={"yaml": LORA_7B})
        assert default.status_code == 422 and "15.000" in default.text
        assert http.get("/runs", params={"name": "big-lora"}).json()["runs"] == []
