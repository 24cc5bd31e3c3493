"""Several engine processes under torchrun (gloo on CPU), launched by a real swarm server."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import EngineStateConflict
from ajet.protocol import EngineState
from swarm_server.engine import engine_command
from swarm_server.settings import Settings
from tests.support import PROJECT_ROOT, process_alive, start_server

JOB = dict(batch_size=1, num_repeat=4, max_new_tokens=8, lr=0.01, seed=3)


def test_engine_command_wraps_multi_process_jobs_in_torchrun(tmp_path: Path) -> None:
    settings = Settings(workdir=tmp_path)
    kwargs: dict[str, Any] = {"run_id": "r", "run_dir": tmp_path, "socket_path": tmp_path / "s"}
    single = engine_command(settings, **kwargs, job={"n_gpu": 0, "n_proc": 1})
    assert single[1:3] == ["-m", "ajet.engine"]
    cpu = engine_command(settings, **kwargs, job={"n_gpu": 0, "n_proc": 2})
    assert cpu[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cpu and "--standalone" in cpu
    assert cpu[cpu.index("--config") - 2:cpu.index("--config")] == ["-m", "ajet.engine"]
    gpu = engine_command(settings, **kwargs, job={"n_gpu": 8, "n_proc": 1, "nnodes": 2,
                                                  "node_rank": 1,
                                                  "rdzv_endpoint": "10.0.0.1:29500"})
    assert "--nproc_per_node=8" in gpu and "--nnodes=2" in gpu and "--node_rank=1" in gpu
    assert "--master_addr=10.0.0.1" in gpu and "--master_port=29500" in gpu


def _episodes(client: SwarmClient, n: int) -> None:
    """n sequential episodes of one task (one worker)."""
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


@pytest.mark.slow
def test_two_gloo_ranks_both_generate_and_train(tmp_path: Path) -> None:
    """Every rank serves episodes; the update itself is checked against one process by
    `test_uneven_groups_over_two_ddp_ranks_give_the_one_process_update` (the samples
    differ here, since each rank samples with its own random stream)."""
    steps = 3
    server = start_server(tmp_path)
    try:
        with SwarmClient(server.url, timeout=60) as client:
            status = client.configure_and_start(AgentJetJob(n_proc=2, **JOB), wait_timeout=180)
            _episodes(client, steps * JOB["num_repeat"])
            deadline = time.monotonic() + 60
            while len(points := client.get_metrics().points) < steps:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            client.stop_run()
    finally:
        server.stop()
    assert all(math.isfinite(p["loss"]) and p["episodes"] == JOB["num_repeat"]
               for p in points)
    log = next((tmp_path / "runs").iterdir()).joinpath("engine.log").read_text()
    assert "[rank 1]" in log
    # rank 0 sent episodes to both ranks, and rank 1's own generator answered them
    routed = re.search(r"generation per rank: 0: (\d+) request\(s\), 1: (\d+) request", log)
    assert routed and int(routed[1]) > 0 and int(routed[2]) > 0, log[-3000:]
    served = re.search(r"rank 1 stopped after \d+ step\(s\); it generated (\d+) reply", log)
    assert served and int(served[1]) == int(routed[2])
    assert status.ajet_file == str(PROJECT_ROOT / "ajet" / "__init__.py")


@pytest.mark.slow
def test_uneven_groups_over_two_ddp_ranks_give_the_one_process_update(tmp_path: Path) -> None:
    probe = str(Path(__file__).with_name("ddp_probe.py"))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "HF_HUB_OFFLINE": "1"}
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, probe, str(tmp_path), str(one)], env=env, check=True,
                   timeout=120)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--standalone", probe, str(tmp_path), str(two)], env=env, check=True,
                   timeout=120)
    a, b = torch.load(one), torch.load(two)
    assert a["parameters"].shape == b["parameters"].shape
    # float rounding only: the sums are taken in another order (AdamW magnifies it)
    assert (a["parameters"] - b["parameters"]).abs().max().item() < 1e-4
    for x, y in zip(a["stats"], b["stats"], strict=True):
        assert x["tokens"] == y["tokens"] and x["samples"] == y["samples"] == 10
        assert x["grad_norm"] > 0
        for key in ("loss", "kl", "entropy", "clip_frac", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_a_killed_rank_brings_the_engine_offline_with_its_error(tmp_path: Path) -> None:
    server = start_server(tmp_path / "swarm")
    try:
        with SwarmClient(server.url, timeout=60) as client:
            status = client.configure_and_start(
                AgentJetJob(n_proc=2, **JOB), wait_timeout=180)
            assert status.pid is not None
            ranks = _children(status.pid)
            assert len(ranks) == 2
            victim = max(ranks)  # the later-started child: rank 1
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while (now := client.engine_status()).state != EngineState.OFFLINE:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert now.last_error is not None
            tail = "\n".join(now.last_error.log_tail)
            assert f"pid: {victim}" in tail and "SIGKILL" in tail
            deadline = time.monotonic() + 30
            while any(process_alive(p) for p in [status.pid, *ranks]):
                assert time.monotonic() < deadline, "a process of the engine tree survived"
                time.sleep(0.1)
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)
