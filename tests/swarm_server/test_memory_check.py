"""The memory planner at config time, through a real server: a job that cannot fit is
refused (422) before anything starts, with the estimate, the memory available and the
changes that fit; the planner runs from the active snapshot, so a synced patch counts."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import yaml

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from tests.support import ServerHandle, make_ajet_repo, start_server

QWEN_7B = Path(__file__).parents[1] / "ajet" / "engine" / "models" / "Qwen2.5-7B-Instruct"
#: the headline job (docs/design.md): Qwen2.5-7B-Instruct full fine-tuning, 32 x 4, 2k + 2k
HEADLINE = (f"experiment_name: headline\nmodel: {QWEN_7B}\nbatch_size: 32\nnum_repeat: 4\n"
            "max_prompt_length: 2048\nmax_response_length: 2048\n")


def _fake_nvidia_smi(folder: Path) -> Path:
    """An `nvidia-smi` that reports eight H100 80GB, as on the cluster's GPU nodes."""
    folder.mkdir(parents=True)
    exe = folder / "nvidia-smi"
    exe.write_text("#!/bin/sh\nfor i in 1 2 3 4 5 6 7 8; do echo 81559; done\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    root = tmp_path_factory.mktemp("memory")
    path = f"{_fake_nvidia_smi(root / 'bin')}{os.pathsep}{os.environ['PATH']}"
    # and a GPU node's host memory (this machine may have less than eight GPUs' worth)
    handle = start_server(root / "swarm", env={"PATH": path, "AJET_ENGINE_HOST_MEMORY_GB": "2048"})
    yield handle
    handle.stop()


def _submit(server: ServerHandle, yaml_text: str) -> httpx.Response:
    return httpx.post(f"{server.url}/sync_train_config", json={"yaml": yaml_text}, timeout=60)


def test_the_headline_job_on_one_gpu_is_refused_with_the_numbers(gpu_server: ServerHandle
                                                                 ) -> None:
    assert _submit(gpu_server, "experiment_name: before\n").status_code == 200
    r = _submit(gpu_server, HEADLINE + "n_gpu: 1\n")
    assert r.status_code == 422, r.text
    body = r.json()
    (error,) = body["detail"]
    assert error["type"] == "memory_estimate"
    for line in ("AdamW moments (fp32)", "gradients (fp32)", "activations (8192 tokens",
                 "generation copy (bf16)", "available: 79.65 GiB (nvidia-smi, 8 GPU(s) visible)",
                 "short by"):
        assert line in error["msg"], error["msg"]
    memory = error["memory"]
    assert memory["fits"] is False and memory["peak_gib"] > memory["available_gib"]
    assert memory["available_gib"] == pytest.approx(81559 / 1024, abs=0.01)
    assert "n_gpu: 8 (FSDP2 over 8 GPUs)" in body["hint"]
    assert "lora_rank: 16 (LoRA)" in body["hint"]
    assert "nothing was changed" in body["hint"]
    # refused before anything started: the previous config stays, no run was made
    with SwarmClient(gpu_server.url) as client:
        assert client.get_train_config().experiment_name == "before"
    assert httpx.get(f"{gpu_server.url}/runs").json()["runs"] == []


def test_the_same_job_on_8_gpus_is_accepted_with_its_estimate(gpu_server: ServerHandle
                                                              ) -> None:
    r = _submit(gpu_server, HEADLINE + "n_gpu: 8\n")
    assert r.status_code == 200, r.text
    memory = r.json()["memory"]
    assert memory["fits"] is True and memory["peak_gib"] < memory["available_gib"]
    assert memory["parameters"] == 7_615_616_512
    assert "FSDP2" in memory["setup"] and "8 GPU(s)" in memory["setup"]


def test_memory_check_warn_accepts_a_job_that_does_not_fit(gpu_server: ServerHandle) -> None:
    r = _submit(gpu_server, HEADLINE + "n_gpu: 1\nmemory_check: warn\n")
    assert r.status_code == 200, r.text
    assert r.json()["memory"]["fits"] is False


def test_the_headline_job_gets_defaults_for_a_7b_model(gpu_server: ServerHandle) -> None:
    """Built as the seed writes it, with no lr, max_new_tokens or save_every: the server
    chooses them for a 7.6B model and says why."""
    job = AgentJetJob(experiment_name="remote_controlled_grpo", algorithm="grpo", n_gpu=8,
                      model=str(QWEN_7B), batch_size=32, num_repeat=4)
    assert "lr" not in yaml.safe_load(job.submit_yaml())  # only what the user set is sent
    with SwarmClient(gpu_server.url, timeout=60) as client:
        accepted = client.submit_config(job)
        config = accepted.config
        assert config["lr"] == 1e-6
        assert config["max_new_tokens"] == config["max_response_length"] == 1024
        assert config["save_every"] == 20
        assert config["micro_batch_tokens"] == 9216  # one whole sample: 8192 + 1024
        assert 1000 < config["boot_timeout_s"] < 1300 and 400 < config["stop_grace_s"] < 800
        notes = {n.field: n for n in accepted.notes if n.status == "default"}
        assert set(notes) >= {"lr", "max_new_tokens", "save_every", "micro_batch_tokens",
                              "boot_timeout_s", "stop_grace_s"}
        assert "over 1B parameters" in notes["lr"].reason
        assert accepted.memory is not None and accepted.memory["fits"] is True

        lora = client.submit_config(job.model_copy(update={"lora_rank": 16}))
        assert lora.config["lr"] == 5e-5 and lora.config["lora_target_modules"] == "all-linear"

        job.lr = 1e-4  # set by hand: kept, with a note naming the usual range
        hot = client.submit_config(job)
        assert hot.config["lr"] == 1e-4
        (unusual,) = [n for n in hot.notes if n.status == "unusual"]
        assert unusual.field == "lr" and "1e-07 to 1e-05" in unusual.reason
        assert "lr" not in {n.field for n in hot.notes if n.status == "default"}


def test_the_planner_of_the_synced_snapshot_decides(gpu_server: ServerHandle,
                                                    tmp_path: Path) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    plan_py = repo / "ajet" / "engine" / "planning" / "memory_plan.py"
    source = plan_py.read_text()
    patched = source.replace("_CUDA_CONTEXT = 1 * GiB", "_CUDA_CONTEXT = 100 * GiB")
    assert patched != source, "memory_plan.py changed shape; update this test"
    plan_py.write_text(patched)
    assert _submit(gpu_server, HEADLINE + "n_gpu: 8\n").status_code == 200  # server's code
    with SwarmClient(gpu_server.url) as client:
        client.push_code(repo)
    r = _submit(gpu_server, HEADLINE + "n_gpu: 8\n")
    assert r.status_code == 422 and "CUDA context" in r.json()["detail"][0]["msg"]

